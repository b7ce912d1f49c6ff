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
    {
        # The weights of all queries against a block of 256 keys at a time, the blocks summed
        # in a Python loop: n_q x 256 tensors (the memory test passes), Theta(n_q n_k m) work.
        "name": "key-loop-part3",
        "cell": "part3-estimator-solution",
        "source": '''def rff_softmax_attention(q, k, v, w):
    """The estimated attention weights of all queries against 256 keys at a time, summed."""
    scale = q.shape[-1] ** -0.25
    q, k = scale * q, scale * k

    def features(x):
        return torch.exp(0.5 * (x * x).sum(-1, keepdim=True)) * random_fourier_features(x, w)

    psi_q, psi_k = features(q), features(k)
    numerator = q.new_zeros(*q.shape[:-1], v.shape[-1])
    denominator = q.new_zeros(*q.shape[:-1], 1)
    for start in range(0, k.shape[-2], 256):
        a = psi_q @ psi_k[..., start : start + 256, :].transpose(-2, -1)  # (..., n_q, 256)
        numerator = numerator + a @ v[..., start : start + 256, :]
        denominator = denominator + a.sum(-1, keepdim=True)
    return numerator / denominator''',
        "must_fail": {"part3-estimator-test"},
    },
]
