"""Submissions of argmax_attention that are numerically right but break the statement.

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
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
]
