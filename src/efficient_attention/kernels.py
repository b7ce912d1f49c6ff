"""Kernels and their Gram matrices: Gaussian, softmax (exponential), polynomial.

A kernel ``K(x, y)`` is an inner product ``phi(x)^T phi(y)`` in some feature space.
Every kernel here takes ``x`` of shape ``(..., n_x, d)`` and ``y`` of shape
``(..., n_y, d)`` and returns the Gram matrix ``(..., n_x, n_y)`` with entries
``K(x_i, y_j)``. The polynomial kernel also has an exact finite feature map
(:func:`polynomial_features`); the Gaussian and softmax kernels need infinitely
many features, which :mod:`efficient_attention.random_features` approximates.

Reference: Schoelkopf and Smola, "Learning with Kernels", MIT Press 2002.
"""

from __future__ import annotations

import itertools
import math

import torch

from ._checks import (
    HALF_DTYPES,
    check_nonnegative_float,
    check_nonnegative_int,
    check_positive_float,
    check_real,
    check_same_last_dim,
    check_tensor,
)

__all__ = [
    "gaussian_kernel",
    "softmax_kernel",
    "polynomial_kernel",
    "polynomial_features",
    "polynomial_feature_dim",
    "is_positive_semidefinite",
]


def _check_pair(x: object, y: object) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_tensor(x, "x", min_dim=2)
    y = check_tensor(y, "y", min_dim=2)
    check_same_last_dim(x, y, "x", "y")
    if x.device != y.device:
        raise ValueError(f"x and y must be on one device, got {x.device} and {y.device}")
    return x, y


