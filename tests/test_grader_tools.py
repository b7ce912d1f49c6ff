"""assignments/grader_tools.py, the read-only cell every assignment runs second: the tamper check
stays quiet when honest code imports torch._dynamo late, and still catches a replaced function.

Each case runs in a fresh interpreter (whether torch._dynamo is imported is process state), with
the setup cell of the assignments (make_notebook.DEFAULT_SETUP) first, as in a notebook.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "assignments"))
from make_notebook import DEFAULT_SETUP  # noqa: E402

GRADER_TOOLS = (ROOT / "assignments" / "grader_tools.py").read_text(encoding="utf-8")


def _run_cells(after: str) -> subprocess.CompletedProcess:
    program = "\n\n".join([DEFAULT_SETUP, GRADER_TOOLS, textwrap.dedent(after)])
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300)


def test_grader_tools_and_measurements_do_not_import_dynamo():
    """Importing torch._dynamo costs about a second of CPU per graded notebook, and inside a
    measurement its tens of MB of Python objects would count in the tracemalloc peak of the
    tests that look for an n x n numpy array."""
    done = _run_cells("""
        import sys
        import tracemalloc
        print("dynamo after the cell:", "torch._dynamo" in sys.modules)
        tracemalloc.start()
        _, largest = _grader.largest_allocation(torch.ones, 3, 4)
        _, peak = _grader.peak_bytes(torch.ones, 5, 4)
        host_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print("largest:", largest, "peak:", peak, "host peak under 1 MB:", host_peak < 2**20,
              "dynamo after the measurements:", "torch._dynamo" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr
    assert "dynamo after the cell: False" in done.stdout, done.stdout
    assert ("largest: 12 peak: 80 host peak under 1 MB: True dynamo after the measurements: "
            "False") in done.stdout, done.stdout


@pytest.mark.parametrize("late_import", [
    "import torch._dynamo",
    "model = torch.nn.Linear(2, 2)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "model(torch.ones(1, 2)).sum().backward()\n"
    "optimizer.step()\noptimizer.zero_grad()",
    "torch.manual_seed(1)",
])
def test_a_late_dynamo_import_is_not_tampering(late_import):
    done = _run_cells(late_import + "\nimport sys\n"
                      "assert 'torch._dynamo' in sys.modules\n_grader.check()\nprint('clean')")
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-3000:]


def test_a_replaced_function_is_still_caught():
    """After torch._dynamo is imported, each replacement is caught, the wrapped manual_seed put
    back by its original included; with everything restored the check is quiet again."""
    done = _run_cells("""
        import torch._dynamo

        tampers = [(torch, "manual_seed", lambda seed: None),
                   (torch.testing, "assert_close", lambda *a, **k: None),
                   (torch, "manual_seed", torch.random.manual_seed)]
        for owner, name, replacement in tampers:
            saved = getattr(owner, name)
            setattr(owner, name, replacement)
            try:
                _grader.check()
                print("missed", name)
            except _grader.TamperedError:
                print("caught", name)
            setattr(owner, name, saved)
        _grader.check()
        print("restored: clean")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["caught", "manual_seed", "caught", "assert_close", "caught",
                                   "manual_seed", "restored:", "clean"], done.stdout
