"""Numerically correct answers that break a requirement of the statement (tests/test_grading.py).

Each case replaces the source of one answer cell; the test cells in ``must_fail`` must score 0,
every other test cell keeps its points.
"""

CASES = [
    {
        # Part 3 forbids the n_q x n_k matrix: this one builds phi(q) phi(k)^T, same numbers.
        "name": "quadratic-part3",
        "cell": "part3-favor-solution",
        "source": '''def favor_attention(q, k, v, w):
    scale = q.shape[-1] ** -0.25
    a = positive_random_features(scale * q, w) @ \\
        positive_random_features(scale * k, w).transpose(-2, -1)           # (..., n_q, n_k)
    return (a @ v) / a.sum(dim=-1, keepdim=True)''',
        "must_fail": {"part3-favor-test"},
    },
    {
        # Part 4 asks for prefix sums: this one masks the n x n estimated attention matrix
        # with a lower-triangular mask, the same numbers in O(n^2) memory.
        "name": "quadratic-part4",
        "cell": "part4-causal-solution",
        "source": '''def causal_favor_attention(q, k, v, w):
    scale = q.shape[-1] ** -0.25
    phi_q = positive_random_features(scale * q, w)
    phi_k = positive_random_features(scale * k, w)
    a = torch.tril(phi_q @ phi_k.transpose(-2, -1))                         # (..., n, n)
    return (a @ v) / a.sum(dim=-1, keepdim=True)''',
        "must_fail": {"part4-causal-test"},
    },
]
