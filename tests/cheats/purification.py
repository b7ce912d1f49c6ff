"""Submissions of purification to grade: no Part of this assignment prescribes a cost or an
algorithm, so there is no statement-violating case; the case below is a correct answer that
only emits a warning, which must keep its points (issue 11, point 6).

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
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
]
