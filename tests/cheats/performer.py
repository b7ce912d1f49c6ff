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
    {
        # Part 3 without the n_q x n_k matrix in memory: the estimated attention matrix 64
        # query rows at a time, with einsum. Small tensors (the memory test passes) but
        # Theta(n_q n_k m) work, which the work count catches.
        "name": "einsum-part3",
        "cell": "part3-favor-solution",
        "source": '''def favor_attention(q, k, v, w):
    """The estimated attention matrix, 64 query rows at a time, with einsum."""
    scale = q.shape[-1] ** -0.25
    phi_k = positive_random_features(scale * k, w)                        # (..., n_k, m)
    blocks = []
    for start in range(0, q.shape[-2], 64):
        phi_q = positive_random_features(scale * q[..., start : start + 64, :], w)
        a = torch.einsum("...im,...jm->...ij", phi_q, phi_k)               # (..., 64, n_k)
        blocks.append(torch.einsum("...ij,...je->...ie", a, v) / a.sum(-1, keepdim=True))
    return torch.cat(blocks, dim=-2)''',
        "must_fail": {"part3-favor-test"},
    },
    {
        # Part 4 as a masked matrix, 32 query rows at a time against the keys up to them,
        # masked with torch.tril: small tensors, Theta(n^2) work.
        "name": "tril-part4",
        "cell": "part4-causal-solution",
        "source": '''def causal_favor_attention(q, k, v, w):
    """The masked estimated attention matrix, 32 query rows at a time, with torch.tril."""
    scale = q.shape[-1] ** -0.25
    phi_q = positive_random_features(scale * q, w)                        # (..., n, m)
    phi_k = positive_random_features(scale * k, w)
    blocks = []
    for start in range(0, q.shape[-2], 32):
        stop = min(start + 32, q.shape[-2])
        a = phi_q[..., start:stop, :] @ phi_k[..., :stop, :].transpose(-2, -1)
        a = torch.tril(a, diagonal=start)                                  # keys j <= i
        blocks.append((a @ v[..., :stop, :]) / a.sum(-1, keepdim=True))
    return torch.cat(blocks, dim=-2)''',
        "must_fail": {"part4-causal-test"},
    },
]
