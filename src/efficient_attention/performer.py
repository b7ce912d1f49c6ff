"""Performer attention: FAVOR+ (Fast Attention Via positive Orthogonal Random features).

Softmax attention ``softmax(q k^T / sqrt(d)) v`` weighs key ``j`` by
``exp(q~_i^T k~_j)`` with ``q~ = d^-1/4 q`` and ``k~ = d^-1/4 k``. Random features give
``exp(q~^T k~) ~ phi(q~)^T phi(k~)``, and then attention is linear in ``n``:

    out = D^-1 phi(Q~) (phi(K~)^T V),   D = diag(phi(Q~) phi(K~)^T 1).

Stabilisation. The features contain exponentials that overflow or underflow for
large inputs, so :func:`favor_attention` multiplies every query feature row by its own
constant and every key feature by one common constant (per batch element and head). A
row constant of ``phi(q_i)`` multiplies both the numerator and the denominator of
output ``i``; a common key constant multiplies every term of both sums. Both cancel, so
the output is exactly that of the unstabilised estimator. (A per-key constant would
not cancel: it would reweigh the keys.) Concretely, for the positive map

    phi(q~_i)_l -> exp(w_l^T q~_i - max_l' w_l'^T q~_i)              (row constant),
    phi(k~_j)_l -> exp(w_l^T k~_j - |k~_j|^2 / 2 - top)    (one constant per head),

where ``top`` is the largest ``w_l^T k~_j - |k~_j|^2 / 2`` over the non-padded keys.
Keys are processed in blocks; ``top`` is the running maximum, and the running sums
are rescaled by ``exp(top_old - top_new)`` when it grows (as in online softmax), so
the final result uses the global maximum. Padded keys get an all-zero feature row.

Reference: Choromanski et al., "Rethinking Attention with Performers", ICLR 2021.
"""

from __future__ import annotations

import torch
from torch import nn

from ._blockwise import (
    _blockwise_attention,
    _check_causal_and_block,
    _flatten_batch,
    default_block_size,
)
from ._checks import (
    check_generator,
    check_key_padding_mask,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_tensor,
)
from .random_features import gaussian_random_matrix

__all__ = ["favor_attention", "FavorAttention"]

FEATURE_KINDS = ("positive", "trig", "hyperbolic")
_HALF = (torch.float16, torch.bfloat16)
_TOP_FLOOR = -1e30  # stands for "no key yet"; exp(_TOP_FLOOR - top) underflows to 0


def _check_features(features: object) -> str:
    if features not in FEATURE_KINDS:
        raise ValueError(f"features must be one of {FEATURE_KINDS}, got {features!r}")
    return features  # type: ignore[return-value]


def _check_w(w: object, d: int, device: torch.device) -> torch.Tensor:
    w = check_tensor(w, "w", min_dim=2)
    if w.dim() != 2 or w.shape[-1] != d:
        raise ValueError(f"w must have shape (m, d) with d={d} like q and k, got {tuple(w.shape)}")
    if w.device != device:
        raise ValueError(f"w must be on the device of q ({device}), got {w.device}")
    return w


