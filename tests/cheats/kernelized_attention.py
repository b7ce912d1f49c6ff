"""Submissions of kernelized_attention that are numerically right but break the statement.

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
"""

CASES = [
    {
        # Part 4 forbids the n_q x n_k matrix: right values, quadratic memory and time.
        "name": "quadratic-part4",
        "cell": "part4-linear-solution",
        "source": '''def linear_attention(q, k, v, feature_map):
    """out = phi(Q) phi(K)^T V / row sums: the n_q x n_k matrix, built at once."""
    similarities = feature_map(q) @ feature_map(k).transpose(-2, -1)   # (..., n_q, n_k)
    return (similarities @ v) / similarities.sum(dim=-1, keepdim=True)''',
        "must_fail": {"part4-linear-test"},
    },
    {
        # The same matrix built 64 query rows at a time: small tensors, quadratic work.
        "name": "blocked-quadratic-part4",
        "cell": "part4-linear-solution",
        "source": '''def linear_attention(q, k, v, feature_map):
    """out = phi(Q) phi(K)^T V / row sums, 64 query rows at a time."""
    phi_k = feature_map(k)                                             # (..., n_k, C)
    blocks = []
    for start in range(0, q.shape[-2], 64):
        phi_q = feature_map(q[..., start : start + 64, :])            # (..., 64, C)
        similarities = phi_q @ phi_k.transpose(-2, -1)                 # (..., 64, n_k)
        blocks.append((similarities @ v) / similarities.sum(dim=-1, keepdim=True))
    return torch.cat(blocks, dim=-2)''',
        "must_fail": {"part4-linear-test"},
    },
    {
        # The same matrix 16 query rows at a time, by broadcasting and .sum (no matrix product):
        # small tensors, quadratic work, which a count of matrix-product FLOPs did not see.
        "name": "broadcast-sum-part4",
        "cell": "part4-linear-solution",
        "source": '''def linear_attention(q, k, v, feature_map):
    """phi(Q) phi(K)^T V / row sums, 16 query rows at a time, by broadcasting and sums (no @)."""
    phi_k = feature_map(k)                                             # (..., n_k, C)
    blocks = []
    for start in range(0, q.shape[-2], 16):
        phi_q = feature_map(q[..., start : start + 16, :])            # (..., 16, C)
        weights = (phi_q.unsqueeze(-2) * phi_k.unsqueeze(-3)).sum(-1)  # (..., 16, n_k)
        numerator = (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)  # (..., 16, d_v)
        blocks.append(numerator / weights.sum(-1, keepdim=True))
    return torch.cat(blocks, dim=-2)''',
        "must_fail": {"part4-linear-test"},
    },
]
