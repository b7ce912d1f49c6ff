r"""The Nystrom method: a low-rank approximation built from a few landmark rows.

For a positive semi-definite kernel matrix ``K`` on points ``x_1..x_n`` and a set
``L`` of ``m`` landmark points,

.. math:: K \approx C W^{+} C^\top, \qquad C = K_{:, L}\ (n \times m),\quad W = K_{L, L}

costs ``O(n m)`` kernel evaluations instead of ``O(n^2)`` and is exact when ``K``
has rank at most ``m`` and the landmarks span it (in particular when every point
is a landmark).

Nystromformer (Xiong et al., 2021) applies the same idea to the (non-symmetric)
softmax attention matrix, with *segment means* of the queries and keys as
landmarks ``Q~, K~ (m, d)``:

.. math::
    \mathrm{softmax}(Q K^\top) V \approx
    \mathrm{softmax}(Q \tilde K^\top)\,
    \mathrm{softmax}(\tilde Q \tilde K^\top)^{+}\,
    \mathrm{softmax}(\tilde Q K^\top)\, V ,

evaluated right to left in ``O(n m d + m^3)`` time and ``O(n m)`` memory, with the
pseudo-inverse of the small ``m x m`` matrix computed by an iteration of
matrix products (:func:`iterative_pinv`) that suits GPUs.

References: C. Williams and M. Seeger, "Using the Nystrom method to speed up kernel
machines", NeurIPS 2001. Y. Xiong et al., "Nystromformer: a Nystrom-based
algorithm for approximating self-attention", AAAI 2021.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._checks import (
    broadcast_shapes,
    check_bool,
    check_generator,
    check_key_padding_mask,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_tensor,
    compute_dtype,
)
from ._padding import zero_padded_rows, zeros_like_result

__all__ = ["nystrom_gram", "iterative_pinv", "nystrom_attention", "NystromAttention"]


def nystrom_gram(
    x: torch.Tensor,
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_landmarks: int,
    *,
    generator: torch.Generator | None = None,
    return_indices: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Nystrom approximation ``C W^+ C^T`` of the Gram matrix ``kernel(x, x)``.

    Args:
        x: points ``(..., n, d)``.
        kernel: ``kernel(a, b) -> (..., n_a, n_b)``, e.g.
            ``lambda a, b: ea.gaussian_kernel(a, b, sigma=1.0)``.
        num_landmarks: ``m <= n`` landmarks, drawn uniformly at random without
            replacement (the same indices for every batch element) with ``generator``.
        generator: the random source (``None``: PyTorch's global one).
        return_indices: also return the sorted landmark indices ``(m,)``.

    Returns:
        ``(..., n, n)`` approximation (and the indices when ``return_indices``). With
        ``C = kernel(x, x_L)`` and ``W = kernel(x_L, x_L)``, ``W^+`` is
        ``torch.linalg.pinv``.

    Cost: ``O(n m)`` kernel evaluations plus ``O(m^3)`` for the pseudo-inverse; the
    ``n x n`` result itself takes ``O(n^2 m)`` time and ``O(n^2)`` memory (keep the
    factors when only products are needed).
    """
    x = check_tensor(x, "x", min_dim=2)
    if not callable(kernel):
        raise TypeError(f"kernel must be callable (a, b) -> matrix, got {type(kernel).__name__}")
    m = check_positive_int(num_landmarks, "num_landmarks")
    n = x.shape[-2]
    if m > n:
        raise ValueError(f"num_landmarks must be at most the number of points n={n}, got {m}")
    generator = check_generator(generator)
    device = generator.device if generator is not None else torch.device("cpu")
    indices = torch.randperm(n, generator=generator, device=device)[:m].sort().values
    indices = indices.to(x.device)
    landmarks = x.index_select(-2, indices)  # (..., m, d)
    c = kernel(x, landmarks)  # (..., n, m)
    w = kernel(landmarks, landmarks)  # (..., m, m)
    approx = c @ torch.linalg.pinv(w) @ c.transpose(-2, -1)  # (..., n, n)
    return (approx, indices) if return_indices else approx


