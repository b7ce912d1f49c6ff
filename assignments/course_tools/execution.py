"""``GuardedExecute``: nbgrader's Execute step, in the sandbox, made robust to what a
submission can do to its kernel (configured in ``nbgrader_config.py``).

- The kernel runs in the sandbox of ``course_tools/sandbox.py`` (``SandboxedKernelManager``):
  no course folder, no network, limits on memory, processes and file size.
- A cell that ignores the interrupt sent at the time limit, or kills the kernel, makes
  nbclient give up on the whole notebook; here the notebook is then run again from a fresh
  kernel with that cell replaced by one that raises, so the rest is graded. The report says
  why (``it ran past the 30 s limit ...``, ``kernel killed: memory limit (4096 MiB)``,
  ``kernel killed by SIGSEGV``). Its original source is put back afterwards.
- Output limit: past ``max_output_bytes`` a cell's output is dropped as it arrives (its
  backlog is not even unpacked, ``course_tools/channels.py``), the cell is interrupted and
  fails with ``OutputLimitError``.
- Processes: while a cell runs, the processes of the sandbox are counted; near the process
  limit, every process the cell started is stopped (a fork bomb ends there), and whatever
  is still running when the cell ends is stopped too, so nothing it started reaches later
  cells.
- Time (``course_tools/timekeeping.py``): a cell is limited by the CPU time its processes
  use (``cpu_limit_s``), and by a wall-clock ceiling (``wall_limit_s``) only when it spent it
  waiting rather than computing; both are the student's, and the cell is interrupted (then
  stopped as above if it does not stop). A cell that the machine's load keeps from running
  goes on up to ``busy_limit_s``; the read-only cells before the first student cell (setup,
  grader tools: kernel start and first imports) have no CPU limit, only
  ``instructor_limit_s``. Past those the machine is at fault: the notebook is run once more,
  alone (no other notebook of this machine's graders runs meanwhile), and if that fails too
  the submission is not graded (``GradingFailed``: the grade command says FAILED TO GRADE
  with the reason and exits non-zero), never scored.
- Each limit reached is reported (kind ``limit``) in ``grading_reports/``, which the grade
  command prints.
"""

from __future__ import annotations

import asyncio
import copy
import time

import nbformat
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync
from nbgrader.preprocessors import Execute
from traitlets import Float, Integer, Unicode

from . import runtime_guard
from .channels import DROPPED
from .limits import LIMIT_SIGNS, limits_in_outputs, payload_size
from .preprocessors import CourseStep, _meta
from .sandbox import SandboxedKernelManager
from .timekeeping import (
    STUDENT,
    GradingLock,
    TimeLimits,
    Usage,
    Verdict,
    cell_roles,
    student_time,
    tree_usage,
    verdict,
)

STOPPED = (
    "# The grader stopped this cell: {reason}. The parts that use it score zero.\n"
    "class CellStoppedError(Exception):\n"
    "    pass\n\n\n"
    "raise CellStoppedError({reason!r})"
)

# How often the processes of the sandbox are counted while a cell runs (seconds), and the
# share of the process limit at which those the cell started are stopped.
PROCESS_POLL_S = 0.5
PROCESS_ALARM = 0.9
# How often the time a cell used is read (seconds).
TIME_POLL_S = 0.25


class GradingFailed(RuntimeError):
    """The machine, not the submission, kept a notebook from running, twice: not graded."""


