"""assignments/grader_tools.py, the read-only cell every assignment runs second: the tamper check
stays quiet when honest code imports torch._dynamo late, and still catches a replaced function.

Each case runs in a fresh interpreter (whether torch._dynamo is imported is process state), with
the setup cell of the assignments (make_notebook.DEFAULT_SETUP) first, as in a notebook.
"""

from __future__ import annotations

import re
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
        _, work = _grader.work(torch.ones, 3, 4)
        _, cost = _grader.cost_within(None, None, torch.ones, 3, 4)
        _, names = _grader.operators(torch.ones, 3, 4)
        host_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print("largest:", largest, "peak:", peak, "work:", work, cost.work, cost.largest,
              "operators:", names,
              "host peak under 1 MB:", host_peak < 2**20,
              "dynamo after the measurements:", "torch._dynamo" in sys.modules)
    """)
    assert done.returncode == 0, done.stderr
    assert "dynamo after the cell: False" in done.stdout, done.stdout
    assert ("largest: 12 peak: 80 work: 12 12 12 operators: ['aten.ones'] host peak under "
            "1 MB: True dynamo after the measurements: False") in done.stdout, done.stdout


def test_work_counts_every_operator():
    """_grader.work: products by their flops, views free, any other operator by the numbers
    it reads and writes; so quadratic work shows whatever operators it is made of."""
    done = _run_cells("""
        n, d = 50, 4
        q, k = torch.randn(n, d), torch.randn(n, d)
        cases = {
            "mm": (lambda: q @ k.T, 2 * n * n * d),
            "einsum": (lambda: torch.einsum("id,jd->ij", q, k), 2 * n * n * d),
            # the multiply reads 2 n d and writes n^2 d; the sum reads n^2 d and writes n^2
            "broadcast-sum": (lambda: (q[:, None, :] * k[None]).sum(-1),
                              2 * n * d + 2 * n * n * d + n * n),
            "ones-tril": (lambda: torch.ones(n, n).tril(), 3 * n * n),
            "cumsum": (lambda: torch.ones(n, n).cumsum(-1), 3 * n * n),
            "views": (lambda: (q[3:9].T, k.unfold(0, 5, 1), q.expand(2, n, d), q.view(d, n)), 0),
            "matrix-vector": (lambda: q @ k[0], 2 * n * d),
            "gather": (lambda: q[torch.tensor([1, 2, 3])], 3 + 2 * 3 * d),
            "template": (lambda: q.new_zeros(7), 7),
            # a convolution over the whole sequence: the flops of torch.utils.flop_counter
            "conv1d": (lambda: torch.nn.functional.conv1d(q.T[None], k.T[None], padding=n - 1),
                       2 * d * n * (2 * n - 1)),
        }
        for name, (fn, expected) in cases.items():
            _, got = _grader.work(fn)
            print(name, got == expected, got, expected)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 10 and all(line.split()[1] == "True" for line in lines), done.stdout


