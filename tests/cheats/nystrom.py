"""Numerically correct answers that break a requirement of the statement (tests/test_grading.py).

Each case replaces the source of one answer cell; the test cells in ``must_fail`` must score 0,
every other test cell keeps its points.
"""

CASES = [
    {
        # Part 5 asks for right-to-left evaluation: this one forms the n x n product
        # F pinv(A_S) B first (left to right), the same numbers in O(n^2) memory.
        "name": "left-to-right-part5",
        "cell": "part5-nystromformer-solution",
        "source": '''def nystromformer_attention(q, k, v, num_landmarks, pinv=torch.linalg.pinv):
    m, d = num_landmarks, q.shape[-1]
    n_q, n_k = q.shape[-2], k.shape[-2]
    q_land = q.unflatten(-2, (m, n_q // m)).mean(dim=-2)
    k_land = k.unflatten(-2, (m, n_k // m)).mean(dim=-2)
    scale = 1.0 / math.sqrt(d)
    f = torch.softmax(q @ k_land.transpose(-2, -1) * scale, dim=-1)
    a_s = torch.softmax(q_land @ k_land.transpose(-2, -1) * scale, dim=-1)
    b = torch.softmax(q_land @ k.transpose(-2, -1) * scale, dim=-1)
    return ((f @ pinv(a_s)) @ b) @ v  # (..., n_q, n_k) first''',
        "must_fail": {"part5-nystromformer-test"},
    },
    {
        # Left to right, but a block of 64 keys at a time in a Python loop: (F pinv(A_S))
        # B[:, block] is n x 64 (the memory test passes), Theta(n^2 (m + d_v)) work in all.
        "name": "key-loop-part5",
        "cell": "part5-nystromformer-solution",
        "source": '''def nystromformer_attention(q, k, v, num_landmarks, pinv=torch.linalg.pinv):
    """Left to right, a block of 64 keys at a time: (F pinv(A_S)) B[:, block] V[block]."""
    m, d = num_landmarks, q.shape[-1]
    n_q, n_k = q.shape[-2], k.shape[-2]
    q_land = q.unflatten(-2, (m, n_q // m)).mean(dim=-2)
    k_land = k.unflatten(-2, (m, n_k // m)).mean(dim=-2)
    scale = 1.0 / math.sqrt(d)
    f = torch.softmax(q @ k_land.transpose(-2, -1) * scale, dim=-1)
    a_s = torch.softmax(q_land @ k_land.transpose(-2, -1) * scale, dim=-1)
    b = torch.softmax(q_land @ k.transpose(-2, -1) * scale, dim=-1)
    left = f @ pinv(a_s)                                                # (..., n_q, m)
    out = 0
    for start in range(0, n_k, 64):
        weights = left @ b[..., start : start + 64]                     # (..., n_q, 64)
        out = out + weights @ v[..., start : start + 64, :]
    return out''',
        "must_fail": {"part5-nystromformer-test"},
    },
]

# A plain solve in Part 1 (``c @ torch.linalg.solve(w, c.mT)``) raises on the repeated
# landmarks of the visible and hidden tests (W exactly singular). It is not listed as a case:
# Part 3 calls Part 1 on nearly singular W (64 Gaussian landmarks), where whether a solve
# stays within the tolerance depends on the data drawn at grading time.
