"""The time limits of autograding (assignments/course_tools/timekeeping.py): what a cell used,
read from /proc, and whose fault a stop is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "course_timekeeping", ROOT / "assignments" / "course_tools" / "timekeeping.py")
timekeeping = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = timekeeping  # dataclasses look their module up there
spec.loader.exec_module(timekeeping)

LIMITS = timekeeping.TimeLimits(cpu_s=10, wall_s=20, busy_s=300, instructor_s=600)
Usage = timekeeping.Usage


def test_a_cell_within_its_cpu_time_goes_on_however_long_the_machine_makes_it():
    # 200 s of wall-clock time for 9 s of CPU: runnable all along, starved by the load
    assert timekeeping.verdict(LIMITS, "student", 200, Usage(9, 200)) is None


def test_cpu_time_past_the_limit_is_the_students():
    found = timekeeping.verdict(LIMITS, "student", 11, Usage(10.5, 11))
    assert found.student and "10 s of CPU" in found.reason


def test_waiting_past_the_wall_limit_is_the_students():
    # a sleep: 20 s of wall-clock time, hardly any of it running or runnable
    found = timekeeping.verdict(LIMITS, "student", 20, Usage(0.1, 0.2))
    assert found.student and "waited" in found.reason
    # the same cell before the wall limit goes on
    assert timekeeping.verdict(LIMITS, "student", 19.9, Usage(0.1, 0.2)) is None


def test_a_cell_starved_past_the_busy_limit_is_the_machines():
    found = timekeeping.verdict(LIMITS, "student", 300, Usage(5, 290))
    assert not found.student and "busy" in found.reason


def test_instructor_cells_have_no_cpu_limit_and_are_never_the_students():
    assert timekeeping.verdict(LIMITS, "instructor", 100, Usage(50, 100)) is None
    assert timekeeping.verdict(LIMITS, "instructor", 100, Usage(0, 0)) is None
    found = timekeeping.verdict(LIMITS, "instructor", 600, Usage(3, 600))
    assert not found.student


def test_the_notebook_total_counts_cpu_and_waiting_but_not_queueing():
    limits = timekeeping.TimeLimits(cpu_s=10, wall_s=20, busy_s=300, instructor_s=600,
                                    notebook_s=50)
    # 9 s of CPU and 5 s asleep in 20 s, 6 s of it queued for a CPU: 14 s charged
    assert timekeeping.student_time(Usage(9, 15), 20) == pytest.approx(14)
    # a busy machine: 100 s queued for 3 s of CPU costs the student 3 s
    assert timekeeping.student_time(Usage(3, 100), 100) == pytest.approx(3)
    # many cells each under the per-cell limits: the one that passes the total is stopped
    assert timekeeping.verdict(limits, "student", 9, Usage(8, 9), spent_s=41) is None
    found = timekeeping.verdict(limits, "student", 9.5, Usage(9, 9.5), spent_s=41)
    assert found.student and "50 s of time in all" in found.reason and found.limit == "time"
    # the same for waiting: 10 s asleep after 45 s spent
    assert timekeeping.verdict(limits, "student", 10, Usage(0, 0), spent_s=45).student
    # instructor cells are not charged and not stopped by it
    assert timekeeping.verdict(limits, "instructor", 10, Usage(9, 10), spent_s=100) is None
    assert "50 s of the student's time in all" in limits.describe()


def _cell(cell_type, **nbgrader):
    return {"cell_type": cell_type, "metadata": {"nbgrader": nbgrader} if nbgrader else {}}


def test_roles_instructor_only_before_the_first_student_cell():
    setup = _cell("code", locked=True, grade=False, solution=False)
    answer = _cell("code", locked=False, grade=False, solution=True)
    test = _cell("code", locked=True, grade=True, solution=False)
    text = _cell("markdown")
    roles = timekeeping.cell_roles([text, setup, setup, text, answer, test, setup])
    assert roles[1:3] == ["instructor", "instructor"]
    assert roles[4:] == ["student"] * 3  # a read-only cell after an answer may call it
    # a cell the student added above the setup cell makes the setup cell the student's
    added = _cell("code")
    assert timekeeping.cell_roles([added, setup]) == ["student", "student"]


def test_tree_usage_counts_children_and_threads():
    script = ("import threading, time\n"
              "def spin():\n"
              "    end = time.thread_time() + 0.6\n"
              "    while time.thread_time() < end: pass\n"
              "t = threading.Thread(target=spin); t.start(); spin(); t.join()\n"
              "time.sleep(30)\n")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {script!r}])\n"
                               f"time.sleep(30)\n"])
    try:
        deadline = time.monotonic() + 60
        used = timekeeping.tree_usage(parent.pid)
        while used.cpu_s < 1.2 and time.monotonic() < deadline:
            time.sleep(0.2)
            used = timekeeping.tree_usage(parent.pid)
        # two threads of the grandchild spun 0.6 s each; interpreter start-ups add a little
        assert 1.2 <= used.cpu_s < 5
        assert used.runnable_s >= used.cpu_s * 0.9  # runnable time includes the CPU time
        idle = timekeeping.tree_usage(parent.pid)
        time.sleep(1.0)
        assert (timekeeping.tree_usage(parent.pid) - idle).cpu_s < 0.2  # sleeping: no CPU
    finally:
        for pid in _descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def _descendants(pid: int) -> list[int]:
    children = timekeeping._children()
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def test_tree_usage_of_a_process_that_ended_is_zero():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert timekeeping.tree_usage(process.pid) == Usage(0.0, 0.0)


def test_an_exclusive_hold_waits_for_shared_holders(tmp_path):
    lock = timekeeping.GradingLock(str(tmp_path / "grading.lock"))
    events = []
    with lock.hold():
        def alone():
            with timekeeping.GradingLock(lock.path).hold(exclusive=True):
                events.append("alone")

        thread = threading.Thread(target=alone)
        thread.start()
        time.sleep(0.3)
        events.append("shared released")
    thread.join(10)
    assert events == ["shared released", "alone"]


@pytest.mark.parametrize("path", [""])
def test_no_lock_path_means_no_lock(path):
    with timekeeping.GradingLock(path).hold(exclusive=True):
        with timekeeping.GradingLock(path).hold(exclusive=True):
            pass