def test_cost_within_stops_early_and_measures_in_one_run():
    """cost_within: work, largest tensor and operators of one run; it raises at the first
    operator past a limit, and at the end when the function caught that error."""
    done = _run_cells("""
        x = torch.ones(100)
        calls = []

        def adds(x, times):
            for _ in range(times):
                calls.append(1)
                x = x + 1                      # 200 units each: reads 100, writes 100
            return x

        _, cost = _grader.cost_within(None, None, adds, x, 10)
        _, largest = _grader.largest_allocation(adds, x, 10)
        _, work = _grader.work(adds, x, 10)
        print("cost", cost.work == work, cost.largest == largest == 100, cost.operators)
        for limits in [(1000, None), (None, 3)]:
            calls.clear()
            try:
                _grader.cost_within(*limits, adds, x, 10)
                print("not stopped")
            except AssertionError as error:
                print("stopped after", len(calls), "|", error)

        def swallowing(x):
            for _ in range(10):
                try:
                    x = x + 1
                except AssertionError:
                    pass
            return x

        try:
            _grader.cost_within(500, None, swallowing, x)
            print("not stopped")
        except AssertionError as error:
            print("caught at the end |", error)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "cost True True 10", done.stdout
    assert lines[1].startswith("stopped after 6 | adds did more than 1000 units of work"), lines
    assert lines[2] == "stopped after 4 | adds ran more than 3 PyTorch operators", lines
    assert lines[3].startswith("caught at the end | swallowing did more than 500 units"), lines


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


def test_assert_close_is_torchs_without_importing_dtensor():
    """_grader.assert_close passes and fails exactly as torch.testing.assert_close, with the
    same messages, but leaves torch.distributed.tensor (and sympy) unimported: torch's first
    call imports them to unwrap DTensors, about a second of CPU in every graded notebook."""
    done = _run_cells("""
        import sys

        cases = [
            (torch.ones(3), torch.ones(3) + 1e-3, {}),
            (torch.ones(3), torch.ones(3) + 1e-3, {"rtol": 1e-2, "atol": 0}),
            (torch.ones(3), torch.ones(3, dtype=torch.float64), {}),
            (torch.ones(3), torch.ones(3, dtype=torch.float64), {"check_dtype": False}),
            (torch.ones(3), torch.ones(4), {}),
            (1.0, 1.1, {}),
            ((torch.ones(2), 3), (torch.ones(2), 4), {}),
            (torch.tensor([float("nan")]), torch.tensor([float("nan")]), {}),
            (torch.tensor([float("nan")]), torch.tensor([float("nan")]), {"equal_nan": True}),
            (torch.ones(2, 2), torch.ones(2, 2).t(), {"check_stride": True}),
            (torch.ones(3), 2 * torch.ones(3), {"msg": "custom message"}),
        ]

        def outcome(function, actual, expected, options):
            try:
                function(actual, expected, **options)
            except Exception as error:
                return f"{type(error).__name__}: {error}"
            return "passed"

        ours = [outcome(_grader.assert_close, *case) for case in cases]
        print("dtensor after ours:", "torch.distributed.tensor" in sys.modules,
              "sympy" in sys.modules)
        theirs = [outcome(torch.testing.assert_close, *case) for case in cases]
        print("dtensor after torch's:", "torch.distributed.tensor" in sys.modules)
        print("passed:", [o == "passed" for o in ours])
        print("same:", ours == theirs)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "dtensor after ours: False False", lines
    assert lines[1] == "dtensor after torch's: True", lines  # what the wrapper avoids
    assert lines[2] == ("passed: [False, True, False, True, False, False, False, False, True, "
                        "False, False]"), lines
    assert lines[3] == "same: True", lines


def test_operators_lists_every_operator_run_in_order():
    """_grader.operators: one name per PyTorch operator the call runs, in order, so a loop over
    n items shows n entries and a library softmax shows its name; it nests in a cost measure."""
    done = _run_cells("""
        x = torch.randn(6, 3, dtype=torch.float64)

        def looped(x):
            return torch.stack([row.exp() for row in x])

        def library(x):
            return torch.softmax(x, -1) + 1

        out, names = _grader.operators(looped, x)
        _grader.assert_close(out, x.exp())
        print("looped:", names.count("aten.exp"), names[-1])
        out, names = _grader.operators(library, x)
        print("library:", names)
        (_, cost), names = _grader.operators(_grader.cost_within, None, None, library, x)
        print("nested:", names, cost.operators)
    """)
    assert done.returncode == 0, done.stderr
    assert "looped: 6 aten.stack" in done.stdout, done.stdout
    assert "library: ['aten._softmax', 'aten.add']" in done.stdout, done.stdout
    assert "nested: ['aten._softmax', 'aten.add'] 2" in done.stdout, done.stdout


def test_test_cells_measure_operators_with_the_grader_tools():
    """Test cells count or list operators with _grader.operators, never with a dispatch mode of
    their own: a TorchDispatchMode subclass imports torch._dynamo at its first operator (about
    two seconds of CPU in every graded notebook) unless it overrides _should_skip_dynamo, as the
    grader tools' modes do; and torch.utils._python_dispatch, imported at test time, is a module
    an answer cell could have changed, which the grader tools' private copy is not."""
    import nbformat

    found = []
    for path in sorted((ROOT / "assignments" / "source").glob("*/*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type != "code" or not meta.get("grade"):
                continue
            if re.search(r"DispatchMode|_python_dispatch|__torch_dispatch__", cell.source):
                found.append(f"{path.stem} {meta['grade_id']}")
    assert found == [], found
