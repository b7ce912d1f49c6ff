"""Time limits that measure the submission, not the machine (used by ``GuardedExecute``).

A wall-clock limit punishes a student for the load of the grading machine: on a busy server
(other kernels, test workers, a build) an honest cell takes many times longer than on a quiet
one, and a read-only setup cell sitting in native code (``import torch``) cannot even be
interrupted. So a cell is measured by what its own processes did, read from ``/proc``:

- **CPU time** (``utime + stime`` of every process and thread of the kernel, and of the
  children they waited for): the work the cell did. It barely changes with the machine's
  load. A cell that uses more than ``cpu_s`` is the student's: it is interrupted.
- **Runnable time** (per thread, ``/proc/<pid>/task/<tid>/schedstat``: time on a CPU plus time
  waiting in a run queue for one): the time the cell *wanted* to compute. A cell past the
  wall-clock ``wall_s`` whose runnable time is under half of it was mostly sleeping or
  blocked (``time.sleep``, a wait that never ends): that is the student's too.
- A cell past ``wall_s`` that was runnable most of the time is being starved by the machine;
  it goes on, up to ``busy_s``. Past that, or an instructor cell past ``instructor_s``, it is
  **the machine's** fault: the notebook is run again, alone, and if that fails too the
  submission is reported as not graded, never scored.

A whole notebook is limited too (``notebook_s``): its student cells together may use that
many seconds of *the student's time*, CPU time plus time spent waiting (wall-clock time not
runnable), so that many cells each just under the per-cell limits cannot hold a grader for
hours. Past it, the running cell and every later cell are interrupted (their parts score 0).

Instructor cells are the read-only cells that run before any student cell (setup, grader
tools): no student code has run yet, so only the machine can make them slow; they have no
CPU limit (the first imports cost several seconds of CPU). Every later cell may run student
code (test cells call the student's functions) and gets the student limits; the tests' own
code uses a small part of the CPU limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STUDENT, INSTRUCTOR = "student", "instructor"
# a cell past wall_s counts as waiting (the student's) when runnable less than this share
RUNNABLE_SHARE = 0.5


@dataclass(frozen=True)
class TimeLimits:
    """Seconds: CPU per cell; wall-clock ceiling for a waiting cell; ceiling for a cell that
    a busy machine keeps from running; ceiling for an instructor cell; the student's time
    (CPU plus waiting) of all student cells of a notebook together."""

    cpu_s: float
    wall_s: float
    busy_s: float
    instructor_s: float
    notebook_s: float = 600.0

    def describe(self) -> str:
        return (f"time limits per cell: {self.cpu_s:g} s of CPU time; {self.wall_s:g} s of "
                f"wall-clock time spent waiting; a cell a busy machine keeps from running may "
                f"take up to {self.busy_s:g} s (read-only setup cells {self.instructor_s:g} s)"
                " before the notebook is run again alone, then reported not graded; per "
                f"notebook: {self.notebook_s:g} s of the student's time in all (CPU time plus "
                "time spent waiting)")


@dataclass(frozen=True)
class Usage:
    """Seconds used by a process tree so far: CPU time and runnable time (running or
    waiting in a run queue)."""

    cpu_s: float = 0.0
    runnable_s: float = 0.0

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu_s - other.cpu_s, self.runnable_s - other.runnable_s)


def student_time(used: Usage, elapsed_s: float) -> float:
    """What a student cell is charged against the notebook's limit: its CPU time plus the
    wall-clock time it was not runnable (sleeping, blocked). Time spent queued for a CPU on a
    busy machine is not charged."""
    return used.cpu_s + max(0.0, elapsed_s - used.runnable_s)


@dataclass(frozen=True)
class Verdict:
    """Why a cell is stopped (in words, for the report), whether that is the student's
    fault (``student``) or the machine's, and the limit reached (the error a stopped student
    cell shows is named after it: ``TimeLimitError``, ``DiskLimitError``)."""

    student: bool
    reason: str
    limit: str = "time"


def verdict(limits: TimeLimits, role: str, elapsed_s: float, used: Usage,
            spent_s: float = 0.0) -> Verdict | None:
    """Whether a cell that has run ``elapsed_s`` of wall-clock time and used ``used`` must be
    stopped, and whose fault that is; None while it may go on. ``spent_s``: the student's
    time (``student_time``) of the notebook's earlier student cells."""
    if role == INSTRUCTOR:
        if elapsed_s >= limits.instructor_s:
            return Verdict(False, f"a read-only cell took more than {limits.instructor_s:g} s "
                                  f"of wall-clock time ({used.cpu_s:.1f} s of CPU): the machine "
                                  "was too busy, or the course's setup is stuck")
        return None
    if used.cpu_s >= limits.cpu_s:
        return Verdict(True, f"it used more than {limits.cpu_s:g} s of CPU time")
    if elapsed_s >= limits.wall_s and used.runnable_s < RUNNABLE_SHARE * elapsed_s:
        return Verdict(True, f"it waited (slept or blocked) past the {limits.wall_s:g} s "
                             "wall-clock limit")
    if spent_s + student_time(used, elapsed_s) >= limits.notebook_s:
        return Verdict(True, f"the notebook used up its {limits.notebook_s:g} s of time in all "
                             "(CPU time plus time spent waiting, over its answer and test "
                             "cells)")
    if elapsed_s >= limits.busy_s:
        return Verdict(False, f"the machine was too busy: {elapsed_s:.0f} s of wall-clock time "
                              f"gave the cell only {used.cpu_s:.1f} s of CPU")
    return None


def cell_roles(cells) -> list[str]:
    """``INSTRUCTOR`` for each read-only code cell before the first code cell a student wrote
    (an answer cell, or any cell that is not read-only), ``STUDENT`` for every other cell."""
    roles, student_seen = [], False
    for cell in cells:
        meta = cell.get("metadata", {}).get("nbgrader", {}) or {}
        if cell.get("cell_type") == "code":
            student_seen = student_seen or bool(meta.get("solution")) or not meta.get("locked")
        read_only = meta.get("locked") and not meta.get("grade") and not meta.get("solution")
        roles.append(INSTRUCTOR if read_only and not student_seen else STUDENT)
    return roles


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the state (3rd) on


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _runnable_s(pid: int) -> float:
    total = 0
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"{task.path}/schedstat") as f:
                running, waiting = f.read().split()[:2]
                total += int(running) + int(waiting)
    return total / 1e9


def tree_usage(root: int) -> Usage:
    """CPU and runnable seconds of ``root`` and every process under it (all threads; the CPU
    time of children they waited for included)."""
    children, todo, cpu, runnable = _children(), [root], 0, 0.0
    while todo:
        pid = todo.pop()
        fields = _stat_fields(pid)
        if fields is None:
            continue
        cpu += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime (ticks)
        runnable += _runnable_s(pid)
        todo += children.get(pid, [])
    return Usage(cpu / CLOCK_TICKS, runnable)


class GradingLock:
    """One lock file for every grader of this machine: each notebook run holds it shared; a
    run that a busy machine spoiled is repeated holding it exclusively, so that no other
    notebook of this machine's graders runs beside it."""

    def __init__(self, path: str):
        self.path = path

    @contextlib.contextmanager
    def hold(self, exclusive: bool = False):
        if not self.path:
            yield
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock
