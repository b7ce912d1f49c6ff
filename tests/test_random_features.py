"""Tests for efficient_attention.random_features: unbiasedness, closed-form MSE, 1/sqrt(m).

Monte Carlo conventions. ``R`` independent estimators are drawn at once: a matrix
``W`` of ``R * m`` rows holds ``R`` consecutive groups of ``m`` rows (for orthogonal
draws, ``m`` is a multiple of ``d``, so every group is made of whole independent blocks).
Every feature map lays its features out as ``[part_1, ..., part_F]`` (``F = 1`` or 2),
each part ordered by row of ``W`` and normalised by ``1/sqrt(R m)`` instead of
``1/sqrt(m)``; so the estimate of draw ``r`` is ``R`` times the sum of
``phi(x) * phi(y)`` over its ``m`` rows in every part (:func:`estimates`).

Tolerances: a sample mean over ``R`` draws has standard error ``s / sqrt(R)`` (``s`` the
sample standard deviation); we accept deviations up to 4 standard errors (two-sided
false-alarm rate 6e-5 under the central limit theorem; the seeds are fixed anyway).
"""

import math

import pytest
import torch

import efficient_attention as ea

Z = 4.0  # standard errors allowed (see the module docstring)


def estimates(feature_map, x, y, w, draws):
    """Per-draw estimates ``phi_r(x)^T phi_r(y)``, shape ``(draws,)`` (see module docstring)."""
    products = (feature_map(x, w) * feature_map(y, w)).reshape(-1)  # (F * R * m,)
    return products.reshape(-1, draws, w.shape[0] // draws).sum(dim=(0, 2)) * draws


def assert_mean_within_clt(values, target):
    mean = values.mean()
    standard_error = values.std() / math.sqrt(values.numel())
    assert abs(mean - target) < Z * standard_error, (float(mean), target, float(standard_error))


@pytest.fixture
def pair():
    """Two points with moderate norms (|x|, |y| ~ 0.5): estimators with light tails."""
    x = torch.tensor([[0.3, -0.2, 0.4, 0.1]], dtype=torch.float64)
    y = torch.tensor([[0.1, 0.5, -0.2, 0.3]], dtype=torch.float64)
    return x, y


def draw(rows, d, seed, orthogonal=False):
    g = torch.Generator().manual_seed(seed)
    return ea.gaussian_random_matrix(rows, d, orthogonal=orthogonal, generator=g,
                                     dtype=torch.float64)


# --------------------------------------------------------------------- random matrices


def test_gaussian_random_matrix_shapes_and_reproducibility():
    for orthogonal in (False, True):
        a = draw(10, 4, seed=3, orthogonal=orthogonal)
        b = draw(10, 4, seed=3, orthogonal=orthogonal)
        assert a.shape == (10, 4) and a.dtype == torch.float64
        assert torch.equal(a, b)
        assert not torch.equal(a, draw(10, 4, seed=4, orthogonal=orthogonal))
    half = ea.gaussian_random_matrix(5, 3, orthogonal=True, dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.isfinite(half).all()


def test_orthogonal_blocks_are_orthogonal_with_independent_norms():
    d = 6
    w = draw(2 * d + 3, d, seed=0, orthogonal=True)  # m > d: two full blocks and a part
    assert w.shape == (2 * d + 3, d)
    for block in (w[:d], w[d : 2 * d], w[2 * d :]):
        directions = block / block.norm(dim=-1, keepdim=True)
        gram = directions @ directions.T
        torch.testing.assert_close(gram, torch.eye(block.shape[0], dtype=torch.float64))
    # Different blocks are independent, so not orthogonal to each other.
    across = (w[:d] / w[:d].norm(dim=-1, keepdim=True)) @ (w[d : 2 * d] / w[d : 2 * d].norm(
        dim=-1, keepdim=True)).T
    assert across.abs().max() > 0.1
    # Lengths are not all equal (they are chi-distributed, not normalised to sqrt(d)).
    assert w.norm(dim=-1).std() > 0.1


@pytest.mark.parametrize("orthogonal", [False, True])
def test_rows_are_marginally_standard_gaussian(orthogonal):
    """E[w] = 0, E[w w^T] = I and |w|^2 ~ chi^2(d): mean d, variance 2d."""
    d, rows = 4, 20000
    w = draw(rows, d, seed=1, orthogonal=orthogonal)
    sq_norm = (w * w).sum(-1)
    assert abs(sq_norm.mean() - d) < Z * math.sqrt(2 * d / rows)
    assert abs(sq_norm.var() - 2 * d) < Z * math.sqrt(
        (sq_norm - d).pow(4).mean().item() / rows  # SE of a sample variance ~ sqrt(mu4 / N)
    )
    assert w.mean(0).abs().max() < Z / math.sqrt(rows)
    # Each entry of w w^T has variance <= 2 (Gaussian fourth moments): SE sqrt(2 / N).
    torch.testing.assert_close(
        w.T @ w / rows, torch.eye(d, dtype=torch.float64), atol=Z * math.sqrt(2 / rows), rtol=0
    )


# ----------------------------------------------------------------------- unbiasedness


def test_random_fourier_features_are_unbiased_for_the_gaussian_kernel(pair):
    x, y = pair
    draws, m = 20000, 8
    w = draw(draws * m, 4, seed=5)
    target = float(ea.gaussian_kernel(x, y, 1.0))
    assert_mean_within_clt(estimates(ea.random_fourier_features, x, y, w, draws), target)
    b = 2 * math.pi * torch.rand(draws * m, generator=torch.Generator().manual_seed(6),
                                 dtype=torch.float64)
    with_phase = estimates(lambda z, w_: ea.random_fourier_features(z, w_, b), x, y, w, draws)
    assert_mean_within_clt(with_phase, target)


def test_bandwidth_by_scaling_the_frequencies(pair):
    x, y = pair
    sigma, draws, m = 0.4, 20000, 8
    w = draw(draws * m, 4, seed=7) / sigma  # frequencies N(0, I / sigma^2)
    values = estimates(ea.random_fourier_features, x, y, w, draws)
    assert_mean_within_clt(values, float(ea.gaussian_kernel(x, y, sigma)))


@pytest.mark.parametrize(
    "feature_map",
    [ea.trig_softmax_features, ea.positive_softmax_features, ea.hyperbolic_softmax_features],
)
def test_softmax_features_are_unbiased(pair, feature_map):
    x, y = pair
    draws, m = 20000, 16
    w = draw(draws * m, 4, seed=8)
    values = estimates(feature_map, x, y, w, draws)
    assert_mean_within_clt(values, math.exp(float(x @ y.T)))


def test_features_are_positive_where_claimed(pair):
    x, _ = pair
    w = draw(64, 4, seed=9) * 3.0
    assert (ea.positive_softmax_features(x, w) > 0).all()
    assert (ea.hyperbolic_softmax_features(x, w) > 0).all()
    assert (ea.trig_softmax_features(x, w) < 0).any()


# ----------------------------------------------------- closed-form MSE (Lemma 2)


def closed_form_mse(kind, x, y, m):
    """MSE of the m-row iid estimators of SM(x, y) = exp(x^T y) (Choromanski et al. 2021).

    m is the number of rows of w: trig and hyperbolic then have 2m features, positive m.
    """
    sm = math.exp(float(x @ y.T))
    plus = float(((x + y) ** 2).sum())
    minus = float(((x - y) ** 2).sum())
    if kind == "trig":
        return math.exp(plus) / sm**2 * (1 - math.exp(-minus)) ** 2 / (2 * m)
    if kind == "positive":
        return math.exp(plus) * sm**2 * (1 - math.exp(-plus)) / m
    return math.exp(plus) * sm**2 * (1 - math.exp(-plus)) ** 2 / (2 * m)  # hyperbolic


@pytest.mark.parametrize(
    "kind, feature_map",
    [
        ("trig", ea.trig_softmax_features),
        ("positive", ea.positive_softmax_features),
        ("hyperbolic", ea.hyperbolic_softmax_features),
    ],
)
def test_mse_matches_closed_form(pair, kind, feature_map):
    x, y = pair
    draws, m = 20000, 16
    w = draw(draws * m, 4, seed=10)
    squared_errors = (estimates(feature_map, x, y, w, draws) - math.exp(float(x @ y.T))) ** 2
    # The empirical MSE is a sample mean of squared errors: same CLT tolerance.
    assert_mean_within_clt(squared_errors, closed_form_mse(kind, x, y, m))


def test_hyperbolic_never_worse_than_positive(pair):
    x, y = pair
    for m in (1, 16, 256):
        assert closed_form_mse("hyperbolic", x, y, m) <= closed_form_mse("positive", x, y, m)


# ------------------------------------------------------------------ 1 / sqrt(m) decay


@pytest.mark.parametrize(
    "feature_map, target",
    [
        (ea.random_fourier_features, lambda x, y: float(ea.gaussian_kernel(x, y, 1.0))),
        (ea.trig_softmax_features, lambda x, y: math.exp(float(x @ y.T))),
        (ea.positive_softmax_features, lambda x, y: math.exp(float(x @ y.T))),
    ],
)
def test_error_decays_like_one_over_sqrt_m(pair, feature_map, target):
    """For iid rows MSE = C / m exactly, so log RMSE against log m has slope -1/2.

    With R = 400 draws the relative standard error of each MSE is about sqrt(2 / R) = 7%
    (near-Gaussian errors), 3.5% on the RMSE; over log(1024/16) = 4.2 the fitted slope
    then has a standard error near 0.01, and +-0.1 is a wide margin.
    """
    x, y = pair
    draws = 400
    sizes = [16, 64, 256, 1024]
    rmse = []
    for i, m in enumerate(sizes):
        w = draw(draws * m, 4, seed=20 + i)
        errors = estimates(feature_map, x, y, w, draws) - target(x, y)
        rmse.append(float(errors.pow(2).mean().sqrt()))
    log_m = torch.log(torch.tensor(sizes, dtype=torch.float64))
    log_rmse = torch.log(torch.tensor(rmse, dtype=torch.float64))
    centred = log_m - log_m.mean()
    slope = float((centred * (log_rmse - log_rmse.mean())).sum() / (centred**2).sum())
    assert abs(slope + 0.5) < 0.1, slope


# ----------------------------------------------------- orthogonal features (Theorem 2)


def two_points(d, norm=0.5):
    """x and y of norm ``norm`` at 60 degrees, embedded in R^d."""
    x = torch.zeros(1, d, dtype=torch.float64)
    y = torch.zeros(1, d, dtype=torch.float64)
    x[0, 0] = norm
    y[0, 0], y[0, 1] = norm * 0.5, norm * math.sqrt(3) / 2
    return x, y


def test_orthogonal_positive_features_beat_the_iid_mse():
    """Choromanski et al. 2021, Theorem 2: orthogonal rows lower the MSE of FAVOR+.

    The iid MSE is known exactly (Lemma 2, checked above); the orthogonal one is
    estimated from 20000 draws and must be below it by more than 4 standard errors.
    Here (d = m = 16, |x| = |y| = 0.5 at 60 degrees) the orthogonal MSE is about 0.8
    times the iid one, a gap of about 19 standard errors across seeds.
    """
    d = m = 16
    draws = 20000
    x, y = two_points(d)
    w = draw(draws * m, d, seed=31, orthogonal=True)
    squared = (estimates(ea.positive_softmax_features, x, y, w, draws)
               - math.exp(float(x @ y.T))) ** 2
    standard_error = float(squared.std()) / math.sqrt(draws)
    assert float(squared.mean()) + Z * standard_error < closed_form_mse("positive", x, y, m)


def test_orthogonal_trig_features_beat_iid():
    """Orthogonal random features lower the MSE of the trigonometric estimator too."""
    d = m = 16
    draws = 4000
    x, y = two_points(d)
    target = math.exp(float(x @ y.T))
    mse = {}
    for orthogonal in (False, True):
        w = draw(draws * m, d, seed=33, orthogonal=orthogonal)
        squared = (estimates(ea.trig_softmax_features, x, y, w, draws) - target) ** 2
        mse[orthogonal] = (float(squared.mean()), float(squared.std()) / math.sqrt(draws))
    gap_se = math.hypot(mse[False][1], mse[True][1])
    assert mse[True][0] + Z * gap_se < mse[False][0]


# -------------------------------------------------------------- shapes, dtypes, errors


def test_feature_shapes_and_dtypes():
    x = torch.randn(2, 3, 7, 4)
    w = torch.randn(5, 4)
    assert ea.random_fourier_features(x, w).shape == (2, 3, 7, 10)
    assert ea.random_fourier_features(x, w, torch.zeros(5)).shape == (2, 3, 7, 5)
    assert ea.trig_softmax_features(x, w).shape == (2, 3, 7, 10)
    assert ea.positive_softmax_features(x, w).shape == (2, 3, 7, 5)
    assert ea.hyperbolic_softmax_features(x, w).shape == (2, 3, 7, 10)
    for dtype in (torch.float16, torch.bfloat16):
        out = ea.positive_softmax_features(x.to(dtype) * 0.5, w.to(dtype))
        reference = ea.positive_softmax_features(x * 0.5, w)
        assert out.dtype == dtype
        # Inputs rounded to 2^-11 (fp16) or 2^-8 (bf16) relative, the exponent of
        # size ~3 carries that into a relative error of a few times 2^-8 at most.
        torch.testing.assert_close(out.float(), reference, rtol=5e-2, atol=1e-3)


def test_bad_inputs_name_the_argument():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="w must have as many columns"):
        ea.positive_softmax_features(x, torch.randn(5, 3))
    with pytest.raises(ValueError, match="w must be a matrix"):
        ea.trig_softmax_features(x, torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="b must have shape"):
        ea.random_fourier_features(x, torch.randn(5, 4), torch.zeros(4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ea.hyperbolic_softmax_features([[1.0]], torch.randn(5, 1))
    with pytest.raises(ValueError, match="m must be a positive int"):
        ea.gaussian_random_matrix(0, 4)
    with pytest.raises(TypeError, match="d must be a positive int"):
        ea.gaussian_random_matrix(3, 4.0)
    with pytest.raises(TypeError, match="generator"):
        ea.gaussian_random_matrix(3, 4, generator=0)
    with pytest.raises(TypeError, match="dtype"):
        ea.gaussian_random_matrix(3, 4, dtype=torch.int64)
