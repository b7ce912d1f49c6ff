"""Tests for efficient_attention.kernels: Gram matrices, the exact polynomial map, PSD check."""

import math

import pytest
import torch

import efficient_attention as ea


@pytest.fixture
def xy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    y = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    return x, y


def pairwise(fn, x, y):
    """The Gram matrix entry by entry, (..., n_x, n_y), as the definition reads."""
    out = torch.empty(*x.shape[:-1], y.shape[-2], dtype=x.dtype)
    for i in range(x.shape[-2]):
        for j in range(y.shape[-2]):
            out[..., i, j] = fn(x[..., i, :], y[..., j, :])
    return out


def test_gaussian_kernel_matches_definition(xy):
    x, y = xy
    sigma = 0.7
    expected = pairwise(lambda a, b: torch.exp(-((a - b) ** 2).sum(-1) / (2 * sigma**2)), x, y)
    got = ea.gaussian_kernel(x, y, sigma)
    assert got.shape == (2, 5, 4)
    # float64 round-off only: the expansion |x|^2 + |y|^2 - 2x.y loses ~1e-15 relative.
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(ea.gaussian_kernel(x, x, sigma).diagonal(dim1=-2, dim2=-1) == 1.0)


def test_softmax_kernel_default_and_explicit_scale(xy):
    x, y = xy
    d = x.shape[-1]
    torch.testing.assert_close(
        ea.softmax_kernel(x, y), torch.exp(x @ y.transpose(-2, -1) / math.sqrt(d))
    )
    torch.testing.assert_close(ea.softmax_kernel(x, y, 1.0), torch.exp(x @ y.transpose(-2, -1)))


def test_polynomial_kernel_matches_definition(xy):
    x, y = xy
    expected = pairwise(lambda a, b: ((a * b).sum(-1) + 0.5) ** 3, x, y)
    torch.testing.assert_close(ea.polynomial_kernel(x, y, 3, 0.5), expected)


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
@pytest.mark.parametrize("c", [0.0, 0.5, 1.0, 2.0])
def test_polynomial_features_reproduce_the_kernel_exactly(xy, degree, c):
    x, y = xy
    phi_x = ea.polynomial_features(x, degree, c)
    phi_y = ea.polynomial_features(y, degree, c)
    d = x.shape[-1]
    assert phi_x.shape == (2, 5, math.comb(d + degree, degree))
    assert phi_x.shape[-1] == ea.polynomial_feature_dim(d, degree)
    # An identity: equal up to float64 round-off of sums of O(10) terms of size O(10^degree).
    torch.testing.assert_close(
        phi_x @ phi_y.transpose(-2, -1), ea.polynomial_kernel(x, y, degree, c),
        rtol=1e-12, atol=1e-10,
    )


def test_degree_two_map_has_the_cross_terms():
    d = 5
    assert ea.polynomial_feature_dim(d, 2) == 1 + d + d * (d + 1) // 2
    x = torch.tensor([[2.0, 3.0]], dtype=torch.float64)
    phi = ea.polynomial_features(x, degree=2, c=1.0)[0]
    # 1, sqrt2 x1, sqrt2 x2, x1^2, sqrt2 x1 x2, x2^2 (combinations_with_replacement order)
    expected = torch.tensor(
        [1.0, math.sqrt(2) * 2, math.sqrt(2) * 3, 4.0, math.sqrt(2) * 6, 9.0], dtype=torch.float64
    )
    torch.testing.assert_close(phi, expected)


def test_map_without_cross_terms_is_not_exact(xy):
    """The map [1, sqrt2 x_i, x_i^2] (missing sqrt2 x_i x_j) gives the wrong kernel."""
    x, y = xy

    def truncated(z):
        return torch.cat([torch.ones_like(z[..., :1]), math.sqrt(2) * z, z**2], dim=-1)

    wrong = truncated(x) @ truncated(y).transpose(-2, -1)
    assert (wrong - ea.polynomial_kernel(x, y, 2, 1.0)).abs().max() > 0.1


