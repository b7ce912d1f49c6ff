"""Submissions of argmax_attention that are numerically right but break the statement, that
attack the grader (issue 25.3), or that the statement allows (``must_fail`` empty).

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
``attacks`` names the class of attack (tests/test_runtime_guard.py lists them and checks that
each has cases). Every attack is written so that, if nothing stopped it, the test it aims at
would pass with a wrong answer. ``attention_scores`` (part 1) is used by ``argmax_attention``
(part 2), so a part-1 attack costs part 2 too; cases on different cells are graded in one
submission (tests/cheats/common.py, ``combine_cases``, in this order), so the attacks on part
2 come with an intact or honest part 1 and part 2 is lost to the attack itself.
``torch._utils._import_dotted_name`` imports and looks up any dotted name: the integrity check
cannot see what it reaches, the runtime guard (assignments/course_tools/runtime_guard.py)
refuses what it is used for.
"""

CASES = [
    {
        # Part 2 forbids a Python loop over the queries: right values, one loop per query.
        "name": "loop-over-queries-part2",
        "cell": "part2-argmax-solution",
        "source": '''def argmax_attention(q, k, v):
    """out[..., i, :] = v[..., j*, :] with j* = argmax_j q_i . k_j (first index on ties)."""
    rows = []
    for i in range(q.shape[-2]):
        scores = attention_scores(q[..., i : i + 1, :], k)        # (..., 1, n_k)
        best = scores.argmax(dim=-1)                              # (..., 1)
        weights = torch.nn.functional.one_hot(best, k.shape[-2]).to(v.dtype)
        rows.append(weights @ v)                                  # (..., 1, d_v)
    return torch.cat(rows, dim=-2)''',
        "must_fail": {"part2-argmax-test"},
    },
    {
        # Syntax the check did not parse: a top-level `await` made the cell unparseable as
        # plain Python, so the check skipped it, and IPython ran it (autoawait): the grader's
        # tools rebound to a lenient fake, with a wrong answer. Rejected by the check (and the
        # guard puts _grader back before every test).
        "name": "top-level-await-hides-cell-part1",
        "attacks": "binding",
        "cell": "part1-scores-solution",
        "source": '''class _Lenient:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


async def _nothing():
    return None


await _nothing()
_grader = _Lenient()


def attention_scores(q, k):
    """Wrong: forgets the last coordinate."""
    return q[..., :-1] @ k[..., :-1].transpose(-2, -1)''',
        "must_fail": {"part1-scores-test", "part2-argmax-test"},
    },
    {
        # Honest code the check must never reject: `from __future__`, typing, type hints, an
        # expression whose continued lines start with != and %, comments and docstring lines
        # ending in a question mark.
        "name": "honest-syntax-part1-allowed",
        "cell": "part1-scores-solution",
        "source": '''from __future__ import annotations

from typing import Optional

import torch


def attention_scores(q: torch.Tensor, k: torch.Tensor,
                     scale: Optional[float] = None) -> torch.Tensor:
    """All dot products s[..., i, j] = q[..., i, :] . k[..., j, :].

    Why a transpose?
    Because k holds the keys as rows: q k^T pairs every query with every key.
    """
    # do the last dimensions agree?
    assert (q.shape[-1]
            == k.shape[-1]), "q and k need the same feature dimension"
    same = (q.shape[-1]
            != 0)
    parity = (q.shape[-1]
              % 2)
    scores = q @ k.transpose(-2, -1)
    if scale is not None and same and parity >= 0:
        scores = scores * scale
    return scores''',
        "must_fail": set(),
    },
    {
        # A function the tests call that the grader tools do not watch: the hidden loop test
        # counts operators with torch.utils._python_dispatch.TorchDispatchMode, replaced here
        # through a class keyword (__init_subclass__ gets the module as a parameter) by a
        # "mode" that never records anything; the answer loops over the queries.
        "name": "class-keyword-replaces-dispatch-mode-part2",
        "attacks": "binding",
        "cell": "part2-argmax-solution",
        "source": '''def argmax_attention(q, k, v):
    """Loops over the queries (the statement forbids it)."""
    rows = []
    for i in range(q.shape[-2]):
        best = attention_scores(q[..., i : i + 1, :], k).argmax(dim=-1)
        rows.append(torch.nn.functional.one_hot(best, k.shape[-2]).to(v.dtype) @ v)
    return torch.cat(rows, dim=-2)


class _Blind:
    """Looks like a dispatch mode, records nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class _Patch:
    def __init_subclass__(cls, module=None, **kwargs):
        module.TorchDispatchMode = _Blind


class _Applied(_Patch, module=torch.utils._python_dispatch):
    pass''',
        "must_fail": {"part2-argmax-test"},
    },
    {
        # Tampering through the objects the tests pass in: wrong for batched inputs, it zeroes
        # the test's values in place, so that a reference computed after the call agrees.
        "name": "modifies-test-inputs-part2",
        "attacks": "test-objects",
        "cell": "part2-argmax-solution",
        "source": '''def argmax_attention(q, k, v):
    """Right for one sequence; for batched inputs, zeros (and zeroes v to match)."""
    if q.dim() == 2:
        best = attention_scores(q, k).argmax(dim=-1)
        return torch.nn.functional.one_hot(best, k.shape[-2]).to(v.dtype) @ v
    v.zero_()
    return v.new_zeros(*q.shape[:-1], v.shape[-1])''',
        "must_fail": {"part2-argmax-test"},
    },
    {
        # A dispatch mode entered by the answer and left active: every operator the test runs
        # afterwards (its comparisons) goes through it, and it reports "close" for all.
        "name": "dispatch-mode-left-active-part4",
        "attacks": "lying-objects",
        "cell": "part4-grads-solution",
        "source": '''from torch.utils._python_dispatch import TorchDispatchMode


class _Agreeable(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("isclose", "eq", "allclose", "equal")):
            return torch.ones_like(out, dtype=torch.bool) if out.dim() else out.new_ones(())
        return out


def argmax_attention_grads(q, k, v, grad_out):
    """Wrong gradients (all zero), then a mode that makes every comparison agree."""
    _Agreeable().__enter__()
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)''',
        "must_fail": {"part4-grads-test"},
    },
    {
        # except ... as rebinds (and then deletes) a name of the setup cell.
        "name": "except-as-deletes-setup-name-part4",
        "attacks": "binding",
        "cell": "part4-grads-solution",
        "source": '''def argmax_attention_grads(q, k, v, grad_out):
    """Zeros everywhere (wrong for grad_v)."""
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


try:
    raise ValueError("to bind a name")
except ValueError as np:
    pass''',
        "must_fail": {"part4-grads-test"},
    },
    {
        # A background thread started by the answer cell keeps the grader's tools rebound to a
        # lenient fake in the notebook's namespace while the tests run.
        "name": "background-thread-rebinds-grader-part4",
        "attacks": "background",
        "cell": "part4-grads-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


class _Lenient:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _keep_lenient():
    main = _dotted("__main__")
    name = "_gra" + "der"
    for _ in range(10**8):
        _dotted("builtins.setattr")(main, name, _Lenient())


def argmax_attention_grads(q, k, v, grad_out):
    """Zeros everywhere (wrong for grad_v)."""
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


_dotted("threading.Thread")(target=_keep_lenient, daemon=True).start()''',
        "must_fail": {"part4-grads-test"},
    },
    {
        # match/case: a capture pattern rebinds the grader's tools to a lenient fake.
        "name": "match-capture-rebinds-grader-part5",
        "attacks": "binding",
        "cell": "part5-softmax-solution",
        "source": '''class _Lenient:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def softmax_attention_beta(q, k, v, beta):
    """Wrong: ignores beta."""
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


match _Lenient():
    case _grader:
        pass''',
        "must_fail": {"part5-softmax-test"},
    },
    {
        # A Tensor subclass whose __torch_function__ makes torch.isclose (what assert_close
        # compares with) and comparisons agree, and isfinite hold: wrong values pass.
        "name": "tensor-subclass-lies-part5",
        "attacks": "lying-objects",
        "cell": "part5-softmax-solution",
        "source": '''_LIES = (torch.isclose, torch.eq, torch.Tensor.eq, torch.Tensor.__eq__,
         torch.isfinite, torch.allclose, torch.equal)


class _Agreeable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, kinds, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _LIES:
            return torch.ones_like(out, dtype=torch.bool) if isinstance(out, torch.Tensor) else (
                True)
        if isinstance(out, torch.Tensor) and not isinstance(out, cls):
            return out.as_subclass(cls)
        return out


def softmax_attention_beta(q, k, v, beta):
    """Wrong: ignores beta; dressed as a tensor that agrees with every comparison."""
    out = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
    return out.as_subclass(_Agreeable)''',
        "must_fail": {"part5-softmax-test"},
    },
    {
        # A profile function set from inside the answer reads the locals of the test that
        # calls it (the hidden test's expected output); right on the visible betas only.
        "name": "profile-function-reads-test-part5",
        "attacks": "read-hidden",
        "cell": "part5-softmax-solution",
        "source": '''_dotted = torch._utils._import_dotted_name
_seen = {}


def _spy(frame, event, arg):
    caller = _dotted("operator.attrgetter")("f_back")(frame)
    names = _dotted("operator.attrgetter")("f_locals")(caller) if caller is not None else {}
    if "_expected" in names:
        _seen["expected"] = names["_expected"]


def softmax_attention_beta(q, k, v, beta):
    """The hidden test's expected output if a profile function can see it; otherwise right
    for beta = 0 (the mean) and large beta (hard attention) only."""
    _dotted("sys.setprofile")(_spy)
    _dotted("sys.setprofile")(None)
    if "expected" in _seen:
        return _seen.pop("expected")
    if beta == 0:
        return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1])
    best = (q @ k.transpose(-2, -1)).argmax(dim=-1)
    return torch.nn.functional.one_hot(best, k.shape[-2]).to(v.dtype) @ v''',
        "must_fail": {"part5-softmax-test"},
    },
]
