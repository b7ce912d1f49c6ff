"""Random features: finite maps whose inner products estimate a kernel without bias.

Bochner's theorem writes a shift-invariant kernel as an expectation over random
frequencies ``w``; sampling ``m`` of them gives a feature map ``phi`` with
``E[phi(x)^T phi(y)] = K(x, y)`` and an error that shrinks like ``1/sqrt(m)``.

Conventions (all maps here):

- ``x`` is ``(..., n, d)``; ``w`` is ``(m, d)``, one frequency per row, usually from
  :func:`gaussian_random_matrix`; features are ``(..., n, m)`` or ``(..., n, 2m)``.
- The softmax maps estimate the *unscaled* kernel ``exp(x^T y)`` and do not subtract
  any maximum: they are unbiased but can overflow for large ``|x|``. Attention
  functions (:mod:`efficient_attention.performer`) scale by ``d^-1/4`` and stabilise.
- Half-precision inputs are computed in float32 and returned in their own dtype.

References: Rahimi and Recht, "Random Features for Large-Scale Kernel Machines",
NeurIPS 2007; Yu et al., "Orthogonal Random Features", NeurIPS 2016; Choromanski
et al., "Rethinking Attention with Performers", ICLR 2021.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    HALF_DTYPES,
    check_bool,
    check_generator,
    check_positive_int,
    check_tensor,
    compute_dtype,
)

__all__ = [
    "gaussian_random_matrix",
    "random_fourier_features",
    "trig_softmax_features",
    "positive_softmax_features",
    "hyperbolic_softmax_features",
]

def gaussian_random_matrix(
    m: int,
    d: int,
    *,
    orthogonal: bool = False,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""``m`` random frequencies in ``R^d``: a matrix ``(m, d)`` whose rows are ``N(0, I_d)``.

    With ``orthogonal=False`` the rows are independent standard Gaussians.

    With ``orthogonal=True`` the rows come in blocks of ``d`` that are exactly
    orthogonal (Yu et al. 2016; Performers' ORF): each block is the ``Q`` of a QR
    decomposition of a ``d x d`` Gaussian matrix (signs fixed by ``diag(R)`` so that
    ``Q`` is Haar-distributed), and each row is then given the length of an
    independent Gaussian vector, which follows the ``chi(d)`` distribution. Every
    row is therefore still marginally ``N(0, I_d)`` (a uniform direction times a
    chi length), so every estimator stays unbiased, while the rows of a block are
    no longer independent. ``m > d`` stacks ``ceil(m / d)`` independent blocks and
    keeps the first ``m`` rows.

    Args:
        m: number of rows (features), ``>= 1``.
        d: dimension, ``>= 1``.
        orthogonal: draw orthogonal blocks.
        generator: a ``torch.Generator`` on ``device`` for reproducible draws.
        dtype: floating dtype of the result (default ``torch.get_default_dtype()``);
            half types are drawn in float32 and then cast.
        device: where to draw (default: the generator's device, else CPU).

    Returns:
        ``(m, d)``.

    Cost: iid ``O(m d)``; orthogonal ``O(m d^2)`` time for the QR decompositions.
    """
    check_positive_int(m, "m")
    check_positive_int(d, "d")
    generator = check_generator(generator)
    check_bool(orthogonal, "orthogonal")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    draw_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    kwargs = dict(generator=generator, dtype=draw_dtype, device=device)
    if not orthogonal:
        return torch.randn(m, d, **kwargs).to(dtype)
    num_blocks = math.ceil(m / d)
    gaussian = torch.randn(num_blocks, d, d, **kwargs)  # (blocks, d, d)
    q, r = torch.linalg.qr(gaussian)  # columns of q are orthonormal
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))  # (blocks, d)
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    directions = (q * signs.unsqueeze(-2)).transpose(-2, -1)  # rows orthonormal
    lengths = torch.randn(num_blocks, d, d, **kwargs).norm(dim=-1)  # chi(d), (blocks, d)
    rows = directions * lengths.unsqueeze(-1)  # (blocks, d, d)
    return rows.reshape(num_blocks * d, d)[:m].to(dtype)


def _check_x_w(x: object, w: object) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_tensor(x, "x", min_dim=1)
    w = check_tensor(w, "w", min_dim=2)
    if w.dim() != 2 or w.shape[0] == 0:
        raise ValueError(f"w must be a matrix (m, d) with m >= 1 rows, got shape {tuple(w.shape)}")
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"w must have as many columns as x has features, got w.shape={tuple(w.shape)} "
            f"and x.shape={tuple(x.shape)} (expected w of shape (m, {x.shape[-1]}))"
        )
    if w.device != x.device:
        raise ValueError(f"w must be on the device of x ({x.device}), got {w.device}")
    return x, w


