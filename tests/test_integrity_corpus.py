"""The integrity check (assignments/course_tools/integrity.py) never rejects honest code.

A corpus of ordinary answers in different styles (plain functions, classes, type hints,
``from __future__ import annotations``, ``typing``, expressions whose continued lines start with
``!=`` or ``%``, comments and docstring lines ending in ``?``, ``match``/``case``, ``except ...
as``, ``:=``, comprehensions, decorators, numpy, string formatting with ``%``) must pass the
check with no problem, with IPython's input transformations and without them (the copy
shipped to students may run where IPython is missing). The same check still rejects what
IPython would run hidden in syntax plain Python does not parse (prompts, an indented cell,
top-level ``await``, magics), and every form of binding of a protected name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "assignments"))
from course_tools import integrity  # noqa: E402

SETUP_NAMES = {"torch", "math", "np", "plt"}
TEST_NAMES = {"_expected", "_q", "_g", "_got"}  # what hidden tests define

CORPUS = {
    "plain": '''def attention_scores(q, k):
    """All dot products."""
    return q @ k.transpose(-2, -1)
''',
    "future-typing-hints": '''from __future__ import annotations

import typing
from typing import Callable, Optional, Sequence, Tuple, Union


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor] = None,
                      scale: Union[float, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def apply_all(functions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
              x: torch.Tensor | None) -> list[torch.Tensor]:
    return [f(x) for f in functions]


Pair = typing.Tuple[int, int]
''',
    "continued-operators": '''def check_shapes(q, k):
    same = (q.shape[-1]
            != k.shape[-1])
    parity = (q.shape[-2]
              % 2)
    label = ("%d queries"
             % q.shape[-2])
    total = q.shape[0] \\
        % 7
    return same, parity, label, total
''',
    "question-marks": '''def kernel(x):
    # is the feature map positive?
    # yes: elu + 1 > 0 everywhere?
    """Why elu + 1?

    Is it positive? Always. Does it matter?
    """
    question = "is this a question?"
    return torch.nn.functional.elu(x) + 1  # positive?
''',
    "module-class": '''class TinyAttention(torch.nn.Module):
    """One head. Which scale?"""

    def __init__(self, dim: int, heads: int = 1):
        super().__init__()
        self.proj = torch.nn.Linear(dim, 3 * dim)
        self.heads = heads

    @property
    def dim(self) -> int:
        return self.proj.in_features

    @staticmethod
    def split(x):
        return x.chunk(3, dim=-1)

    def forward(self, x):
        q, k, v = self.split(self.proj(x))
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dim), -1) @ v

    def __repr__(self):
        return f"TinyAttention({self.dim})"
''',
    "binding-forms": '''def describe(shape):
    match shape:
        case (n,):
            kind = f"vector of {n}"
        case (rows, cols) if rows == cols:
            kind = "square"
        case [first, *rest]:
            kind = f"{first} then {len(rest)}"
        case {"size": size, **others}:
            kind = f"sized {size} ({len(others)} more)"
        case _:
            kind = "other"
    try:
        count = math.prod(shape)
    except TypeError as error:
        raise ValueError(f"not a shape: {error}") from error
    if (half := count // 2) > 0:
        kind += f", half {half}"
    with torch.no_grad():
        for index, (size, step) in enumerate(zip(shape, range(len(shape)))):
            kind += f" {index}:{size}/{step}"
    return kind


counter = 0


def bump():
    global counter
    counter += 1
    return counter


results = [describe(s) for s in [(3,), (2, 2)]]
total = sum(x for x in range(3))
squares = {n: n * n for n in range(4)}
label = (lambda s: s.upper())("done")
del squares
''',
    "numpy-and-loops": '''def running_max(values):
    """Running maximum with numpy: is np.maximum.accumulate enough?"""
    array = np.asarray(values, dtype=np.float64)
    out = np.empty_like(array)
    best = -np.inf
    for i, value in enumerate(array):
        best = max(best, value)
        out[i] = best
    assert np.allclose(out, np.maximum.accumulate(array)), "mismatch?"
    return torch.from_numpy(out)


print("%s values, last %.3f" % (3, float(running_max([1, 3, 2])[-1])))
''',
    "decorators-and-generators": '''@torch.no_grad()
def greedy(logits, steps: int = 3):
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
    return out


def chunks(x, size):
    for start in range(0, x.shape[0], size):
        yield x[start:start + size]


class Running:
    def __init__(self):
        self.total = 0.0

    def __call__(self, value):
        self.total += value
        return self.total

    def __len__(self):
        return 1
''',
    "comments-only": '''# nothing to run here?
# just notes: why does softmax saturate?
''',
    "main-guard": '''if __name__ == "__main__":
    print(torch.ones(2).sum())
''',
}


@pytest.fixture(params=["with IPython", "without IPython"])
def ipython(request, monkeypatch):
    if request.param == "without IPython":  # the shipped checker where IPython is missing
        monkeypatch.setitem(sys.modules, "IPython.core.inputtransformer2", None)
    return request.param


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_honest_code_passes(name, ipython):
    assert integrity.check_source(CORPUS[name], None, SETUP_NAMES, TEST_NAMES) == [], (
        name, ipython)


HIDDEN = {  # what IPython runs although plain Python does not parse it
    "prompts": ">>> import os\n>>> os.getcwd()\n",
    "ipython-prompts": "In [1]: import os\n",
    "indented": "    import os\n    x = os.getcwd()\n",
    "top-level-await": "async def f():\n    return 1\nawait f()\n",
    "magic": "x = 1\n%load_ext autoreload\n",
    "shell": "!ls\n",
    "help": "torch.ones?\n",
    "cell-magic": "%%capture\nprint(1)\n",
}


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_syntax_ipython_runs_is_checked(name, ipython):
    problems = integrity.check_source(HIDDEN[name], None, SETUP_NAMES)
    if ipython == "without IPython" and name == "top-level-await":
        assert problems, name  # the plain parse knows top-level await
    assert problems, (name, ipython)


BINDINGS = {
    "assignment": "torch = None\n",
    "for": "for np in []:\n    pass\n",
    "with": "with open_thing() as math:\n    pass\n",
    "except": "try:\n    pass\nexcept ValueError as torch:\n    pass\n",
    "match-capture": "match 1:\n    case _grader:\n        pass\n",
    "match-as": "match 1:\n    case int() as np:\n        pass\n",
    "match-star": "match [1]:\n    case [*_grader]:\n        pass\n",
    "match-rest": "match {}:\n    case {**_grader}:\n        pass\n",
    "walrus": "[(_grader := 1) for _ in range(2)]\n",
    "import-alias": "from math import isclose as _grader_tools\n",
    "import-setup-name": "import numpy as torch\n",
    "definition": "def isinstance(a, b):\n    return True\n",
    "class": "class _grader:\n    pass\n",
    "global": "def f():\n    global abs\n    abs = None\n",
    "builtins-module": "__builtins__ = {}\n",
    "reads-test-name": "def f(q):\n    return _expected\n",
    "future-flag": "from __future__ import barry_as_FLUFL\n",
}


@pytest.mark.parametrize("name", sorted(BINDINGS))
def test_every_form_of_binding_is_rejected(name):
    assert integrity.check_source(BINDINGS[name], None, SETUP_NAMES, TEST_NAMES), name


def test_test_names_come_from_the_tests():
    """Names a test cell defines are reserved, unless the student's own cells define them."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch"),
        nbformat.v4.new_code_cell("def f(x):\n    return _expected + _mine\n",
                                  metadata={"nbgrader": {"solution": True, "grade": False,
                                                         "grade_id": "a", "locked": False}}),
        nbformat.v4.new_code_cell("_mine = 1\n"),
        nbformat.v4.new_code_cell("_expected = 2\n_got = f(1)\nassert _got == 3\n",
                                  metadata={"nbgrader": {"grade": True, "solution": False,
                                                         "grade_id": "t", "locked": True,
                                                         "points": 1}}),
    ])
    checked = integrity.cells_to_check(nb)
    assert integrity.tests_names(nb, checked) == {"_expected", "_got"}
    found = integrity.check_notebook(nb)
    assert list(found) == [1] and "_expected" in found[1][0][1], found