def _query_features(q: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """Features of a block of queries ``(B, b, d)`` up to a positive constant per row.

    ``w`` is already multiplied by ``d^-1/4`` and in the compute dtype.
    """
    proj = q.to(w.dtype) @ w.transpose(-2, -1)  # (B, b, m)
    if kind == "trig":  # exp(|q|^2 / 2) / sqrt(m) is a row constant: dropped
        return torch.cat([proj.cos(), proj.sin()], dim=-1)
    if kind == "hyperbolic":
        proj = torch.cat([proj, -proj], dim=-1)  # (B, b, 2m)
    # exp(proj - |q|^2/2) / sqrt(m) up to a row constant: subtract the row maximum
    # (in place; no overflow, and the largest feature of every row is 1).
    return proj.sub_(proj.detach().amax(dim=-1, keepdim=True)).exp_()


def _key_features(
    k: torch.Tensor,
    mask: torch.Tensor | None,
    top: torch.Tensor | None,
    w: torch.Tensor,
    kind: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of a block of keys ``(B, b, d)`` as ``(phi, new_top)``, true = ``phi e^new_top``.

    ``new_top`` ``(B, 1, 1)`` is the running maximum ``top`` (None at the first block)
    raised to this block's largest log-feature over non-padded keys. It is detached:
    the output does not depend on it. Padded keys get a zero row.
    """
    k = k.to(w.dtype)
    norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True)  # (B, b, 1)
    half_sq_norm = (0.5 * scale**2) * norm.square()  # |d^-1/4 k|^2 / 2, (B, b, 1)
    proj = k @ w.transpose(-2, -1)  # (B, b, m)
    if kind == "hyperbolic":
        proj = torch.cat([proj, -proj], dim=-1)  # (B, b, 2m)
    if mask is not None:  # padded rows: no NaN or inf from whatever the padding holds
        padded = mask.unsqueeze(-1)  # (B, b, 1)
        half_sq_norm = half_sq_norm.masked_fill(padded, 0.0)
        proj = proj.masked_fill_(padded, 0.0 if kind == "trig" else float("-inf"))
    if kind == "trig":
        row_log_max = half_sq_norm  # log of exp(|k|^2 / 2), the size of the row
    else:
        row_log_max = proj.detach().amax(dim=-1, keepdim=True) - half_sq_norm  # (B, b, 1)
    if mask is not None:
        row_log_max = row_log_max.masked_fill(padded, float("-inf"))
    new_top = row_log_max.detach().amax(dim=-2, keepdim=True)  # (B, 1, 1)
    # Only padding so far gives -inf; a finite floor keeps exp(top - new_top) free of
    # NaN (padded keys are zeroed separately).
    new_top = new_top.clamp_min(_TOP_FLOOR) if top is None else torch.maximum(top, new_top)
    if kind == "trig":
        row_scale = torch.exp(half_sq_norm - new_top)  # (B, b, 1)
        if mask is not None:
            row_scale = row_scale.masked_fill(padded, 0.0)
        return row_scale * torch.cat([proj.cos(), proj.sin()], dim=-1), new_top
    # exp(proj - |k|^2/2 - top) in two in-place passes; padded rows are exp(-inf) = 0.
    return proj.sub_(half_sq_norm + new_top).exp_(), new_top  # (B, b, m')


def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    features: str = "positive",
    chunk_size: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    r"""Random-feature approximation of ``softmax(q k^T / sqrt(d)) v`` (Performer, FAVOR+).

    .. math:: \mathrm{out} = D^{-1} \phi(\tilde Q) (\phi(\tilde K)^\top V), \quad
              D = \mathrm{diag}(\phi(\tilde Q) \phi(\tilde K)^\top 1), \quad
              \tilde Q = d^{-1/4} Q, \ \tilde K = d^{-1/4} K,

    with ``phi`` one of the unbiased estimators of ``exp(x^T y)`` from
    :mod:`efficient_attention.random_features` built on the rows of ``w``. The
    features are stabilised internally by constants that cancel (see the module
    docstring), so the output equals the unstabilised formula but does not overflow.
    Padded keys are in neither the numerator nor the normaliser, nor in the maximum.

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``.
        w: random frequencies ``(m, d)`` with ``N(0, I)`` rows, e.g.
            ``gaussian_random_matrix(m, d, orthogonal=True)``.
        causal: query ``i`` sees keys ``j <= i`` (chunked prefix sums, ``n_q == n_k``).
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` = padding.
        features: ``"positive"`` (FAVOR+, ``m`` features), ``"hyperbolic"`` (positive,
            ``2m``) or ``"trig"`` (``2m``; can give negative or tiny normalisers).
        chunk_size: chunk length ``C`` of the causal prefix sums (default
            :func:`~efficient_attention._blockwise.default_chunk_size`).
        block_size: rows of features computed at a time (default
            :func:`~efficient_attention._blockwise.default_block_size`);
            changes speed and memory, not the result.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``; half inputs are computed in float32.

    Cost: time ``O(n m (d + d_v))`` (+ ``O(n C (m + d_v))`` causal). Memory without
    autograd: the output plus one block of features, ``O(n d_v + b m)``; with autograd
    the features ``O(n m)`` and, when causal, one ``m x d_v`` state per chunk.
    """
    q, k, v = check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    w = _check_w(w, q.shape[-1], q.device)
    kind = _check_features(features)
    _check_causal_and_block(causal, q.shape[-2], k.shape[-2], chunk_size, block_size)
    dtype = torch.promote_types(q.dtype, w.dtype)
    dtype = torch.float32 if dtype in _HALF else dtype
    scale = q.shape[-1] ** -0.25
    w = w.to(dtype) * scale  # (m, d): (d^-1/4 x) w^T = x (d^-1/4 w)^T, no copy of q or k
    batch, (q3, k3, v3, mask2) = _flatten_batch(q, k, v, mask)
    width = w.shape[0] * (1 if kind == "positive" else 2)
    size = block_size or default_block_size(q3.shape[0], width, max(q.shape[-2], 1))
    out = _blockwise_attention(
        q3,
        k3,
        v3.to(dtype),
        lambda x: _query_features(x, w, kind),
        lambda x, mask_b, top: _key_features(x, mask_b, top, w, kind, scale),
        causal=causal,
        mask=mask2,
        eps=0.0,
        block_size=size,
        chunk_size=chunk_size,
    )
    return out.reshape(*batch, q.shape[-2], v.shape[-1]).to(q.dtype)


class FavorAttention(nn.Module):
    """Performer attention with its random matrix held as a buffer and redrawn in training.

    Args:
        dim_head: ``d``, the size of each head's queries and keys.
        num_features: ``m``, the number of random frequencies.
        orthogonal: draw orthogonal blocks (lower variance, Performers' Theorem 2).
        redraw_interval: in training mode, draw a new ``w`` every ``redraw_interval``
            forward calls (calls ``0..r-1`` use the first draw, calls ``r..2r-1`` the
            second, ...); ``None`` or ``0`` never redraws. In eval mode ``w`` never
            changes, so evaluation is deterministic.
        features: ``"positive"``, ``"hyperbolic"`` or ``"trig"``, see
            :func:`favor_attention`.
        generator: a CPU ``torch.Generator`` for the draws; or
        seed: an int to seed a private generator (at most one of the two).

    ``forward(q, k, v, causal=False, key_padding_mask=None)`` on ``(..., n, dim_head)``
    tensors returns ``(..., n_q, d_v)``. It has the signature
    :class:`~efficient_attention.MultiHeadAttention` expects of an attention function.
    New draws are made on the generator's device and copied into the buffer ``w``,
    which moves with the module (``.to(device)``).
    """

    def __init__(
        self,
        dim_head: int,
        num_features: int,
        orthogonal: bool = True,
        redraw_interval: int | None = 1000,
        *,
        features: str = "positive",
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.dim_head = check_positive_int(dim_head, "dim_head")
        self.num_features = check_positive_int(num_features, "num_features")
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        if redraw_interval is not None:
            check_nonnegative_int(redraw_interval, "redraw_interval")
        self.redraw_interval = redraw_interval or 0
        self.features = _check_features(features)
        generator = check_generator(generator)
        if seed is not None:
            if generator is not None:
                raise ValueError("give at most one of generator and seed, got both")
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        self.calls_since_redraw = 0
        self.register_buffer("w", self._draw())

    def _draw(self) -> torch.Tensor:
        return gaussian_random_matrix(
            self.num_features, self.dim_head, orthogonal=self.orthogonal, generator=self.generator
        )

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a new random matrix into the buffer ``w`` (same device and dtype)."""
        self.w.copy_(self._draw().to(device=self.w.device, dtype=self.w.dtype))
        self.calls_since_redraw = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = check_tensor(q, "q", min_dim=2)
        if q.shape[-1] != self.dim_head:
            raise ValueError(
                f"q must have last dimension dim_head={self.dim_head}, got shape {tuple(q.shape)}"
            )
        if self.training and self.redraw_interval:
            if self.calls_since_redraw >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
        return favor_attention(
            q, k, v, self.w, causal=causal, key_padding_mask=key_padding_mask,
            features=self.features,
        )

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, num_features={self.num_features}, "
            f"orthogonal={self.orthogonal}, redraw_interval={self.redraw_interval}, "
            f"features={self.features!r}"
        )