def _projection(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x w^T`` ``(..., n, m)`` and ``|x|^2 / 2`` ``(..., n, 1)``, in the compute dtype."""
    dtype = compute_dtype(x, w)
    x, w = x.to(dtype), w.to(dtype)
    return x @ w.transpose(-2, -1), 0.5 * (x * x).sum(-1, keepdim=True)


def random_fourier_features(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    r"""Random Fourier features of the Gaussian kernel ``exp(-|x - y|^2 / 2)``.

    With ``w_i ~ N(0, I)`` Bochner's theorem gives ``E[cos(w^T (x - y))] =
    exp(-|x - y|^2 / 2)``, and two unbiased maps follow:

    - ``b`` given (``b_i ~ U[0, 2 pi]``): ``phi(x) = sqrt(2/m) cos(x w^T + b)``,
      ``(..., n, m)`` (Rahimi and Recht 2007);
    - ``b is None``: ``phi(x) = [cos(x w^T), sin(x w^T)] / sqrt(m)``, ``(..., n, 2m)``,
      whose inner product is exactly ``(1/m) sum_i cos(w_i^T (x - y))`` (lower variance).

    For a bandwidth ``sigma``, ``exp(-|x-y|^2 / (2 sigma^2))``, pass ``w / sigma``
    (frequencies ``N(0, I / sigma^2)``).

    Shapes: x ``(..., n, d)``, w ``(m, d)``, b ``(m,)``. Cost: time ``O(n m d)``,
    memory ``O(n m)``.
    """
    x, w = _check_x_w(x, w)
    proj, _ = _projection(x, w)  # (..., n, m)
    m = w.shape[0]
    if b is None:
        return (torch.cat([proj.cos(), proj.sin()], dim=-1) / math.sqrt(m)).to(x.dtype)
    b = check_tensor(b, "b", min_dim=1)
    if tuple(b.shape) != (m,):
        raise ValueError(f"b must have shape (m,)=({m},) like the rows of w, got {tuple(b.shape)}")
    if b.device != x.device:
        raise ValueError(f"b must be on the device of x ({x.device}), got {b.device}")
    return (math.sqrt(2.0 / m) * torch.cos(proj + b.to(proj.dtype))).to(x.dtype)


def trig_softmax_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r"""Trigonometric random features of the softmax kernel ``exp(x^T y)``.

    ``phi(x) = exp(|x|^2 / 2) [cos(x w^T), sin(x w^T)] / sqrt(m)``, ``(..., n, 2m)``.
    Since ``exp(x^T y) = exp(|x|^2/2) exp(-|x - y|^2/2) exp(|y|^2/2)`` the inner product
    is the random Fourier estimate of the middle factor times the outer ones, unbiased
    for ``w_i ~ N(0, I)``. With ``m`` iid frequencies (rows of ``w``, ``2m`` features) its
    mean squared error (Choromanski et al. 2021, Lemma 2) is

    .. math:: \frac{1}{2m} \exp(|x|^2 + |y|^2) (1 - \exp(-|x - y|^2))^2
              = \frac{1}{2m} \exp(|x + y|^2) \mathrm{SM}(x, y)^{-2} (1 - \exp(-|x - y|^2))^2

    so its relative error is large where the kernel is small; estimates can be negative.

    Shapes: x ``(..., n, d)``, w ``(m, d)``. Cost: time ``O(n m d)``, memory ``O(n m)``.
    """
    x, w = _check_x_w(x, w)
    proj, half_sq_norm = _projection(x, w)
    scale = torch.exp(half_sq_norm) / math.sqrt(w.shape[0])  # (..., n, 1)
    return (scale * torch.cat([proj.cos(), proj.sin()], dim=-1)).to(x.dtype)


def positive_softmax_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r"""Positive random features of the softmax kernel (FAVOR+, Choromanski et al. 2021).

    ``phi(x) = exp(-|x|^2 / 2) exp(x w^T) / sqrt(m)``, ``(..., n, m)``. For
    ``w ~ N(0, I)``, ``E[exp(w^T (x + y))] = exp(|x + y|^2 / 2)``, so the inner product
    is an unbiased estimate of ``SM(x, y) = exp(x^T y)`` made of positive terms only.
    With ``m`` iid rows of ``w`` its mean squared error (their Lemma 2) is

    .. math:: \frac{1}{m} \exp(|x + y|^2) \mathrm{SM}(x, y)^2 (1 - \exp(-|x + y|^2)),

    (``Var exp(w^T s) = exp(2|s|^2) - exp(|s|^2)`` with ``s = x + y``, times
    ``exp(-|x|^2 - |y|^2) / m``), small where the kernel is small.

    Shapes: x ``(..., n, d)``, w ``(m, d)``. Cost: time ``O(n m d)``, memory ``O(n m)``.
    """
    x, w = _check_x_w(x, w)
    proj, half_sq_norm = _projection(x, w)
    return (torch.exp(proj - half_sq_norm) / math.sqrt(w.shape[0])).to(x.dtype)


def hyperbolic_softmax_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r"""Hyperbolic positive random features of the softmax kernel.

    ``phi(x) = exp(-|x|^2 / 2) [exp(x w^T), exp(-x w^T)] / sqrt(2m)``, ``(..., n, 2m)``:
    the inner product is ``(1/m) sum_i exp(-(|x|^2+|y|^2)/2) cosh(w_i^T (x + y))``,
    unbiased and positive. Its mean squared error with ``m`` iid rows of ``w`` is

    .. math:: \frac{1}{2m} \exp(|x + y|^2) \mathrm{SM}(x, y)^2 (1 - \exp(-|x + y|^2))^2,

    never larger than that of :func:`positive_softmax_features` with the same ``m``
    (but it has twice the features).

    Shapes: x ``(..., n, d)``, w ``(m, d)``. Cost: time ``O(n m d)``, memory ``O(n m)``.
    """
    x, w = _check_x_w(x, w)
    proj, half_sq_norm = _projection(x, w)
    both = torch.cat([proj, -proj], dim=-1) - half_sq_norm  # (..., n, 2m)
    return (torch.exp(both) / math.sqrt(2 * w.shape[0])).to(x.dtype)
