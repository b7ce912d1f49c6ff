"""Tests for efficient_attention.purification: ridge self-regression and its shrinkage."""

import pytest
import torch

import efficient_attention as ea

# The homework's data: two features, four samples (one per column).
HOMEWORK_X = torch.tensor(
    [[-2.17, 1.98, 2.41, -2.03], [0.02, -0.01, 0.01, -0.02]], dtype=torch.float64
)
HOMEWORK_SIGMAS = torch.tensor([10, 8, 4, 1, 0.5, 0.36, 0.16, 0.01], dtype=torch.float64)


def test_homework_part_a_losses_and_threshold():
    w_alpha = torch.eye(2, dtype=torch.float64)  # keep everything
    w_beta = torch.diag(torch.tensor([1.0, 0.0], dtype=torch.float64))  # drop feature 2
    reconstruction_beta = 0.02**2 + 0.01**2 + 0.01**2 + 0.02**2  # = 0.001
    assert reconstruction_beta == pytest.approx(0.001)
    for lam in (0.0, 0.0005, 0.001, 0.002, 1.0):
        alpha = ea.purification_loss(w_alpha, HOMEWORK_X, lam)
        beta = ea.purification_loss(w_beta, HOMEWORK_X, lam)
        assert alpha.item() == pytest.approx(2 * lam, abs=1e-15)
        assert beta.item() == pytest.approx(reconstruction_beta + lam, rel=1e-12)
    # Equal at lambda = 0.001; beyond it W_beta (drop the weak feature) is better.
    at_threshold = [ea.purification_loss(w, HOMEWORK_X, 0.001).item() for w in (w_alpha, w_beta)]
    assert at_threshold[0] == pytest.approx(at_threshold[1], rel=1e-12)
    assert ea.purification_loss(w_beta, HOMEWORK_X, 0.0011) < ea.purification_loss(
        w_alpha, HOMEWORK_X, 0.0011
    )
    assert ea.purification_loss(w_alpha, HOMEWORK_X, 0.0009) < ea.purification_loss(
        w_beta, HOMEWORK_X, 0.0009
    )


def test_homework_part_c_lambda_interval():
    low, high = ea.lambda_interval(HOMEWORK_SIGMAS, keep=3, keep_threshold=0.8,
                                   suppress_threshold=0.5)
    assert low == pytest.approx(1.0) and high == pytest.approx(4.0)
    # Check the claim directly on the shrinkage factors, inside and just outside.
    for lam, ok in ((1.0, True), (2.5, True), (4.0, True), (0.99, False), (4.01, False)):
        f = ea.shrinkage_factors(HOMEWORK_SIGMAS, lam)
        satisfied = bool((f[:3] >= 0.8 - 1e-12).all() and (f[3:] <= 0.5 + 1e-12).all())
        assert satisfied == ok, lam
    # The order of the singular values does not matter.
    shuffled = HOMEWORK_SIGMAS[torch.tensor([3, 0, 7, 1, 5, 2, 6, 4])]
    assert ea.lambda_interval(shuffled, 3) == (low, high)
    # Demands no lambda can meet come back as an empty interval (low > high).
    low, high = ea.lambda_interval(HOMEWORK_SIGMAS, 3, keep_threshold=0.99,
                                   suppress_threshold=0.01)
    assert low > high


@pytest.mark.parametrize("shape", [(5, 12), (6, 3), (2, 4, 9)])
@pytest.mark.parametrize("lam", [0.1, 2.0])
def test_optimal_purifier_is_the_ridge_closed_form(shape, lam):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = shape[-2]
    gram = x @ x.transpose(-2, -1)
    closed_form = gram @ torch.linalg.inv(gram + lam * torch.eye(m, dtype=torch.float64))
    w = ea.optimal_purifier(x, lam)
    torch.testing.assert_close(w, closed_form)
    torch.testing.assert_close(w, w.transpose(-2, -1))  # symmetric
    torch.testing.assert_close(ea.purify(x, lam), closed_form @ x)


def test_optimal_purifier_minimises_the_loss():
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lam = 0.7
    w_star = ea.optimal_purifier(x, lam).requires_grad_(True)
    loss = ea.purification_loss(w_star, x, lam)
    (gradient,) = torch.autograd.grad(loss, w_star)
    assert gradient.abs().max() < 1e-10  # a stationary point ...
    # ... of a strictly convex quadratic: L(W* + E) = L(W*) + ||E X||^2 + lam ||E||^2 exactly.
    generator = torch.Generator().manual_seed(2)
    for _ in range(20):
        e = 0.1 * torch.randn(4, 4, generator=generator, dtype=torch.float64)
        increase = ea.purification_loss(w_star.detach() + e, x, lam) - loss.detach()
        expected = (e @ x).square().sum() + lam * e.square().sum()
        torch.testing.assert_close(increase, expected)
        assert increase > 0


def test_shrinkage_factors():
    sigma = torch.tensor([3.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    f = ea.shrinkage_factors(sigma, 1.0)
    torch.testing.assert_close(f, torch.tensor([0.9, 0.5, 0.2, 0.0], dtype=torch.float64))
    assert (f[:-1] > f[1:]).all()
    # lambda = 0 keeps every nonzero direction fully; a zero singular value gets 0, not NaN.
    torch.testing.assert_close(ea.shrinkage_factors(sigma, 0.0),
                               torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    # The purifier's eigenvalues are the shrinkage factors.
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    eigenvalues = torch.linalg.eigvalsh(ea.optimal_purifier(x, 0.5)).flip(0)
    torch.testing.assert_close(eigenvalues, ea.shrinkage_factors(torch.linalg.svdvals(x), 0.5))


def test_bad_input():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="lam must be a finite number >= 0, got -1.0"):
        ea.optimal_purifier(x, -1.0)
    with pytest.raises(TypeError, match="lam must be a number >= 0, got str"):
        ea.purification_loss(torch.eye(3), x, "1")
    with pytest.raises(ValueError, match="w must have shape \\(..., m, m\\) with m=3"):
        ea.purification_loss(torch.eye(4), x, 1.0)
    with pytest.raises(ValueError, match="keep must be smaller than the number of singular"):
        ea.lambda_interval(HOMEWORK_SIGMAS, 8)
    with pytest.raises(ValueError, match="keep_threshold must lie strictly between 0 and 1"):
        ea.lambda_interval(HOMEWORK_SIGMAS, 3, keep_threshold=1.5)
    with pytest.raises(ValueError, match="singular_values must be 1-D"):
        ea.lambda_interval(torch.ones(2, 3), 1)
