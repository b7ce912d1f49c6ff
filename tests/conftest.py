"""Shared pytest configuration.

- CUDA tests are skipped where no GPU is visible.
- With pytest-xdist and ``--dist loadgroup`` (``make grading``, ``make test``), the tests of one
  assignment in tests/test_grading.py go to one worker, which grades that assignment once; the
  cells of one notebook (nbval) go to one worker, which runs them in order in one kernel; and
  the browser tests go to one worker, which starts one Chromium. ``make test`` hands out the
  longest groups first (``cost_rank``). xdist's own ``xdist_group``
  mark does not work with pytest 9 (xdist 3.8 renames the items' node ids, which pytest 9 no
  longer allows), so the groups are read from the node ids.
"""

from __future__ import annotations

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


# Files whose module fixtures are too costly to set up twice (one Chromium; one graded course).
# In tests/test_sandbox.py only the tests of the graded course (``attacked``) need to stay
# together: the two that grade or drive a kernel of their own may run elsewhere.
WHOLE_FILES = ("tests/test_browser.py", "tests/test_sandbox.py")
ALONE_IN_WHOLE_FILES = ("test_sandbox_alone_holds", "test_sandboxed_kernel_directly")

# The order in which ``make test`` hands out its groups (with --no-loadscope-reorder): the
# longest first (a minute or two each: a graded assignment, the sandbox's graded course, the
# browser checks, which may first install Chromium), then the benchmark scripts' quick runs
# (tens of seconds), the notebooks (seconds), and the unit tests (milliseconds), which fill
# the gaps at the end.
COST_RANKS = (("tests/test_grading.py", "tests/test_sandbox.py", "tests/test_browser.py",
               "tests/test_instructor_cycle.py"),
              ("tests/test_benchmark",))
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
# Every test's CPU seconds (the worker's own and those of the children it reaped: kernels,
# subprocesses, sandboxes; setup and teardown included) and wall seconds, one TSV per process,
# summed per file by `python tests/cpu_profile.py <folder>`. CPU seconds, unlike wall-clock
# durations, do not grow when the machine is busy, so a loaded run still says what to cut.

def _cpu_seconds() -> float:
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get("CPU_PROFILE")
    if not folder:
        yield
        return
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{os.getpid()}.tsv", "a", encoding="utf-8") as log:
        log.write(f"{item.nodeid}\t{cpu:.3f}\t{wall:.3f}\n")
