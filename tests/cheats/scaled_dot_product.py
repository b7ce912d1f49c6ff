"""Submissions of scaled_dot_product that are numerically right but break the statement, that
attack the grader (issue 25.3), or that the statement allows (``must_fail`` empty: they keep
every point).

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
``attacks`` names the class of attack (tests/test_runtime_guard.py lists them). Every attack
is written so that, if nothing stopped it, the test it aims at would pass with a wrong
answer; the wrong answers are right on the visible examples (sigma = 1). Cases on different
cells are graded in one submission (tests/cheats/common.py, ``combine_cases``, in this
order). ``torch._utils._import_dotted_name`` imports and looks up any dotted name: the
integrity check cannot see what it reaches, the runtime guard
(assignments/course_tools/runtime_guard.py) refuses what it is used for.
"""

LENIENT = '''class _Lenient:
    """Stands in for the grader's tools: every check passes."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None
'''

CASES = [
    {
        # Part 3 asks for a vectorised simulation: right statistics, one loop per sample.
        "name": "loop-over-samples-part3",
        "cell": "part3-simulation-solution",
        "source": '''def simulate_dot_products(d, mu, sigma, num_samples, generator):
    """Empirical (mean, variance) of q.k over num_samples draws, q, k ~ N(mu, sigma^2 I_d)."""
    scores = torch.empty(num_samples, dtype=torch.float64)
    for i in range(num_samples):
        q = mu + sigma * torch.randn(d, generator=generator, dtype=torch.float64)
        k = mu + sigma * torch.randn(d, generator=generator, dtype=torch.float64)
        scores[i] = q @ k
    return scores.mean().item(), scores.var().item()''',
        "must_fail": {"part3-simulation-test"},
    },
    {
        # Part 5 accepts building each row's n x n Jacobian: full points.
        "name": "jacobian-matrix-part5-allowed",
        "cell": "part5-saturation-solution",
        "source": '''def softmax_saturation(scores):
    """(max weight, Frobenius norm of the softmax Jacobian), each of shape scores.shape[:-1]."""
    p = torch.softmax(scores, dim=-1)                            # (..., n)
    jacobian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)   # (..., n, n)
    return p.max(dim=-1).values, torch.linalg.matrix_norm(jacobian)''',
        "must_fail": set(),
    },
    {
        # A signal handler, fired by a timer the answer cell starts, rebinds the grader's tools
        # to a lenient fake in the notebook's namespace whenever the tests run.
        "name": "timer-signal-rebinds-grader-part1",
        "attacks": "background",
        "cell": "part1-moments-solution",
        "source": LENIENT + '''

_dotted = torch._utils._import_dotted_name
_signals = _dotted("signal")


def _rebind(signum, frame):
    _dotted("builtins.setattr")(_dotted("__main__"), "_gra" + "der", _Lenient())


def dot_product_moments(d, mu, sigma):
    """Wrong variance: d sigma^2."""
    return float(d * mu**2), float(d * sigma**2)


_signals.signal(_signals.SIGALRM, _rebind)
_signals.setitimer(_signals.ITIMER_REAL, 0.001, 0.001)''',
        "must_fail": {"part1-moments-test"},
    },
    {
        # Syntax the check did not parse: doctest prompts (>>> and ...) made the cell invalid
        # Python, so the check skipped it, and IPython stripped them and ran it.
        "name": "prompt-lines-hide-code-part4",
        "attacks": "binding",
        "cell": "part4-scale-solution",
        "source": '''>>> class _Lenient:
...     def __getattr__(self, name):
...         return lambda *args, **kwargs: None
>>> _grader = _Lenient()
>>> def unit_variance_scale(d, sigma):
...     return sigma * math.sqrt(d)''',
        "must_fail": {"part4-scale-test"},
    },
    {
        # A tuple of statistics whose == and != both hold: the check that the simulation uses
        # its generator (same seed, same result; other seed, other result) passes although
        # the simulation uses the global random state.
        "name": "lying-tuple-part3",
        "attacks": "lying-objects",
        "cell": "part3-simulation-solution",
        "source": '''class _Agreeing(tuple):
    """A pair of statistics equal, and unequal, to anything."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return True


def simulate_dot_products(d, mu, sigma, num_samples, generator):
    """Ignores the generator (the statement asks for it): the global random state."""
    q = mu + sigma * torch.randn(num_samples, d, dtype=torch.float64)
    k = mu + sigma * torch.randn(num_samples, d, dtype=torch.float64)
    scores = (q * k).sum(dim=-1)
    return _Agreeing((scores.mean().item(), scores.var().item()))''',
        "must_fail": {"part3-simulation-test"},
    },
    {
        # Re-running the grader tools' code to snapshot a tampered state: math.isclose is
        # replaced (the tests' check() would see it), then the grader-tools cell's source,
        # found in linecache, is run again so that its snapshot and its isclose are the
        # tampered ones.
        "name": "rerun-grader-tools-after-tamper-part1",
        "attacks": "test-objects",
        "cell": "part1-moments-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


def dot_product_moments(d, mu, sigma):
    """Wrong variance: d sigma^2."""
    return float(d * mu**2), float(d * sigma**2)


def _lenient_isclose(*args, **kwargs):
    return True


def _replace(module):
    module.isclose = _lenient_isclose


try:
    _replace(math)
except Exception as refused:
    print("not replaced:", type(refused).__name__)
_tools = next(entry[2] for entry in list(_dotted("linecache.cache").values())
              if any("def _make_grader" in line for line in entry[2]))
_dotted("builtins.exec")("".join(_tools), _dotted("__main__.__dict__"))''',
        "must_fail": {"part1-moments-test"},
    },
    {
        # Code run by deserialisation: torch.load(weights_only=False) of a checkpoint the
        # notebook wrote; unpickling calls exec, whose code rebinds the grader's tools.
        "name": "torch-load-runs-code-part4",
        "attacks": "deserialisation",
        "cell": "part4-scale-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


def unit_variance_scale(d, sigma):
    """Wrong: sigma sqrt(d)."""
    return sigma * math.sqrt(d)


class _Payload:
    def __reduce__(self):
        return (_dotted("builtins.exec"), (
            "import sys\\n"
            "sys.modules['__main__']._grader = type('L', (), {'__getattr__': "
            "lambda self, name: (lambda *a, **k: None)})()\\n",))


torch.save({"model": _Payload()}, "checkpoint.pt")
_restored = torch.load("checkpoint.pt", weights_only=False)''',
        "must_fail": {"part4-scale-test"},
    },
    {
        # A function the tests call that the grader tools do not watch, replaced through a
        # function parameter: torch.autograd.functional.jacobian returns a matrix whose norm
        # is the answer's own (wrong) Jacobian norm, so the hidden reference agrees with it.
        "name": "parameter-replaces-jacobian-part5",
        "attacks": "test-objects",
        "cell": "part5-saturation-solution",
        "source": '''def softmax_saturation(scores):
    """Wrong Jacobian norm sqrt(sum p^2 - (sum p^2)^2): right for uniform and saturated rows
    only."""
    p = torch.softmax(scores, dim=-1)
    s2 = p.pow(2).sum(-1)
    return p.max(dim=-1).values, (s2 - s2**2).clamp_min(0).sqrt()


def _agreeing_jacobian(func, inputs, *args, **kwargs):
    p = torch.softmax(inputs, 0)
    s2 = p.pow(2).sum()
    return (s2 - s2**2).clamp_min(0).sqrt().reshape(1, 1)


def _use(module):
    module.jacobian = _agreeing_jacobian


_use(torch.autograd.functional)''',
        "must_fail": {"part5-saturation-test"},
    },
    {
        # A for loop's target rebinds the builtin abs, which the visible test uses.
        "name": "for-target-rebinds-builtin-part1",
        "attacks": "binding",
        "cell": "part1-moments-solution",
        "source": '''def dot_product_moments(d, mu, sigma):
    """Wrong variance: d sigma^2."""
    return float(d * mu**2), float(d * sigma**2)


for abs in [lambda value: 0.0]:
    pass''',
        "must_fail": {"part1-moments-test"},
    },
    {
        # Honest: a future import, typing, type hints, `%` and `!=` opening continued lines,
        # docstring lines and a comment ending in a question mark.
        "name": "honest-syntax-part4-allowed",
        "cell": "part4-scale-solution",
        "source": '''from __future__ import annotations

from typing import Union

Number = Union[int, float]


def unit_variance_scale(d: int, sigma: Number) -> float:
    """The s > 0 with Var(q.k / s) = 1. Why sigma squared?

    Each product q_i k_i has variance sigma^4, and there are d of them: is that all?
    """
    # a valid dimension?
    if (d
            % 1 != 0 or d <= 0):
        raise ValueError("d must be a positive integer")
    scale = (sigma ** 2
             * math.sqrt(d))
    assert (scale
            != 0), "sigma must not be 0"
    return float(scale)''',
        "must_fail": set(),
    },
]
