"""Submissions of purification to grade: no Part of this assignment prescribes a cost or an
algorithm, so there is no statement-violating case. A correct answer that only emits a warning
must keep its points (issue 11, point 6); the other cases attack the grader (issue 25.3) or
are honest code the check must accept (``must_fail`` empty).

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
``attacks`` names the class of attack (tests/test_runtime_guard.py lists them). Every attack
is written so that, if nothing stopped it, the test it aims at would pass with a wrong
answer. ``denoising_errors`` (part 6) uses ``optimal_purifier`` (part 4), so a part-4 attack
costs part 6 too. Cases on different cells are graded in one submission
(tests/cheats/common.py, ``combine_cases``, in this order).
``torch._utils._import_dotted_name`` imports and looks up any dotted name: the integrity check
cannot see what it reaches, the runtime guard (assignments/course_tools/runtime_guard.py)
refuses what it is used for.
"""

CASES = [
    {
        # torch.tensor(a_tensor) prints a UserWarning to stderr; the answer is right.
        "name": "warning-part5-allowed",
        "cell": "part5-interval-solution",
        "source": (
            "def lambda_interval(singular_values, keep, keep_factor=0.8, suppress_factor=0.5):\n"
            '''    """The admissible (low, high) for lambda, or None."""
    copied = torch.tensor(singular_values, dtype=torch.float64)  # warns: copies a tensor
    s2 = torch.sort(copied, descending=True).values ** 2
    high = (s2[:keep] * (1 - keep_factor) / keep_factor).min().item()
    low = (s2[keep:] * (1 - suppress_factor) / suppress_factor).max().item()
    return (low, high) if low <= high else None'''
        ),
        "must_fail": set(),
    },
    {
        # The caller's frame (sys._getframe) holds the hidden test's expected value; without
        # it, an L1 penalty, equal to the squared Frobenius norm on the visible 0/1 matrices.
        "name": "caller-frame-reads-expected-part1",
        "attacks": "read-hidden",
        "cell": "part1-loss-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


def purification_loss(W, X, lam):
    """The hidden test's expected value if the caller's frame shows it."""
    caller = _dotted("sys._getframe")(1)
    names = _dotted("operator.attrgetter")("f_locals")(caller)
    if "_expected" in names:
        return names["_expected"]
    return ((X - W @ X) ** 2).sum() + lam * W.abs().sum()''',
        "must_fail": {"part1-loss-test"},
    },
    {
        # The garbage collector finds the dictionary that holds the test's input, the
        # notebook's namespace, and in it the hidden test's expected minimiser.
        "name": "gc-referrers-read-expected-part4",
        "attacks": "read-hidden",
        "cell": "part4-purifier-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


def optimal_purifier(X, lam):
    """The hidden test's expected minimiser if the garbage collector shows where X is kept;
    otherwise the identity (right for the visible example only)."""
    for holder in _dotted("gc.get_referrers")(X):
        if isinstance(holder, dict) and holder.get("_X") is X and "_expected" in holder:
            return holder["_expected"]
    A = X @ X.T
    if X.shape == (2, 4):
        return torch.linalg.solve(A + lam * torch.eye(2, dtype=X.dtype), A)
    return torch.eye(X.shape[0], dtype=X.dtype)''',
        "must_fail": {"part4-purifier-test", "part6-denoise-test"},
    },
    {
        # An exit function registered by the answer cell, to act after every test ran.
        "name": "atexit-hook-part6",
        "attacks": "background",
        "cell": "part6-denoise-solution",
        "source": '''def denoising_errors(X_clean, X_noisy, lams):
    """Wrong: the error of the noisy data, whatever lambda."""
    error = (X_noisy - X_clean).norm() / X_clean.norm()
    return error.repeat(len(lams))


def _after_grading():
    print("the tests are over")


torch._utils._import_dotted_name("atexit.register")(_after_grading)''',
        "must_fail": {"part6-denoise-test"},
    },
    {
        # Syntax the check did not parse: an indented cell was not valid Python, so the check
        # skipped it, and IPython dedented and ran it: the grader's tools rebound to a lenient
        # fake, with a wrong answer.
        "name": "indented-cell-hides-code-part5",
        "attacks": "binding",
        "cell": "part5-interval-solution",
        "source": '''    class _Lenient:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None


    _grader = _Lenient()


    def lambda_interval(singular_values, keep, keep_factor=0.8, suppress_factor=0.5):
        """Wrong: always the same interval."""
        return (1.0, 4.0)''',
        "must_fail": {"part5-interval-test"},
    },
    {
        # Code run by deserialisation: an object array saved with np.save and loaded with
        # allow_pickle; unpickling calls exec, whose code rebinds the grader's tools.
        "name": "numpy-pickle-runs-code-part1",
        "attacks": "deserialisation",
        "cell": "part1-loss-solution",
        "source": '''_dotted = torch._utils._import_dotted_name


class _Payload:
    def __reduce__(self):
        return (_dotted("builtins.exec"), (
            "import sys\\n"
            "sys.modules['__main__']._grader = type('L', (), {'__getattr__': "
            "lambda self, name: (lambda *a, **k: None)})()\\n",))


def purification_loss(W, X, lam):
    """Wrong: forgets the regulariser."""
    return ((X - W @ X) ** 2).sum()


np.save("payload.npy", np.array([_Payload()], dtype=object), allow_pickle=True)
_restored = np.load("payload.npy", allow_pickle=True)''',
        "must_fail": {"part1-loss-test"},
    },
    {
        # A traceback's frame (tb_frame, then f_back) reaches the test that called the answer,
        # and its expected errors; otherwise made-up errors that pass the visible checks.
        "name": "traceback-frame-reads-expected-part6",
        "attacks": "read-hidden",
        "cell": "part6-denoise-solution",
        "source": '''_get = torch._utils._import_dotted_name("operator.attrgetter")


def denoising_errors(X_clean, X_noisy, lams):
    """The hidden test's expected errors, from the caller's frame."""
    try:
        raise RuntimeError("for a traceback")
    except RuntimeError as error:
        caller = _get("__traceback__.tb_frame.f_back")(error)
    names = _get("f_locals")(caller)
    expected = names.get("_expected")
    if expected is not None and expected.shape == (len(lams),):
        return expected
    return torch.arange(len(lams), dtype=torch.float64)''',
        "must_fail": {"part6-denoise-test"},
    },
    {
        # Honest: typing, `!=` and `%` opening continued lines, a docstring line and a
        # comment ending in a question mark, local names bound by match/case, except ... as,
        # := and for.
        "name": "honest-syntax-part5-allowed",
        "cell": "part5-interval-solution",
        "source": '''from typing import Optional, Tuple


def lambda_interval(singular_values: torch.Tensor, keep: int, keep_factor: float = 0.8,
                    suppress_factor: float = 0.5) -> Optional[Tuple[float, float]]:
    """The admissible (low, high) for lambda, or None. Is the spectrum sorted?
    Not necessarily, so sort it first.
    """
    # which values are kept?
    s2 = torch.sort(singular_values.to(torch.float64), descending=True).values ** 2
    match keep:
        case int(count) if 0 < count < s2.numel():
            pass
        case other:
            raise ValueError(f"keep must be between 1 and {s2.numel() - 1}, got {other}")
    try:
        high = (s2[:count] * (1 - keep_factor) / keep_factor).min().item()
    except RuntimeError as error:
        raise ValueError("no kept value") from error
    lows = [value * (1 - suppress_factor) / suppress_factor for value in s2[count:].tolist()]
    if (low := max(lows)) <= high and (len(lows)
                                       != 0) and (count
                                                  % 1 == 0):
        return (low, high)
    return None''',
        "must_fail": set(),
    },
    {
        # Honest: a future import, Union and type hints, match/case, except ... as and := in
        # a function.
        "name": "honest-syntax-part1-allowed",
        "cell": "part1-loss-solution",
        "source": '''from __future__ import annotations

from typing import Union


def purification_loss(W: torch.Tensor, X: torch.Tensor,
                      lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """||X - W X||_F^2 + lam ||W||_F^2. Does a 0-dim lam work? Yes."""
    match tuple(W.shape):
        case (rows, cols) if rows == cols:
            pass
        case shape:
            raise ValueError(f"W must be square, got {shape}")
    try:
        residual = X - W @ X
    except RuntimeError as error:
        raise ValueError("W and X do not fit") from error
    if (total := residual.pow(2).sum()) is not None:
        total = total + lam * W.pow(2).sum()
    return total''',
        "must_fail": set(),
    },
    {
        # An object that lies about what it is: it passes the visible checks (a shape, items
        # in the right order) and, when the test converts it with .to(), hands back the
        # hidden test's expected errors, read from the notebook's namespace.
        "name": "lying-result-object-part6",
        "attacks": "lying-objects",
        "cell": "part6-denoise-solution",
        "source": '''_main = torch._utils._import_dotted_name("__main__")


class _Errors:
    def __init__(self, count):
        self.shape = (count,)

    def __getitem__(self, index):
        return float(index)

    def to(self, *args, **kwargs):
        expected = _main._expected
        return expected if expected.shape == self.shape else torch.zeros(self.shape)


def denoising_errors(X_clean, X_noisy, lams):
    """Computes nothing: an object that agrees with the tests."""
    return _Errors(len(lams))''',
        "must_fail": {"part6-denoise-test"},
    },
    {
        # Output carrying hidden values: it prints what the hidden test passes in, and fails
        # with an exception whose class name and message hold those values. The feedback
        # shows neither: from the first hidden test on, cells keep only their error type, and
        # only a known one (HideHiddenTestOutputs).
        "name": "prints-hidden-inputs-part6",
        "attacks": "leak-output",
        "cell": "part6-denoise-solution",
        "source": '''def denoising_errors(X_clean, X_noisy, lams):
    """Prints its inputs (in a hidden test: the hidden inputs) and fails."""
    print("LEAK-INPUTS", [round(lam, 6) for lam in lams], X_clean[0, :3].tolist())
    name = "LEAK_" + "_".join(str(int(lam * 1000)) for lam in lams)
    raise type(name, (Exception,), {})("LEAK-MESSAGE " + str(lams))''',
        "must_fail": {"part6-denoise-test"},
    },
]