@pytest.mark.parametrize(
    "kernel",
    [
        lambda a, b: ea.gaussian_kernel(a, b, 1.3),
        lambda a, b: ea.softmax_kernel(a, b, 1.0),
        lambda a, b: ea.polynomial_kernel(a, b, 3, 1.0),
    ],
)
def test_gram_matrices_are_psd(kernel):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=g, dtype=torch.float64)
    assert ea.is_positive_semidefinite(kernel(x, x))


def test_indefinite_and_asymmetric_matrices_are_rejected():
    assert not ea.is_positive_semidefinite(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))  # eig -1
    assert not ea.is_positive_semidefinite(torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    # -|x-y| is conditionally but not positive definite: a negative eigenvalue exists.
    x = torch.linspace(0, 1, 6, dtype=torch.float64).unsqueeze(-1)
    assert not ea.is_positive_semidefinite(-torch.cdist(x, x))
    # A PSD matrix of rank one passes despite eigenvalues that round to about -1e-16.
    u = torch.randn(8, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert ea.is_positive_semidefinite(u @ u.T)
    batch = torch.stack([torch.eye(3), -torch.eye(3)])
    assert not ea.is_positive_semidefinite(batch)


def test_bad_inputs_name_the_argument(xy):
    x, y = xy
    with pytest.raises(ValueError, match="sigma"):
        ea.gaussian_kernel(x, y, 0.0)
    with pytest.raises(ValueError, match="x and y"):
        ea.gaussian_kernel(x, y[..., :2])
    with pytest.raises(ValueError, match="x must have at least 2"):
        ea.softmax_kernel(x[0, 0], y)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        ea.polynomial_kernel(x, [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="degree must be a non-negative int, got -1"):
        ea.polynomial_features(x, degree=-1)
    with pytest.raises(ValueError, match="c must be"):
        ea.polynomial_features(x, degree=2, c=-1.0)
    with pytest.raises(TypeError, match="degree"):
        ea.polynomial_kernel(x, y, 2.0)
    with pytest.raises(ValueError, match="K must be square"):
        ea.is_positive_semidefinite(torch.ones(2, 3))


def test_degree_zero_is_the_constant_kernel_everywhere():
    """Issue 14: polynomial_feature_dim(d, 0) was accepted but polynomial_features(x, 0)
    rejected. Degree 0 is (x.y + c)^0 = 1: one feature equal to 1, in all three."""
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    phi = ea.polynomial_features(x, degree=0)
    assert phi.shape == (2, 5, ea.polynomial_feature_dim(3, 0)) == (2, 5, 1)
    assert torch.equal(phi, torch.ones_like(phi))
    torch.testing.assert_close(phi @ phi.transpose(-2, -1), ea.polynomial_kernel(x, x, 0))


def test_empty_inputs():
    """Issue 14: a 0 x 0 matrix is positive semidefinite (nothing to violate); kernels of
    empty point sets are empty matrices."""
    assert ea.is_positive_semidefinite(torch.zeros(0, 0))
    assert ea.is_positive_semidefinite(torch.zeros(0, 3, 3))
    x, y = torch.randn(0, 4), torch.randn(3, 4)
    for kernel in (ea.gaussian_kernel, ea.softmax_kernel, ea.polynomial_kernel):
        assert kernel(x, y).shape == (0, 3) and kernel(y, x).shape == (3, 0)
    assert ea.polynomial_features(torch.randn(3, 0), degree=2).shape == (3, 1)
    with pytest.raises(ValueError, match="softmax_kernel needs d >= 1"):
        ea.softmax_kernel(torch.randn(3, 0), torch.randn(3, 0))


def test_complex_and_integer_tensors_are_rejected():
    """Issue 14: complex tensors passed check_tensor and failed deep inside torch."""
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor.*complex64"):
        ea.gaussian_kernel(x.to(torch.complex64), x)
    with pytest.raises(TypeError, match="K must be a real floating-point tensor.*int64"):
        ea.is_positive_semidefinite(torch.eye(3, dtype=torch.long))
