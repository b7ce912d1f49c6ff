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
    {
        # Part 1 with windows of all 2n - 1 key positions (Tensor.unfold, a view), the band
        # masked afterwards, 16 queries at a time: no n x n tensor (the memory test passes) but
        # every query scored against every key, Theta(n^2 (d + d_v)) work.
        "name": "unfold-part1",
        "cell": "part1-banded-solution",
        "source": '''def banded_attention(q, k, v, bandwidth):
    """Each query against its window of all 2n - 1 key positions (Tensor.unfold, a view), the
    band masked afterwards, 16 queries at a time: never an n x n tensor."""
    n, d = q.shape[-2], q.shape[-1]
    width = 2 * n - 1
    pad = torch.nn.functional.pad
    k_windows = pad(k, (0, 0, n - 1, n - 1)).unfold(-2, width, 1)      # (..., n, d, 2n - 1)
    v_windows = pad(v, (0, 0, n - 1, n - 1)).unfold(-2, width, 1)      # (..., n, d_v, 2n - 1)
    offset = torch.arange(width) - (n - 1)                              # key j minus query i
    outputs = []
    for start in range(0, n, 16):
        rows = slice(start, start + 16)
        scores = (q[..., rows, None, :] @ k_windows[..., rows, :, :]).squeeze(-2) / math.sqrt(d)
        key = torch.arange(start, min(start + 16, n))[:, None] + offset
        outside = (offset.abs() > bandwidth) | (key < 0) | (key >= n)
        weights = torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1)
        values = v_windows[..., rows, :, :].transpose(-2, -1)
        outputs.append((weights.unsqueeze(-2) @ values).squeeze(-2))
    return torch.cat(outputs, dim=-2)''',
        "must_fail": {"part1-banded-test"},
    },
    {
        # Part 3 as the normalised n x n weights, 8 queries at a time, by broadcasting and .sum
        # (no matrix product): small tensors, Theta(n^2 d) work.
        "name": "broadcast-sum-part3",
        "cell": "part3-far-solution",
        "source": '''def elu_feature_map(x):
    return torch.nn.functional.elu(x) + 1.0


def far_field_attention(q, k, v):
    """phi(Q) phi(K)^T V normalised, 8 queries at a time, by broadcasting and sums (no @)."""
    phi_k = elu_feature_map(k)                                          # (..., n_k, d)
    blocks = []
    for start in range(0, q.shape[-2], 8):
        phi_q = elu_feature_map(q[..., start : start + 8, :])          # (..., 8, d)
        weights = (phi_q.unsqueeze(-2) * phi_k.unsqueeze(-3)).sum(-1)   # (..., 8, n_k)
        numerator = (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)   # (..., 8, d_v)
        blocks.append(numerator / weights.sum(-1, keepdim=True))
    return torch.cat(blocks, dim=-2)''',
        "must_fail": {"part3-far-test"},
    },
]
