"""Grading under real conditions: a busy machine never costs an honest student a point, and a
machine too slow to run the course's own cells gives FAILED TO GRADE, never a score.

A correct solution was once graded 0: on a busy, fresh machine the read-only setup cell (the
imports, 3 s of CPU) took more than the wall-clock limit, sat in native code where the
interrupt could not reach it, and the notebook was graded without it. Cells are now limited
by CPU time, and the cells before the first answer by nothing but a large ceiling
(assignments/course_tools/timekeeping.py). Here:

- ``test_solutions_keep_full_marks_on_a_busy_machine``: CPU-bound processes, four per core,
  each in its own session (``setsid``: the scheduler then shares the CPUs between them and
  the grader as between the kernels and test workers of a real grading server; busy loops in
  the grader's own session would be shielded from it by autogroup scheduling), started before
  the grade command, with the page cache dropped first where this process may (a cold start);
  the solutions are graded with the battery's short limits (tests/test_grading.py) and must
  score every point. ``BUSY_ASSIGNMENTS`` (comma-separated names, or ``all``) chooses the
  assignments and ``BUSY_CORES`` (``one`` or ``all``) where the load goes. ``make test``
  grades the assignment that was graded 0, with the processes and the grader confined to one
  core (four processes on it; the other cores go on with the rest of the tests: a busy
  one-core machine); ``make trust`` grades every assignment with four processes on every
  core (about 3 minutes an assignment on two cores).
- ``test_a_stalled_setup_cell_fails_to_grade``: a ceiling for the read-only cells shorter than
  the setup cell takes stands for a machine on which it cannot run: the notebook is run again
  alone, then reported FAILED TO GRADE (exit status 1, an empty score), never scored.
"""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
BIN = Path(sys.executable).parent
NAMES = sorted(p.name for p in (COURSE / "source").iterdir()
               if (p / f"{p.name}.ipynb").is_file())
DEFAULT_BUSY = ("argmax_attention",)
HOGS_PER_CORE = 4
SHORT_LIMITS = ("--cpu-limit=10", "--wall-limit=20")  # the battery's (tests/test_grading.py)



def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("MPLBACKEND", None)
    return env


def _course(tmp_path: Path, names) -> Path:
    """A scratch course with ``names`` generated and each source submitted by "solution"."""
    course = tmp_path / "course"
    course.mkdir()
    shutil.copy(COURSE / "nbgrader_config.py", course)
    for folder in ("course_tools", "rules"):
        shutil.copytree(COURSE / folder, course / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in names:
        shutil.copytree(COURSE / "source" / name, course / "source" / name)
        subprocess.run([str(BIN / "nbgrader"), "generate_assignment", name, "--force"],
                       cwd=course, env=_env(), check=True, capture_output=True, timeout=600)
        folder = course / "submitted" / "solution" / name
        folder.mkdir(parents=True)
        shutil.copy(course / "source" / name / f"{name}.ipynb", folder)
    return course


def _grade(course: Path, name: str, *limits: str, cores=None) -> subprocess.CompletedProcess:
    """The course's grade command; on ``cores`` only (it and every process it starts)."""
    return subprocess.run([sys.executable, "-m", "course_tools.grade", name, *limits],
                          cwd=course, env=_env(), capture_output=True, text=True, timeout=3600,
                          preexec_fn=None if cores is None else _pin(cores))


def _pin(cores):
    return lambda: os.sched_setaffinity(0, cores)


def _cores() -> set[int]:
    allowed = sorted(os.sched_getaffinity(0))
    return set(allowed) if os.environ.get("BUSY_CORES", "one") == "all" else {allowed[-1]}


def _rows(course: Path, name: str) -> list[dict]:
    with (course / "grades" / f"{name}.csv").open() as handle:
        return list(csv.DictReader(handle))


def _points(name: str) -> float:
    source = nbformat.read(COURSE / "source" / name / f"{name}.ipynb", as_version=4)
    return sum(c.metadata["nbgrader"].get("points", 0) for c in source.cells
               if c.metadata.get("nbgrader", {}).get("grade") and c.cell_type == "code")


@contextlib.contextmanager
def busy_machine(cores: set[int], per_core: int = HOGS_PER_CORE, bound_s: int = 3600):
    """``per_core`` CPU-bound processes per core of ``cores``, confined to them, each in a
    session of its own, for the block (each also ends by itself after ``bound_s``)."""
    spin = f"import time\nend = time.monotonic() + {bound_s}\nwhile time.monotonic() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True,
                             preexec_fn=_pin(cores))
            for _ in range(per_core * len(cores))]
    try:
        yield len(hogs)
    finally:
        for hog in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()


