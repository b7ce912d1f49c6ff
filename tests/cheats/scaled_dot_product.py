"""Submissions of scaled_dot_product that are numerically right but break the statement, or
that the statement allows (``must_fail`` empty: they keep every point).

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
"""

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
]
