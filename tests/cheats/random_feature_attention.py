"""Numerically correct answers that break a requirement of the statement (tests/test_grading.py).

Each case replaces the source of one answer cell; the test cells in ``must_fail`` must score 0,
every other test cell keeps its points.
"""

CASES = [
    {
        # Part 3 asks for the estimator without the n_q x n_k matrix: this one builds the
        # estimated attention matrix psi(q) psi(k)^T and normalises its rows, same numbers.
        "name": "quadratic-part3",
        "cell": "part3-estimator-solution",
        "source": '''def rff_softmax_attention(q, k, v, w):
    scale = q.shape[-1] ** -0.25
    q, k = scale * q, scale * k

    def features(x):
        return torch.exp(0.5 * (x * x).sum(-1, keepdim=True)) * random_fourier_features(x, w)

    a = features(q) @ features(k).transpose(-2, -1)                        # (..., n_q, n_k)
    return (a @ v) / a.sum(dim=-1, keepdim=True)''',
        "must_fail": {"part3-estimator-test"},
    },
    {
        # The same n_q x n_k matrix built in numpy (the setup cell imports it as np), which the
        # torch allocation tracker cannot see: the test's tracemalloc check must.
        "name": "numpy-quadratic-part3",
        "cell": "part3-estimator-solution",
        "source": '''def rff_softmax_attention(q, k, v, w):
    scale = q.shape[-1] ** -0.25
    q, k = scale * q, scale * k

    def features(x):
        return torch.exp(0.5 * (x * x).sum(-1, keepdim=True)) * random_fourier_features(x, w)

    a = np.einsum("...im,...jm->...ij", features(q).numpy(), features(k).numpy())
    return torch.from_numpy((a @ v.numpy()) / a.sum(-1, keepdims=True))''',
        "must_fail": {"part3-estimator-test"},
    },
]