def _drop_page_cache() -> bool:
    """A cold start: the files torch and the kernel read come from disk again (root only)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _busy_assignments() -> list[str]:
    chosen = os.environ.get("BUSY_ASSIGNMENTS", ",".join(DEFAULT_BUSY))
    return NAMES if chosen == "all" else [n for n in chosen.split(",") if n]


def test_solutions_keep_full_marks_on_a_busy_machine(tmp_path):
    names = _busy_assignments()
    assert set(names) <= set(NAMES), f"unknown assignments in BUSY_ASSIGNMENTS: {names}"
    course, cores = _course(tmp_path, names), _cores()
    with busy_machine(cores) as hogs:
        cold = _drop_page_cache()
        results = {name: _grade(course, name, *SHORT_LIMITS, cores=cores) for name in names}
    for name, result in results.items():
        assert result.returncode == 0, (name, hogs, cold, result.stdout[-3000:],
                                        result.stderr[-2000:])
        rows = _rows(course, name)
        scored = sum(float(r["score"]) for r in rows if r["score"])
        assert scored == _points(name), (name, result.stdout[-3000:])
        assert "stopped" not in result.stdout and "limit:" not in result.stdout, result.stdout


def test_a_stalled_setup_cell_fails_to_grade(tmp_path):
    name = "argmax_attention"
    course = _course(tmp_path, [name])
    # the setup cell's imports take seconds: a 0.5 s ceiling is a machine that cannot run it
    result = _grade(course, name, *SHORT_LIMITS, "--instructor-limit=0.5")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "time limits per cell: 10 s of CPU time" in result.stdout  # the limits are shown
    table = result.stdout[result.stdout.index("== solution =="):]
    assert "FAILED TO GRADE" in table and "setup" in table and "twice" in table, table
    assert "rerun: setup" in table, table  # it was run again, alone, first
    assert [(r["status"], r["score"]) for r in _rows(course, name)] == [
        ("failed to grade", "")]


def test_a_notebook_past_its_total_time_loses_only_the_parts_after(tmp_path):
    """Cells each under the per-cell limits cannot hold the grader: past the notebook's total
    (``--notebook-limit``, here 2 s of the student's time) the running cell is interrupted and
    no later student cell runs; the parts before keep their points, and the report says which
    limit. The solution's answer to part 4 starts with a loop that computes until it is
    stopped: the 2 s run out there on any machine (the answers and tests before it take a
    fraction of a second, and the per-cell limit is 10 s), so parts 1-2 keep their points
    and parts 4-5 lose theirs."""
    name = "argmax_attention"
    course = _course(tmp_path, [name])
    path = course / "submitted" / "solution" / name / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    looping = [c for c in nb.cells
               if c.metadata.get("nbgrader", {}).get("grade_id") == "part4-grads-solution"]
    assert len(looping) == 1, "no part4-grads-solution cell"
    looping[0].source = "spins = 0\nwhile spins >= 0:\n    spins += 1\n\n" + looping[0].source
    nbformat.write(nb, path)
    result = _grade(course, name, *SHORT_LIMITS, "--notebook-limit=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "per notebook: 2 s of the student's time in all" in result.stdout
    assert "used up its 2 s of time in all" in result.stdout, result.stdout[-3000:]
    scored = {r["part"]: (float(r["score"]), float(r["max_score"]))
              for r in _rows(course, name) if r["score"]}
    assert scored == {"part1-scores-test": (1.0, 1.0), "part2-argmax-test": (2.0, 2.0),
                      "part4-grads-test": (0.0, 2.0), "part5-softmax-test": (0.0, 2.0)}, (
        scored, result.stdout[-3000:])
