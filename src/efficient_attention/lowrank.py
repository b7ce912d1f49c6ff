r"""Low-rank approximation by the truncated singular value decomposition.

A matrix ``A = U diag(s) V^T`` (``s`` sorted, largest first) is best approximated
by keeping its ``r`` largest singular triplets:

.. math:: A_r = \sum_{i \le r} s_i u_i v_i^\top .

Eckart--Young--Mirsky theorem: no matrix of rank at most ``r`` is closer to ``A``,
in the Frobenius norm or in the spectral norm, and the errors are

.. math::
    \|A - A_r\|_F = \Big(\sum_{i > r} s_i^2\Big)^{1/2}, \qquad
    \|A - A_r\|_2 = s_{r+1}.

This is the yardstick for every low-rank attention method: no rank-``r``
approximation of an attention matrix can beat the truncated SVD.

Reference: C. Eckart and G. Young, "The approximation of one matrix by another of
lower rank", Psychometrika 1, 1936.
"""

from __future__ import annotations

import torch

from ._checks import check_positive_int, check_tensor

__all__ = [
    "singular_value_spectrum",
    "low_rank_approximation",
    "eckart_young_error",
    "spectral_energy",
]


def _check_rank(a: torch.Tensor, rank: object) -> int:
    rank = check_positive_int(rank, "rank")
    full = min(a.shape[-2], a.shape[-1])
    if rank > full:
        raise ValueError(
            f"rank must be at most min(n, m)={full} for a of shape {tuple(a.shape)}, got {rank}"
        )
    return rank


def singular_value_spectrum(a: torch.Tensor) -> torch.Tensor:
    """Singular values of ``a (..., n, m)`` in decreasing order, shape ``(..., min(n, m))``.

    Cost: one SVD, time ``O(n m min(n, m))`` per matrix.
    """
    a = check_tensor(a, "a", min_dim=2)
    return torch.linalg.svdvals(a)


def low_rank_approximation(a: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-``rank`` approximation ``U_r diag(s_r) V_r^T`` of ``a (..., n, m)``.

    Keeps the ``rank`` largest singular triplets (truncated SVD); by the
    Eckart--Young theorem the result is a closest matrix of rank at most ``rank``
    in both the Frobenius and the spectral norm. Returns ``(..., n, m)``.

    Cost: one thin SVD, time ``O(n m min(n, m))``, memory ``O(n m)``.
    """
    a = check_tensor(a, "a", min_dim=2)
    rank = _check_rank(a, rank)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)  # (..., n, p), (..., p), (..., p, m)
    u_r = u[..., :rank]  # (..., n, r)
    s_r = s[..., :rank]  # (..., r)
    vh_r = vh[..., :rank, :]  # (..., r, m)
    return (u_r * s_r.unsqueeze(-2)) @ vh_r


def eckart_young_error(a: torch.Tensor, rank: int, *, norm: str = "fro") -> torch.Tensor:
    """Error ``||a - a_r||`` of the best rank-``rank`` approximation, read off the spectrum.

    ``norm="fro"``: ``sqrt(sum_{i > r} s_i^2)``; ``norm="spectral"``: ``s_{r+1}``
    (zero when ``rank = min(n, m)``). Shape ``(...)`` for ``a (..., n, m)``.

    Cost: singular values only, time ``O(n m min(n, m))``.
    """
    a = check_tensor(a, "a", min_dim=2)
    rank = _check_rank(a, rank)
    if norm not in ("fro", "spectral"):
        raise ValueError(f"norm must be 'fro' or 'spectral', got {norm!r}")
    s = torch.linalg.svdvals(a)  # (..., p), decreasing
    tail = s[..., rank:]  # (..., p - r)
    if norm == "fro":
        return tail.square().sum(dim=-1).sqrt()
    if tail.shape[-1] == 0:
        return torch.zeros_like(s[..., 0])
    return tail[..., 0]


def spectral_energy(singular_values: torch.Tensor) -> torch.Tensor:
    """Cumulative share of ``||A||_F^2`` captured by the top singular values.

    ``out[..., r-1] = sum_{i <= r} s_i^2 / sum_i s_i^2``, so ``1 - out[..., r-1]`` is the
    squared relative Frobenius error of the best rank-``r`` approximation. A zero
    matrix gives zeros. Shape ``(..., p)`` -> ``(..., p)``; cost ``O(p)``.
    """
    s = check_tensor(singular_values, "singular_values", min_dim=1)
    energy = s.square().cumsum(dim=-1)  # (..., p)
    total = energy[..., -1:]  # (..., 1)
    return torch.where(total > 0, energy / total.clamp_min(torch.finfo(s.dtype).tiny), 0.0)