class GuardedExecute(Execute):
    """nbgrader's Execute, in the sandbox, which survives a cell that cannot be interrupted."""

    max_stopped_cells = Integer(5, help="Cells that may be stopped before the notebook is "
                                        "given up (each costs one more run).").tag(config=True)
    interrupt_grace_s = Integer(2, help=(
        "Seconds a cell gets to stop after the interrupt sent at its time limit; a cell still "
        "running then is given up (its kernel killed, the notebook run again without it)."
    )).tag(config=True)
    max_output_bytes = Integer(2 * 1024 * 1024, help=(
        "Output a cell may send (text, images, errors), in bytes; past it the cell is "
        "interrupted and fails with OutputLimitError.")).tag(config=True)
    cpu_limit_s = Float(30, help=(
        "CPU seconds a cell may use (every process and thread of the kernel); past it the "
        "cell is interrupted. The read-only cells before the first answer have none."
        )).tag(config=True)
    wall_limit_s = Float(120, help=(
        "Wall-clock seconds after which a cell that spent most of them waiting (sleeping, "
        "blocked) rather than computing or queueing for a CPU is interrupted.")).tag(config=True)
    busy_limit_s = Float(900, help=(
        "Wall-clock seconds a cell kept from running by a busy machine may take; past them "
        "the notebook is run again alone, then reported not graded.")).tag(config=True)
    notebook_limit_s = Float(600, help=(
        "Seconds of the student's time (CPU time plus time spent waiting) that all the "
        "student cells of one notebook (answers and tests) may use together; past them the "
        "running cell and every later one are interrupted.")).tag(config=True)
    instructor_limit_s = Float(600, help=(
        "Wall-clock seconds a read-only cell before the first answer (setup, grader tools) may "
        "take; past them as for busy_limit_s.")).tag(config=True)
    lock_path = Unicode("/tmp/efficient-attention-grading.lock", help=(
        "Lock file shared by this machine's graders: a notebook run again because the machine "
        "was too busy runs alone. Empty: no lock.")).tag(config=True)
    startup_timeout = Integer(300, help="Seconds a kernel may take to start (a busy machine "
                                        "slows it; it counts against no cell).").tag(config=True)

    def __init__(self, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(**kwargs)
        self._last_km = None
        self._reset()

    def limits(self) -> TimeLimits:
        return TimeLimits(self.cpu_limit_s, self.wall_limit_s, self.busy_limit_s,
                          self.instructor_limit_s, self.notebook_limit_s)

    def _get_timeout(self, cell):
        # nbclient's own wall-clock timeout is only a backstop: _watch_time decides
        return int(max(self.busy_limit_s, self.instructor_limit_s, self.wall_limit_s)) + 120

    def _reset(self):
        self._time_stops: dict = {}  # cell index -> Verdict of the time (or disk) watch
        self._spent_s = 0.0  # the student's time of the student cells run so far
        self._abort = None  # the Verdict that made the watch end the run
        self._output_bytes: dict[int, int] = {}  # per cell
        self._cut: set[int] = set()  # cells past the output limit
        self._processes_stopped: dict[int, int] = {}  # per cell, by the process watch
        self._full_files: set[str] = set()
        self._pending = []
        self._events: list[str] = []  # limits reached in this run, reported if it completes

    def create_kernel_manager(self):
        self._last_km = super().create_kernel_manager()
        if isinstance(self._last_km, SandboxedKernelManager):
            self._last_km.max_message_bytes = self.max_output_bytes
        return self._last_km

    def _sandbox(self):
        km = self.km or self._last_km
        if isinstance(km, SandboxedKernelManager) and km.sandbox.enabled:
            return km
        return None

    # the output limit: enforced here, as messages arrive, before nbgrader stores anything
    def process_message(self, msg, cell, cell_index):
        dropped = DROPPED in msg["content"]
        if msg["msg_type"] in ("status", "execute_input") and not dropped:
            return super().process_message(msg, cell, cell_index)
        used = self._output_bytes.get(cell_index, 0) + payload_size(msg["content"])
        self._output_bytes[cell_index] = used
        if used <= self.max_output_bytes and not dropped:
            return super().process_message(msg, cell, cell_index)
        if cell_index not in self._cut:
            self._cut.add(cell_index)
            self.log.warning("cell %d sent more than %d bytes: interrupting it",
                             cell_index + 1, self.max_output_bytes)
            channel = self.kc.iopub_channel if self.kc is not None else None
            if hasattr(channel, "skip_parents"):  # the rest of its output is not even read
                channel.skip_parents.add(msg["parent_header"].get("msg_id"))
            self._pending.append(asyncio.ensure_future(self.km.interrupt_kernel()))
        return None

    # the process watch: a cell that fills the process limit loses the processes it started
    async def async_execute_cell(self, cell, cell_index, execution_count=None,
                                 store_history=True):
        box = self._sandbox()
        timed = cell.cell_type == "code" and bool(cell.source.strip())
        student = timed and self._roles[cell_index] == STUDENT
        if student:  # the notebook's time or scratch disk is used up: the cell is not run
            spent = self._spent_s >= self.notebook_limit_s and verdict(
                self.limits(), STUDENT, 0.0, Usage(), self._spent_s)
            refused = spent or self._disk_verdict(box)
            if refused:
                self._time_stops[cell_index] = refused
                cell.outputs = []
                return cell
        watches = [asyncio.ensure_future(self._watch_processes(box, cell_index))] if box else []
        if timed:
            previous = getattr(self, "task_poll_for_reply", None)  # another cell's
            watches.append(asyncio.ensure_future(self._watch_time(cell_index, previous)))
        iopub_timeout = self.iopub_timeout
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count,
                                                    store_history)
        finally:
            self.iopub_timeout = iopub_timeout
            for watch in watches:
                watch.cancel()
            # let them end here (the time watch charges the cell's time as it ends)
            await asyncio.gather(*watches, return_exceptions=True)
            if student and cell_index not in self._time_stops:
                # a cell that ended between two reads of the disk is checked at its end
                written = self._disk_verdict(box)
                if written:
                    self._time_stops[cell_index] = written
            stop = self._time_stops.get(cell_index)
            if box is not None and stop is not None and stop.limit == "disk":
                box.remove_written_files()  # later cells run with the disk as submitted

    # nbclient binds execute_cell to its own async_execute_cell when its class is made: bind
    # it to this one, or the watches never run
    execute_cell = run_sync(async_execute_cell)

    def _kernel_pid(self) -> int | None:
        km = self.km or self._last_km
        process = getattr(km, "_process", None) or getattr(
            getattr(km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)

    async def _watch_time(self, cell_index, previous):
        """Reads the time the cell uses; at a limit, interrupts it (the student's) or ends the
        run (the machine's, or a cell that did not stop within ``interrupt_grace_s``).
        ``previous``: nbclient's reply task of the cell before, never cancelled here."""
        pid = self._kernel_pid()
        if pid is None:
            return
        role, start, base = self._roles[cell_index], time.monotonic(), tree_usage(pid)
        box, limits, found = self._sandbox(), self.limits(), None
        try:
            while found is None:
                await asyncio.sleep(TIME_POLL_S)
                found = (verdict(limits, role, time.monotonic() - start,
                                 tree_usage(pid) - base, self._spent_s)
                         or self._disk_verdict(box))
        finally:  # the cell ended (this watch cancelled) or is stopped: charge its time
            if role == STUDENT:
                self._spent_s += student_time(tree_usage(pid) - base, time.monotonic() - start)
        self._time_stops[cell_index] = found
        self.log.warning("cell %d: %s", cell_index + 1, found.reason)
        if found.student:
            await self.km.interrupt_kernel()
            await asyncio.sleep(self.interrupt_grace_s)
        self._abort = found  # still running: end this run (the kernel is then killed)
        task = getattr(self, "task_poll_for_reply", None)
        if task is not None and task is not previous:
            task.cancel()

    @staticmethod
    def _disk_verdict(box) -> Verdict | None:
        """The scratch disk limit: the files the submission wrote in its writable folders,
        in bytes and in number (``Sandbox.disk_limit_mb``, ``Sandbox.max_files``)."""
        if box is None:
            return None
        problem = box.disk_problem()
        return None if problem is None else Verdict(True, problem, limit="disk")

    async def _async_handle_timeout(self, timeout, cell=None):
        """At the time limit nbclient interrupts the kernel and then waits ``iopub_timeout``
        for the cell to end; here it waits ``interrupt_grace_s`` (an interrupted cell that
        stops, stops within milliseconds; one that does not costs this wait each time)."""
        reply = await super()._async_handle_timeout(timeout, cell)
        self.iopub_timeout = min(self.iopub_timeout, self.interrupt_grace_s)
        return reply

    async def _watch_processes(self, box, cell_index):
        alarm = PROCESS_ALARM * box.sandbox.max_processes
        while True:
            await asyncio.sleep(PROCESS_POLL_S)
            if box.threads() >= alarm:
                stopped = box.stop_stray_processes()
                self._processes_stopped[cell_index] = (
                    self._processes_stopped.get(cell_index, 0) + stopped)

    def preprocess_cell(self, cell, resources, index):
        self._running_cell = index
        cell, resources = super().preprocess_cell(cell, resources, index)
        if cell.cell_type == "code":
            name = _meta(cell).get("grade_id") or f"cell {index + 1}"
            self._events += [f"{name}: {message}" for message in self._limits_reached(cell, index)]
        return cell, resources

    def _limits_reached(self, cell, index) -> list[str]:
        """What the cell ran into; stops the processes it left; marks it failed when its
        output was cut."""
        found, box = [], self._sandbox()
        stop = self._time_stops.get(index)
        if stop is not None and stop.student:
            ename = f"{stop.limit.title()}LimitError"
            cell.outputs.append(nbformat.v4.new_output(
                "error", ename=ename, evalue=stop.reason,
                traceback=[f"{ename}: the grader interrupted this cell: {stop.reason}"]))
            found.append(f"{stop.limit} limit: {stop.reason}; the cell was interrupted")
        if index in self._cut:
            limit = self.max_output_bytes
            cell.outputs.append(nbformat.v4.new_output(
                "error", ename="OutputLimitError", evalue=f"more than {limit} bytes of output",
                traceback=[f"OutputLimitError: the cell sent more than {limit} bytes of output; "
                           "the rest was dropped and the cell was interrupted"]))
            found.append(f"output limit ({limit} bytes) reached; the output was cut and the "
                         "cell interrupted")
        if box is None:
            return found
        limits = box.sandbox
        if index in self._processes_stopped:
            found.append(f"process limit ({limits.max_processes} processes and threads) "
                         f"reached: the {self._processes_stopped[index]} process(es) it "
                         "started were stopped")
        stray = box.stop_stray_processes()
        if stray:
            found.append(f"{stray} process(es) it started were still running at its end and "
                         "were stopped")
        full = sorted(set(box.files_at_limit()) - self._full_files)
        self._full_files.update(full)
        if full:
            found.append(f"file size limit ({limits.max_file_mb} MiB) reached by "
                         f"{', '.join(full)}")
        skip = tuple(signs for signs, _ in LIMIT_SIGNS
                     if "File too large" in signs and full
                     or "BlockingIOError" in signs and index in self._processes_stopped)
        if index not in self._cut:
            found += [message for message in limits_in_outputs(
                cell.outputs, limits.memory_limit_mb, limits.max_processes, limits.max_file_mb,
                skip) if message not in found]
        return found

    def _death_reason(self, error) -> str:
        if self._abort is not None:
            return f"{self._abort.reason} and did not stop when interrupted"
        if isinstance(error, DeadKernelError):
            km = self._last_km
            if isinstance(km, SandboxedKernelManager) and km.sandbox.enabled:
                return f"{km.death_reason()} while it ran"
            return "the kernel died while it ran (memory?)"
        return (f"it ran past the {self._get_timeout(None)} s backstop limit and did not stop "
                "when interrupted")

    def preprocess(self, nb, resources=None, km=None):
        stopped: dict[int, str] = {}
        originals = {}
        self._roles = cell_roles(nb.cells)
        # The runtime guard (course_tools/runtime_guard.py, the run-time half of the integrity
        # check) is installed in each kernel at its start, before the setup cell: nbclient
        # passes these arguments (IPKernelApp.exec_lines) to the kernel command.
        self.extra_arguments = runtime_guard.kernel_arguments(self, nb, resources)
        lock, alone = GradingLock(self.lock_path), False
        while True:
            work = copy.deepcopy(nb)
            for index, reason in stopped.items():
                work.cells[index].source = STOPPED.format(reason=reason)
            self._running_cell = None
            self._reset()
            try:
                with lock.hold(exclusive=alone):
                    work, resources = super().preprocess(work, resources, km)
                for event in self._events:
                    CourseStep.report(self, resources, "limit", event)
                break
            except (CellTimeoutError, DeadKernelError) as error:
                index = self._running_cell
                if self._abort is not None and not self._abort.student:
                    name = self._cell_name(nb, index)
                    if alone:
                        message = (f"FAILED TO GRADE: {name}: {self._abort.reason}, twice (the "
                                   "second time with no other notebook of this machine's "
                                   "graders running); grade it again when the machine is "
                                   "less busy")
                        CourseStep.report(self, resources, "failed", message)
                        raise GradingFailed(message) from error
                    CourseStep.report(self, resources, "rerun", f"{name}: {self._abort.reason};"
                                      " the notebook was run again, alone (no score lost)")
                    alone = True
                    continue
                if index is None or index in stopped or len(stopped) >= self.max_stopped_cells:
                    raise
                reason = self._death_reason(error)
                stopped[index] = reason
                originals[index] = nb.cells[index].source
                name = self._cell_name(nb, index)
                CourseStep.report(self, resources, "stopped", f"{name}: {reason}; the "
                                  "notebook was run again with that cell replaced by an error")
        for index, source in originals.items():
            work.cells[index].source = source
        nb.cells = work.cells
        nb.metadata = work.metadata
        return nb, resources

    @staticmethod
    def _cell_name(nb, index) -> str:
        if index is None:
            return "kernel start"
        return _meta(nb.cells[index]).get("grade_id") or f"cell {index + 1}"

    _paths = CourseStep._paths
