"""The opt-in CPU profile of a test run (``CPU_PROFILE=<folder>``, tests/conftest.py) and its
summary (tests/cpu_profile.py): CPU used by a process the test started but never reaped (as
a sandboxed kernel is, once bubblewrap is killed) is counted where a control group can be
made, and the summary says when it could not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import cpu_profile  # noqa: E402

BURN_S = 1.0  # CPU seconds the orphan spends

ORPHAN_TEST = textwrap.dedent(f"""
    import os, subprocess, sys, time

    def test_orphan_burns_cpu(tmp_path):
        done = tmp_path / "done"
        # a grandchild that outlives its parent (double fork): the test never reaps it
        subprocess.run([sys.executable, "-c", (
            "import os, sys, time\\n"
            "if os.fork(): os._exit(0)\\n"
            "start = time.process_time()\\n"
            "while time.process_time() - start < {BURN_S}: pass\\n"
            f"open({{str(done)!r}}, 'w').close()\\n")], check=True)
        deadline = time.monotonic() + 120
        while not done.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
""")


def test_profile_counts_processes_the_test_never_reaped(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "conftest.py").write_text(  # the course's hooks, under another module name
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('course_conftest', "
        f"{str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "course = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(course)\n"
        "pytest_runtest_protocol = course.pytest_runtest_protocol\n"
        "pytest_unconfigure = course.pytest_unconfigure\n")
    (tests / "test_orphan.py").write_text(ORPHAN_TEST)
    folder = tmp_path / "profile"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(tests)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CPU_PROFILE": str(folder)})
    assert run.returncode == 0, run.stdout + run.stderr
    rows, methods = cpu_profile.read(folder)
    assert [row[0].rpartition("::")[2] for row in rows] == ["test_orphan_burns_cpu"]
    cpu = rows[0][1]
    assert len(methods) == 1
    if methods == {"cgroup"}:  # the orphan's second of CPU is in the count
        assert cpu >= 0.9 * BURN_S, cpu
    else:  # the undercount this machine cannot avoid, and the summary says so
        assert methods == {"rusage"}
        assert cpu < 0.9 * BURN_S, cpu
    summary = subprocess.run([sys.executable, str(ROOT / "tests" / "cpu_profile.py"),
                              str(folder)], capture_output=True, text=True, check=True).stdout
    assert f"counted by {methods.pop()}" in summary
    assert "test_orphan.py" in summary


def test_summary_reads_old_profiles_without_a_method(tmp_path):
    (tmp_path / "1.tsv").write_text("tests/test_a.py::test_x\t2.5\t3.0\n"
                                    "tests/test_a.py::test_y\t1.5\t1.0\tcgroup\n")
    rows, methods = cpu_profile.read(tmp_path)
    assert rows == [("tests/test_a.py::test_x", 2.5, 3.0), ("tests/test_a.py::test_y", 1.5, 1.0)]
    assert methods == {"rusage", "cgroup"}
