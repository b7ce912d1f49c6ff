r"""Self-supervised linear purification: ridge regression of the data onto itself.

Given data ``X (m, n)`` (``n`` samples of dimension ``m``, one per column), a
*purifier* is a matrix ``W (m, m)`` trained to reproduce the data, with a ridge
penalty that stops it from being the identity:

.. math:: L(W; X, \lambda) = \|X - W X\|_F^2 + \lambda \|W\|_F^2 .

Each row of ``W`` solves a ridge regression, so the minimiser is

.. math::
    W^\star = X X^\top (X X^\top + \lambda I)^{-1}
            = U \,\mathrm{diag}\!\Big(\frac{\sigma_i^2}{\sigma_i^2 + \lambda}\Big) U^\top

with ``X = U diag(sigma) V^T``. Along the ``i``-th left singular direction the
purifier multiplies by the *shrinkage factor* ``sigma_i^2 / (sigma_i^2 + lambda)``:
close to 1 for strong directions (signal, kept), close to 0 for weak ones (noise,
suppressed). ``lambda`` sets the cut-off near ``sigma^2 = lambda``.

Reference: A. E. Hoerl and R. W. Kennard, "Ridge regression: biased estimation for
nonorthogonal problems", Technometrics 12, 1970.
"""

from __future__ import annotations

import torch

from ._checks import check_fraction, check_nonnegative_float, check_positive_int, check_tensor

__all__ = [
    "purification_loss",
    "optimal_purifier",
    "shrinkage_factors",
    "lambda_interval",
    "purify",
]


def _check_lam(lam: object) -> float:
    return check_nonnegative_float(lam, "lam")


def purification_loss(w: torch.Tensor, x: torch.Tensor, lam: float) -> torch.Tensor:
    """``||X - W X||_F^2 + lam ||W||_F^2`` for ``w (..., m, m)`` and ``x (..., m, n)``.

    Returns a tensor of shape ``(...)``. Cost: time ``O(m^2 n)``, memory ``O(m n)``.
    """
    w = check_tensor(w, "w", min_dim=2)
    x = check_tensor(x, "x", min_dim=2)
    lam = _check_lam(lam)
    m = x.shape[-2]
    if w.shape[-2:] != (m, m):
        raise ValueError(
            f"w must have shape (..., m, m) with m={m} rows of x, got w.shape={tuple(w.shape)} "
            f"and x.shape={tuple(x.shape)}"
        )
    residual = x - w @ x  # (..., m, n)
    return residual.square().sum(dim=(-2, -1)) + lam * w.square().sum(dim=(-2, -1))


def shrinkage_factors(singular_values: torch.Tensor, lam: float) -> torch.Tensor:
    """``sigma^2 / (sigma^2 + lam)``, elementwise: the purifier's gain per direction.

    With ``lam = 0`` a zero singular value gets factor 0 (the purifier is then the
    orthogonal projection onto the column space of ``X``). Any shape; cost ``O(size)``.
    """
    s = check_tensor(singular_values, "singular_values", min_dim=0)
    lam = _check_lam(lam)
    power = s.square()
    denominator = power + lam
    return torch.where(denominator > 0, power / torch.where(denominator > 0, denominator, 1), 0)


def optimal_purifier(x: torch.Tensor, lam: float) -> torch.Tensor:
    """Minimiser ``W* = U diag(sigma^2 / (sigma^2 + lam)) U^T`` of :func:`purification_loss`.

    Equal to ``X X^T (X X^T + lam I)^{-1}`` for ``lam > 0``; computed from the thin
    SVD of ``x (..., m, n)``, which is stable even when ``X X^T`` is singular. Returns
    ``(..., m, m)``. Cost: one SVD, time ``O(m n min(m, n) + m^2 min(m, n))``.
    """
    x = check_tensor(x, "x", min_dim=2)
    lam = _check_lam(lam)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)  # (..., m, p), (..., p)
    factors = shrinkage_factors(s, lam)  # (..., p)
    return (u * factors.unsqueeze(-2)) @ u.transpose(-2, -1)


def purify(x: torch.Tensor, lam: float) -> torch.Tensor:
    """``W* X``: the data after the optimal purifier, shape ``(..., m, n)``."""
    return optimal_purifier(x, lam) @ x


def lambda_interval(
    singular_values: torch.Tensor,
    keep: int,
    keep_threshold: float = 0.8,
    suppress_threshold: float = 0.5,
) -> tuple[float, float]:
    r"""Range ``[low, high]`` of ``lambda`` that keeps the top ``keep`` directions, damps the rest.

    The factor ``f = sigma^2 / (sigma^2 + lambda)`` falls as ``lambda`` grows, and

    .. math::
        f \ge t \iff \lambda \le \sigma^2 (1 - t) / t .

    Keeping every one of the ``keep`` largest singular values (``f >= keep_threshold``)
    is a condition on the smallest of them, ``sigma_keep``, and suppressing all
    the others (``f <= suppress_threshold``) is a condition on the largest of them,
    ``sigma_{keep+1}``:

    ``low = sigma_{keep+1}^2 (1 - s) / s``, ``high = sigma_keep^2 (1 - k) / k``.

    Returns ``(low, high)`` as floats; ``low > high`` means no ``lambda`` does both.
    ``singular_values`` is a 1-D tensor in any order. Cost ``O(p log p)``.
    """
    s = check_tensor(singular_values, "singular_values", min_dim=1)
    if s.dim() != 1:
        raise ValueError(f"singular_values must be 1-D, got shape {tuple(s.shape)}")
    keep = check_positive_int(keep, "keep")
    if keep >= s.shape[0]:
        raise ValueError(
            f"keep must be smaller than the number of singular values {s.shape[0]}, got {keep}"
        )
    keep_threshold = check_fraction(keep_threshold, "keep_threshold")
    suppress_threshold = check_fraction(suppress_threshold, "suppress_threshold")
    ordered = torch.sort(s.abs(), descending=True).values
    smallest_kept = float(ordered[keep - 1])
    largest_suppressed = float(ordered[keep])
    high = smallest_kept**2 * (1.0 - keep_threshold) / keep_threshold
    low = largest_suppressed**2 * (1.0 - suppress_threshold) / suppress_threshold
    return low, high