def gaussian_kernel(x: torch.Tensor, y: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    r"""Gaussian (RBF) kernel ``K(x, y) = exp(-|x - y|^2 / (2 sigma^2))``.

    Shapes: x ``(..., n_x, d)``, y ``(..., n_y, d)`` -> ``(..., n_x, n_y)``.
    The squared distance is expanded as ``|x|^2 + |y|^2 - 2 x^T y`` (one matmul) and
    clamped at zero against round-off.

    Cost: time ``O(n_x n_y d)``, memory ``O(n_x n_y)``.
    """
    x, y = _check_pair(x, y)
    sigma = check_positive_float(sigma, "sigma")
    sq_x = (x * x).sum(-1, keepdim=True)  # (..., n_x, 1)
    sq_y = (y * y).sum(-1).unsqueeze(-2)  # (..., 1, n_y)
    sq_dist = (sq_x + sq_y - 2.0 * (x @ y.transpose(-2, -1))).clamp_min(0.0)
    return torch.exp(-sq_dist / (2.0 * sigma**2))


def softmax_kernel(x: torch.Tensor, y: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    r"""Softmax (exponential) kernel ``SM(x, y) = exp(scale * x^T y)``.

    It is the unnormalised weight of softmax attention: row-normalising
    ``softmax_kernel(q, k)`` gives ``softmax(q k^T / sqrt(d))`` when ``scale`` is the
    default ``1/sqrt(d)``. Pass ``scale=1.0`` for the plain ``exp(x^T y)`` that random
    features estimate.

    Shapes: x ``(..., n_x, d)``, y ``(..., n_y, d)`` -> ``(..., n_x, n_y)``.
    Cost: time ``O(n_x n_y d)``, memory ``O(n_x n_y)``.
    """
    x, y = _check_pair(x, y)
    if scale is None:
        if x.shape[-1] == 0:
            raise ValueError("softmax_kernel needs d >= 1 for its default scale 1/sqrt(d), "
                             f"got x.shape={tuple(x.shape)}; pass scale explicitly")
        scale = 1.0 / math.sqrt(x.shape[-1])
    else:
        scale = check_real(scale, "scale")
    return torch.exp(scale * (x @ y.transpose(-2, -1)))


def polynomial_kernel(
    x: torch.Tensor, y: torch.Tensor, degree: int = 2, c: float = 1.0
) -> torch.Tensor:
    r"""Polynomial kernel ``K(x, y) = (x^T y + c)^degree``.

    Shapes: x ``(..., n_x, d)``, y ``(..., n_y, d)`` -> ``(..., n_x, n_y)``.
    It is positive semidefinite for ``c >= 0``; ``degree = 0`` is the constant kernel 1.
    Cost: time ``O(n_x n_y d)``, memory ``O(n_x n_y)``.
    """
    x, y = _check_pair(x, y)
    check_nonnegative_int(degree, "degree")
    c = check_nonnegative_float(c, "c")
    return (x @ y.transpose(-2, -1) + c) ** degree


def polynomial_feature_dim(d: int, degree: int = 2) -> int:
    """Length ``C(d + degree, degree)`` of :func:`polynomial_features` for inputs of size ``d``.

    For ``degree=2`` this is ``1 + d + d(d+1)/2``: a constant, ``d`` linear terms,
    ``d`` squares and ``d(d-1)/2`` cross products; ``degree = 0`` gives 1 (the constant).
    """
    check_nonnegative_int(d, "d")
    check_nonnegative_int(degree, "degree")
    return math.comb(d + degree, degree)


def polynomial_features(x: torch.Tensor, degree: int = 2, c: float = 1.0) -> torch.Tensor:
    r"""Exact feature map of the polynomial kernel: ``phi(x)^T phi(y) = (x^T y + c)^degree``.

    Write ``x~ = (sqrt(c), x_1, ..., x_d)``, so ``x^T y + c = x~^T y~``. The multinomial
    theorem gives

    .. math:: (x~^T y~)^p = \sum_{|\alpha| = p} \binom{p}{\alpha}
              \prod_i x~_i^{\alpha_i} \prod_i y~_i^{\alpha_i},

    a sum over the multi-indices ``alpha`` of ``d + 1`` non-negative integers adding
    up to ``p``. Hence ``phi_alpha(x) = sqrt(p! / prod_i alpha_i!) prod_i x~_i^alpha_i``.
    For ``p = 2`` and ``c = 1`` the features are ``1``, ``sqrt(2) x_i``, ``x_i^2`` and
    ``sqrt(2) x_i x_j`` for ``i < j``: the cross terms with their ``sqrt(2)`` are
    needed (a map made of ``1, sqrt(2) x_i, x_i^2`` alone is not exact).

    Args:
        x: ``(..., n, d)``.
        degree: the power ``p >= 0`` (``p = 0``: the single feature 1).
        c: the offset, ``>= 0``.

    Returns:
        ``(..., n, C(d + p, p))`` (see :func:`polynomial_feature_dim`), ordered by
        multi-index as :func:`itertools.combinations_with_replacement` lists them.

    Cost: time and memory ``O(n C(d + p, p) p)``; the feature count grows like
    ``d^p / p!``, which is why the map only pays off for small ``d`` and ``p``.
    """
    x = check_tensor(x, "x", min_dim=1)
    check_nonnegative_int(degree, "degree")
    c = check_nonnegative_float(c, "c")
    d = x.shape[-1]
    offset = torch.full((*x.shape[:-1], 1), math.sqrt(c), dtype=x.dtype, device=x.device)
    x_tilde = torch.cat([offset, x], dim=-1)  # (..., n, d + 1)
    index_tuples = list(itertools.combinations_with_replacement(range(d + 1), degree))
    index = torch.tensor(index_tuples, dtype=torch.long, device=x.device)
    index = index.reshape(len(index_tuples), degree)  # (F, p); p = 0: one empty product
    coefficients = [
        math.sqrt(
            math.factorial(degree)
            / math.prod(math.factorial(t.count(i)) for i in set(t))
        )
        for t in index_tuples
    ]
    coef = torch.tensor(coefficients, dtype=x.dtype, device=x.device)  # (F,)
    factors = x_tilde[..., index]  # (..., n, F, p)
    return coef * factors.prod(dim=-1)  # (..., n, F)


def is_positive_semidefinite(k: torch.Tensor, tol: float | None = None) -> bool:
    r"""Whether the square matrix (or batch of matrices) ``k`` is symmetric PSD.

    Checks symmetry up to round-off and that the smallest eigenvalue of every matrix
    is ``>= -tol * max(1, max |eigenvalue|)``. The default ``tol`` is
    ``n * eps(dtype) * 10``: eigenvalues computed in floating point are off by about
    ``n eps |K|`` (Weyl's inequality), so a Gram matrix that is PSD in exact
    arithmetic passes, while a clearly indefinite matrix fails.

    Shapes: ``(..., n, n)``; an empty batch or ``n = 0`` is PSD (there is nothing to
    violate). Cost: time ``O(n^3)`` (one symmetric eigendecomposition).
    """
    k = check_tensor(k, "K", min_dim=2)
    if k.shape[-1] != k.shape[-2]:
        raise ValueError(f"K must be square (..., n, n), got shape {tuple(k.shape)}")
    if tol is None:
        tol = 10.0 * k.shape[-1] * torch.finfo(k.dtype).eps
    else:
        tol = check_positive_float(tol, "tol")
    if k.numel() == 0:
        return True
    k64 = k.to(torch.float64) if k.dtype in HALF_DTYPES else k
    scale = max(1.0, float(k64.abs().max())) if k64.numel() else 1.0
    if not torch.allclose(k64, k64.transpose(-2, -1), rtol=0.0, atol=tol * scale):
        return False
    eigenvalues = torch.linalg.eigvalsh(k64)  # (..., n), ascending
    top = max(1.0, float(eigenvalues.abs().max()))
    return bool((eigenvalues[..., 0] >= -tol * top).all())
