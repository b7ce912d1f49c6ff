"""Shared pytest configuration.

- CUDA tests are skipped where no GPU is visible.
- With pytest-xdist and ``--dist loadgroup`` (``make grading``, ``make test``), the tests of one
  assignment in tests/test_grading.py go to one worker, which grades that assignment once; the
  cells of one notebook (nbval) go to one worker, which runs them in order in one kernel; and
  the browser tests go to one worker, which starts one Chromium (so do the other files of
  ``WHOLE_FILES``, whose module fixtures are costly). ``make test`` hands out the
  longest groups first (``cost_rank``). xdist's own ``xdist_group``
  mark does not work with pytest 9 (xdist 3.8 renames the items' node ids, which pytest 9 no
  longer allows), so the groups are read from the node ids.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    page_major(items)
    if hasattr(config, "workerinput"):  # an xdist worker: the order xdist hands groups out in
        items.sort(key=lambda item: cost_rank(item.nodeid))  # stable: groups stay in order
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


# Files whose module fixtures are too costly to set up twice: one Chromium; one graded course;
# one guarded kernel (tests/test_runtime_guard.py); one spawn of four ranks that import torch
# (tests/test_distributed.py); one quick training run (tests/test_benchmark_recurrent.py). A
# module fixture is set up once per worker that runs one of its tests: split over four
# workers, the last three cost about 120 CPU-seconds more per `make test` (CPU_PROFILE).
# In tests/test_sandbox.py only the tests of the graded course (``attacked``) need to stay
# together: the two that grade or drive a kernel of their own may run elsewhere.
WHOLE_FILES = ("tests/test_browser.py", "tests/test_sandbox.py", "tests/test_runtime_guard.py",
               "tests/test_distributed.py", "tests/test_benchmark_recurrent.py")
ALONE_IN_WHOLE_FILES = ("test_sandbox_alone_holds", "test_sandboxed_kernel_directly")

# The order in which ``make test`` hands out its groups (with --no-loadscope-reorder): the
# longest first (a minute or two each: a graded assignment, the sandbox's graded course, the
# browser checks, which may first install Chromium), then the benchmark scripts' quick runs,
# the guarded kernel and the ranks (tens of seconds), the notebooks (seconds), and the unit
# tests (milliseconds), which fill the gaps at the end.
COST_RANKS = (("tests/test_grading.py", "tests/test_sandbox.py", "tests/test_browser.py",
               "tests/test_instructor_cycle.py"),
              ("tests/test_benchmark", "tests/test_runtime_guard.py",
               "tests/test_distributed.py"))
# Last of all: the grading under load (tests/test_grading_load.py), whose CPU-bound processes
# would slow every test running beside them.
LAST = ("tests/test_grading_load.py",)


def cost_rank(nodeid: str) -> int:
    path = nodeid.partition("::")[0]
    if path.startswith(LAST):
        return len(COST_RANKS) + 2
    for rank, prefixes in enumerate(COST_RANKS):
        if path.startswith(prefixes):
            return rank
    return len(COST_RANKS) + (0 if path.endswith(".ipynb") else 1)


def page_major(items) -> None:
    """Reorder the browser tests (tests/test_browser.py) page by page, in place: every test of
    one page (parameter ``entry``) runs before the next page's, in file order, so that the
    browser keeps one page open at a time. Other tests keep their places."""
    slots = [index for index, item in enumerate(items)
             if item.nodeid.startswith("tests/test_browser.py")
             and "entry" in getattr(getattr(item, "callspec", None), "params", {})]
    browser_items = [items[index] for index in slots]
    first_seen: dict[str, int] = {}
    for item in browser_items:
        first_seen.setdefault(item.callspec.params["entry"], len(first_seen))
    browser_items.sort(key=lambda item: first_seen[item.callspec.params["entry"]])
    for index, item in zip(slots, browser_items, strict=True):
        items[index] = item


def work_unit(nodeid: str, assignments: set[str]) -> str:
    """The group of tests that must run in one worker: a notebook, a file of WHOLE_FILES (but
    ALONE_IN_WHOLE_FILES), or one assignment of tests/test_grading.py (ids ``[name]`` and
    ``[name-student]``); else the test alone."""
    path, _, rest = nodeid.partition("::")
    if path in WHOLE_FILES and rest.partition("[")[0] in ALONE_IN_WHOLE_FILES:
        return nodeid
    if path.endswith(".ipynb") or path in WHOLE_FILES:
        return path
    if path.endswith("test_grading.py"):
        found = re.search(r"\[([^\]-]+)(?:-[^\]]*)?\]$", rest)
        if found and found.group(1) in assignments:
            return f"{path}::{found.group(1)}"
    return nodeid


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    assignments = {p.name for p in (ROOT / "assignments" / "source").iterdir() if p.is_dir()}

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (whole groups to a worker; biggest groups first, or in
        collection order with ``--no-loadscope-reorder``) over the groups of ``work_unit``."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, assignments)

    return GroupScheduling(config, log)


# --- where the CPU goes (opt-in: CPU_PROFILE=<folder>) ----------------------------------------
# Every test's CPU seconds (setup and teardown included) and wall seconds, one TSV per process,
# summed per file by `python tests/cpu_profile.py <folder>`. CPU seconds, unlike wall-clock
# durations, do not grow when the machine is busy, so a loaded run still says what to cut.
# Counted, where the process may make a control group (root, cgroup v1 `cpuacct` or v2): the
# CPU of every process in the worker's own group, i.e. everything it started, including what
# resource usage misses: a sandboxed kernel whose parent (bubblewrap) is killed at shutdown is
# never reaped by the worker, and its CPU (most of a graded notebook's: 13 of 20 s for one
# solution) never reaches RUSAGE_CHILDREN. Elsewhere: the worker's own CPU and that of the
# children it reaped, an undercount that the summary flags ("rusage").
_CGROUP_USAGE: list[Path | None] = []  # [usage file] once the worker has looked


def _own_cgroup() -> Path | None:
    """The file holding the CPU time of a new control group made for this process (moved into
    it), or None where none can be made."""
    name = f"efficient-attention-profile-{os.getpid()}"
    for parent, usage in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"),
                          (Path("/sys/fs/cgroup/unified"), "cpu.stat"),
                          (Path("/sys/fs/cgroup"), "cpu.stat")):
        if not (parent / "cgroup.procs").is_file():
            continue
        group = parent / name
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
            if (group / usage).is_file():
                return group / usage
        except OSError:
            pass
        with contextlib.suppress(OSError):  # not usable: leave no empty group behind
            group.rmdir()
    return None


def _cpu_seconds() -> tuple[float, str]:
    """CPU seconds so far of this process and what it started, and how they were counted."""
    if not _CGROUP_USAGE:
        _CGROUP_USAGE.append(_own_cgroup())
    usage = _CGROUP_USAGE[0]
    if usage is not None:
        text = usage.read_text()
        if usage.name == "cpuacct.usage":
            return int(text) / 1e9, "cgroup"
        fields = dict(line.split() for line in text.splitlines())
        return int(fields["usage_usec"]) / 1e6, "cgroup"
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, "rusage"


def pytest_unconfigure(config):
    """Leave the profile's control group (back to its parent) and remove it once empty."""
    usage = _CGROUP_USAGE[0] if _CGROUP_USAGE else None
    if usage is None:
        return
    group = usage.parent
    try:
        (group.parent / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()  # refused while a process that the tests left behind is still in it
    except OSError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get("CPU_PROFILE")
    if not folder:
        yield
        return
    (cpu, _), wall = _cpu_seconds(), time.perf_counter()
    yield
    (cpu_end, method), wall = _cpu_seconds(), time.perf_counter() - wall
    cpu = cpu_end - cpu
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{os.getpid()}.tsv", "a", encoding="utf-8") as log:
        log.write(f"{item.nodeid}\t{cpu:.3f}\t{wall:.3f}\t{method}\n")