def iterative_pinv(a: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    r"""Moore--Penrose pseudo-inverse of ``a (..., m, m)`` by the Nystromformer iteration.

    .. math::
        Z_0 = \frac{A^\top}{\|A\|_1 \|A\|_\infty}, \qquad
        Z_{j+1} = \tfrac14 Z_j \big(13 I - A Z_j (15 I - A Z_j (7 I - A Z_j))\big).

    Since ``||A||_2^2 <= ||A||_1 ||A||_inf``, every singular value of ``A Z_0`` lies in
    ``(0, 1]``, and the iteration drives them all to 1: a singular value ``1 - r`` of
    ``A Z_j`` becomes ``1 - r^3 (3 + r) / 4`` (third-order convergence), so ``Z_j``
    converges to ``A^{-1}`` for any nonsingular ``A``. Small singular values of ``A``
    start with ``r`` close to 1 and need more steps: the iteration is fastest when ``A``
    is well conditioned. For a singular ``A`` the iterates stay in the row space of
    ``A`` and approach ``A^+`` in exact arithmetic, but rounding errors in the null
    space are multiplied by ``13/4`` at every step: stop after a few iterations.
    The norms are taken per matrix.

    Returns ``(..., m, m)`` in the dtype of ``a`` (half inputs are computed in float32);
    ``m = 0`` gives the empty matrix. Cost: ``4 * iterations`` matrix products, time
    ``O(iterations * m^3)``, memory ``O(m^2)``; only products, so it runs well on GPUs.

    Reference: Xiong et al., AAAI 2021, following Razavi et al., "A new iterative method
    for finding approximate inverses of complex matrices", 2014.
    """
    a = check_tensor(a, "a", min_dim=2)
    iterations = check_nonnegative_int(iterations, "iterations")
    m = a.shape[-1]
    if a.shape[-2] != m:
        raise ValueError(f"a must be square (..., m, m), got shape {tuple(a.shape)}")
    if m == 0:
        return a.transpose(-2, -1).clone()
    dtype = a.dtype
    a = a.to(compute_dtype(a))
    abs_a = a.abs()
    norm_1 = abs_a.sum(dim=-2).amax(dim=-1)  # (...): largest column sum
    norm_inf = abs_a.sum(dim=-1).amax(dim=-1)  # (...): largest row sum
    scale = (norm_1 * norm_inf).clamp_min(torch.finfo(a.dtype).tiny)
    z = a.transpose(-2, -1) / scale[..., None, None]  # (..., m, m)
    eye = torch.eye(m, dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z.to(dtype)


def _segment_matrix(
    keep: torch.Tensor, num_landmarks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Averaging matrix for segment means over the kept positions.

    ``keep (..., n)`` bool. The kept positions, in order, are cut into ``m`` segments of
    nearly equal size (position of rank ``r`` among ``L`` kept goes to segment
    ``floor(r m / L)``). Returns ``means (..., m, n)`` with rows that average each
    segment (zero rows for empty segments, which happen when ``L < m``) and
    ``valid (..., m)``, ``True`` where a segment is not empty.
    """
    m = num_landmarks
    kept = keep.to(torch.long)
    count = kept.sum(dim=-1, keepdim=True)  # (..., 1): L
    rank = kept.cumsum(dim=-1) - 1  # (..., n): rank among kept positions
    segment = (rank.clamp_min(0) * m) // count.clamp_min(1)  # (..., n) in [0, m)
    member = torch.nn.functional.one_hot(segment, m).transpose(-2, -1).to(dtype)  # (..., m, n)
    member = member * keep.unsqueeze(-2).to(dtype)  # padded positions belong to no segment
    sizes = member.sum(dim=-1, keepdim=True)  # (..., m, 1)
    return member / sizes.clamp_min(1), sizes.squeeze(-1) > 0


def _segment_means(x: torch.Tensor, m: int) -> torch.Tensor:
    """Means of ``m <= n`` consecutive segments of ``x (..., n, d)``: position ``i`` goes to
    segment ``floor(i m / n)`` (sizes ``floor(n/m)`` or ``ceil(n/m)``). Time ``O(n d)``."""
    n = x.shape[-2]
    if n % m == 0:
        return x.unflatten(-2, (m, n // m)).mean(dim=-2)
    segment = torch.arange(n, device=x.device) * m // n  # (n,)
    sizes = torch.bincount(segment, minlength=m).to(x.dtype)  # (m,)
    sums = x.new_zeros(*x.shape[:-2], m, x.shape[-1]).index_add(-2, segment, x)
    return sums / sizes.unsqueeze(-1)


def _compact(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Undo broadcasting: size 1 again along every dimension that was expanded.

    Keeps a ``(batch, 1, n)`` mask from turning into ``(batch, heads, m, n)`` segment
    matrices; the products below broadcast it over the heads.
    """
    if mask is None:
        return None
    for dim in range(mask.dim() - 1):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _masked_softmax(scores: torch.Tensor, masked: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis with ``masked`` entries excluded; all-masked rows give 0."""
    if masked is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(masked, float("-inf"))
    empty = masked.all(dim=-1, keepdim=True)  # (..., rows, 1)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    return weights.masked_fill(empty, 0.0)


def nystrom_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_landmarks: int,
    *,
    pinv_iterations: int | None = 6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Nystromformer attention, an approximation of ``softmax(q k^T / sqrt(d)) v``.

    ``q`` and ``k`` are scaled by ``d^{-1/4}`` (so every score by ``d^{-1/2}``); the
    landmarks ``Q~, K~ (..., m, d)`` are means of ``m`` consecutive segments of nearly
    equal size (any ``n``: sizes ``floor(n/m)`` or ``ceil(n/m)``), and

    .. math::
        \mathrm{out} = \mathrm{softmax}(Q \tilde K^\top)\,
        \mathrm{pinv}(\mathrm{softmax}(\tilde Q \tilde K^\top))\,
        \mathrm{softmax}(\tilde Q K^\top)\, V .

    When ``m >= n`` each landmark is a single key (and query), the middle matrix is the
    full attention matrix ``A`` and the result is ``A A^+ A V = A V``: exact softmax
    attention once the pseudo-inverse has converged.

    Args:
        q: queries ``(..., n_q, d)``; k: keys ``(..., n_k, d)``; v: values ``(..., n_k, d_v)``.
        num_landmarks: ``m``, the rank of the approximation.
        pinv_iterations: iterations of :func:`iterative_pinv`; ``None`` uses the exact
            ``torch.linalg.pinv`` instead.
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` at padding.
            Padded keys are left out of the key landmarks (means over kept keys only,
            segments cut among the kept keys) and get zero weight in the last factor.
            When ``n_q == n_k`` (self-attention, the setting of the paper) the same
            positions are also left out of the query landmarks, so that a padded
            sequence gives, at its kept positions, the output of the unpadded one.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q`` (half inputs are computed in float32).
        A query whose keys are all padding gets zeros, as does every query when
        ``n_k = 0``. Padded keys and values (and, when ``n_q == n_k``, the queries at
        padded positions, for the landmarks) are replaced by zeros first, so NaN or inf
        padding cannot leak through the landmark means.

    Cost: time ``O(n m (d + d_v) + iterations * m^3)``, memory ``O(n m)``.
    No causal variant: the landmarks mix past and future positions.

    Reference: Xiong et al., "Nystromformer", AAAI 2021.
    """
    q, k, v = check_qkv(q, k, v)
    m = check_positive_int(num_landmarks, "num_landmarks")
    if pinv_iterations is not None:
        check_nonnegative_int(pinv_iterations, "pinv_iterations")
    mask = _compact(check_key_padding_mask(key_padding_mask, k.shape, k.device))
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        batch = broadcast_shapes(batch, mask.shape[:-1])
    if n_q == 0 or n_k == 0 or 0 in batch:  # no query, or no key to attend to: zeros
        return zeros_like_result((*batch, n_q, v.shape[-1]), q, k, v)
    dtype = compute_dtype(q)
    out_dtype = q.dtype
    q, k, v = q.to(dtype), zero_padded_rows(k, mask).to(dtype), zero_padded_rows(v, mask).to(dtype)

    if mask is None and m <= min(n_q, n_k):
        # Fast path: no padding and no empty segment, every landmark valid.
        q_land = _segment_means(q, m)  # (..., m, d)
        k_land = _segment_means(k, m)  # (..., m, d)
        key_masked = None
        land_masked = None
        query_valid = None
    else:
        key_keep = torch.ones(n_k, dtype=torch.bool, device=k.device) if mask is None else ~mask
        k_means, k_valid = _segment_matrix(key_keep, m, k.dtype)  # (..., m, n_k), (..., m)
        query_keep = key_keep if (mask is not None and n_q == n_k) else None
        if query_keep is None:
            query_keep = torch.ones(n_q, dtype=torch.bool, device=q.device)
        q_means, query_valid = _segment_matrix(query_keep, m, q.dtype)  # (..., m, n_q), (..., m)
        k_land = k_means @ k  # (..., m, d)
        # Queries at padded positions have weight 0 in the means; zeros keep NaN out.
        q_for_landmarks = zero_padded_rows(q, mask) if mask is not None and n_q == n_k else q
        q_land = q_means @ q_for_landmarks  # (..., m, d)
        land_masked = ~k_valid.unsqueeze(-2)  # (..., 1, m): empty key landmarks
        key_masked = None if mask is None else mask.unsqueeze(-2)  # (..., 1, n_k)

    # Scaling q and k by d^-1/4 scales every score by d^-1/2; the landmarks are means, so
    # the factor can go on the small (m, d) landmark matrices instead of on q and k.
    q_land = q_land * d**-0.5  # (..., m, d)
    k_land_scaled = k_land * d**-0.5  # (..., m, d)
    # (..., n_q, m): every query against the key landmarks
    kernel_1 = _masked_softmax(q @ k_land_scaled.transpose(-2, -1), land_masked)
    # (..., m, m): landmarks against landmarks
    kernel_2 = _masked_softmax(q_land @ k_land.transpose(-2, -1), land_masked)
    # (..., m, n_k): query landmarks against every key
    kernel_3 = _masked_softmax(q_land @ k.transpose(-2, -1), key_masked)
    if query_valid is not None:
        row_valid = query_valid.unsqueeze(-1).to(kernel_2.dtype)  # (..., m, 1)
        kernel_2 = kernel_2 * row_valid  # empty query landmarks: zero rows
        kernel_3 = kernel_3 * row_valid
    if pinv_iterations is None:
        inverse = torch.linalg.pinv(kernel_2)  # (..., m, m)
    else:
        inverse = iterative_pinv(kernel_2, pinv_iterations)  # (..., m, m)
    return (kernel_1 @ (inverse @ (kernel_3 @ v))).to(out_dtype)  # (..., n_q, d_v)


class NystromAttention(nn.Module):
    """Module form of :func:`nystrom_attention` for ``MultiHeadAttention(attention=...)``.

    ``forward(q, k, v, *, causal=False, key_padding_mask=None)``, the signature of the
    other attention modules; ``causal=True`` raises ``ValueError`` since the
    segment-mean landmarks mix past and future positions.
    """

    def __init__(self, num_landmarks: int, pinv_iterations: int | None = 6) -> None:
        super().__init__()
        self.num_landmarks = check_positive_int(num_landmarks, "num_landmarks")
        if pinv_iterations is not None:
            check_nonnegative_int(pinv_iterations, "pinv_iterations")
        self.pinv_iterations = pinv_iterations

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if check_bool(causal, "causal"):
            raise ValueError(
                "causal=True is not supported by NystromAttention: its segment-mean "
                "landmarks mix past and future positions; use softmax, linear, performer "
                "or fmm attention for a causal model"
            )
        return nystrom_attention(
            q,
            k,
            v,
            self.num_landmarks,
            pinv_iterations=self.pinv_iterations,
            key_padding_mask=key_padding_mask,
        )

    def extra_repr(self) -> str:
        return f"num_landmarks={self.num_landmarks}, pinv_iterations={self.pinv_iterations}"
