"""Numerically correct answers that break a requirement of the statement (tests/test_grading.py).

Each case replaces the source of one answer cell; the test cells in ``must_fail`` must score 0,
every other test cell keeps its points.
"""

CASES = [
    {
        # Part 1 forbids any n x n tensor: this one masks dense scores outside the band.
        "name": "dense-band-part1",
        "cell": "part1-banded-solution",
        "source": '''def banded_attention(q, k, v, bandwidth):
    n = q.shape[-2]
    position = torch.arange(n)
    outside = (position[:, None] - position[None, :]).abs() > bandwidth      # (n, n)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])               # (..., n, n)
    return torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1) @ v''',
        "must_fail": {"part1-banded-test"},
    },
    {
        # Part 3 asks for the second form: this one normalises the n x n matrix
        # phi(Q) phi(K)^T, the same numbers in O(n^2) memory.
        "name": "quadratic-part3",
        "cell": "part3-far-solution",
        "source": '''def elu_feature_map(x):
    return torch.nn.functional.elu(x) + 1.0


def far_field_attention(q, k, v):
    weights = elu_feature_map(q) @ elu_feature_map(k).transpose(-2, -1)    # (..., n_q, n_k)
    return (weights @ v) / weights.sum(dim=-1, keepdim=True)''',
        "must_fail": {"part3-far-test"},
    },
]
