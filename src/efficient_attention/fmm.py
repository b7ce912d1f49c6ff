r"""FMMformer: banded near-field attention plus low-rank far-field attention.

The fast multipole method splits an interaction matrix into a *near field*,
computed exactly, and a *far field*, which is smooth and so well approximated
at low rank. FMMformer (Nguyen et al., 2021) does the same for attention:

.. math::
    \hat V = w_0\, \mathrm{band}_w(V)
           + \sum_{l=1}^{r} w_l\,
             \frac{\phi_l(Q) (\phi_l(K)^\top V)}{\phi_l(Q) (\phi_l(K)^\top 1)} ,

where ``band_w`` is softmax attention restricted to keys with ``|i - j| <= w``
(computed block by block in ``O(n w d)`` time, never forming the ``n x n``
matrix) and each far-field term is a linear attention with feature map
``phi_l`` (``O(n d^2)``). The blending weights ``w_0, w_l`` are positive.

Reference: T. Nguyen, V. Suliafu, S. Osher, L. Chen and B. Wang, "FMMformer:
efficient and flexible transformers via decomposed near-field and far-field
attention", NeurIPS 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    check_key_padding_mask,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    check_qkv,
)
from .linearized import elu_feature_map, linear_attention

__all__ = [
    "banded_attention",
    "fmm_attention",
    "elu_negative_feature_map",
    "FMMAttention",
]

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu_negative_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``elu(-x) + 1``: a positive feature map, the mirror image of ``elu(x) + 1``.

    Used with :func:`~efficient_attention.linear_attention.elu_feature_map` as a second
    far-field kernel in FMMformer. Any shape; cost ``O(size)``.
    """
    return F.elu(-x) + 1.0


def _to_rows(x: torch.Tensor, length: int, front: int = 0, back: int = 0) -> torch.Tensor:
    """``(S, n, e) -> (front + S * length + back, e)``: the sequences end to end, each
    padded with zeros to ``length`` rows, with ``front`` and ``back`` zero rows around
    them all. No copy when nothing needs padding."""
    num_seq, n, e = x.shape
    if length > n:
        x = torch.cat([x, x.new_zeros(num_seq, length - n, e)], dim=1)  # (S, length, e)
    rows = x.reshape(num_seq * length, e)
    if front or back:
        rows = torch.cat([rows.new_zeros(front, e), rows, rows.new_zeros(back, e)])
    return rows


def _neg_inf_where(condition: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``-inf`` where ``condition`` holds, else ``0`` (an additive mask)."""
    zeros = torch.zeros(condition.shape, dtype=dtype, device=condition.device)
    return zeros.masked_fill(condition, float("-inf"))


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bandwidth: int,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    r"""Softmax attention restricted to a band, ``|i - j| <= w`` (and ``j <= i`` if causal).

    .. math::
        \mathrm{out}_i = \sum_{|i-j| \le w} \frac{\exp(q_i^\top k_j / \sqrt d)}
        {\sum_{|i-l| \le w} \exp(q_i^\top k_l / \sqrt d)}\, v_j

    Queries are cut into blocks of ``B`` consecutive positions; block ``b`` can only
    see the ``W = B + 2w`` keys from ``bB - w`` to ``bB + B - 1 + w`` (``B + w`` when
    causal), so each block needs one ``B x W`` score matrix, masked to the band. The
    ``n x n`` matrix is never built, and the overlapping key windows are strided views
    of one zero-padded copy of the keys, not ``W / B`` copies.

    Args:
        q: queries ``(..., n, d)``; k: keys ``(..., n, d)``; v: values ``(..., n, d_v)``.
        bandwidth: ``w >= 0`` (``w = 0``: each query sees only its own key).
        causal: also mask keys ``j > i``.
        key_padding_mask: bool, broadcastable to ``(..., n)``, ``True`` at padding.
        block_size: ``B``; ``None`` means ``min(n, max(w // 2, 16))``. Smaller blocks
            waste less work on the masked corners (``B + 2w`` scores per query for
            ``2w + 1`` in the band), larger ones make bigger matrix products.

    Returns:
        ``(..., n, d_v)``. A query with no unmasked key in its band gets zeros.

    Cost: time ``O(n W (d + d_v))``, memory ``O(n W)`` - linear in ``n`` for a fixed band.
    """
    q, k, v = check_qkv(q, k, v)
    w = check_nonnegative_int(bandwidth, "bandwidth")
    n, d, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-2] != n:
        raise ValueError(
            "banded_attention needs as many queries as keys (a band of the square matrix), "
            f"got q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)}"
        )
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    if block_size is None:
        block_size = min(n, max(w // 2, 16))
    block = check_positive_int(block_size, "block_size")
    right = 0 if causal else w  # keys to the right of a query
    window = block + w + right  # W: keys seen by one block of queries
    num_blocks = math.ceil(n / block)  # per sequence
    length = num_blocks * block  # a sequence padded to whole blocks

    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        batch = torch.broadcast_shapes(batch, mask.shape[:-1])

    def flat(x: torch.Tensor) -> torch.Tensor:  # (..., n, e) -> (S, n, e)
        return x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])

    # All S sequences end to end, keys with w zero rows in front and w + right behind:
    # the window of block b of sequence s then starts at key row (s * num_blocks + b) * B,
    # so one strided view (unfold) holds every window. Windows at the ends of a sequence
    # reach into its neighbours or the padding; those keys are masked below.
    q_blocks = _to_rows(flat(q), length).view(-1, block, d)  # (S nb, B, d)
    k_windows = _to_rows(flat(k), length, w, right).unfold(0, window, block)  # (S nb, d, W)
    v_windows = _to_rows(flat(v), length, w, right).unfold(0, window, block)  # (S nb, d_v, W)
    num_seq = q_blocks.shape[0] // num_blocks

    # Band within a block: query row r sees window column c iff r <= c <= r + w + right.
    row = torch.arange(block, device=q.device).unsqueeze(-1)  # (B, 1)
    col = torch.arange(window, device=q.device)  # (W,)
    in_band = (col >= row) & (col <= row + w + right)  # (B, W)
    if mask is None:
        # scores = q k^T / sqrt(d), -inf outside the band, in one batched product.
        band_bias = _neg_inf_where(~in_band, q.dtype)  # (B, W)
        scores = torch.baddbmm(band_bias, q_blocks, k_windows, alpha=d**-0.5)  # (S nb, B, W)
        # Blocks at the ends of a sequence: keys outside [0, n) are masked for real
        # queries (a padded query, beyond n, keeps them, so that no row is empty).
        for b in range(num_blocks):
            first_key = b * block - w
            if first_key >= 0 and first_key + window <= n:
                continue
            key_position = first_key + col  # (W,)
            outside = (key_position < 0) | (key_position >= n)  # (W,)
            query_is_real = (b * block + row) < n  # (B, 1)
            edge = _neg_inf_where(outside & query_is_real, q.dtype)  # (B, W)
            scores[b::num_blocks].add_(edge)  # block b of every sequence
        weights = torch.softmax(scores, dim=-1)  # (S nb, B, W)
    else:
        scores = torch.bmm(q_blocks, k_windows).mul_(d**-0.5)  # (S nb, B, W)
        keep = flat((~mask).unsqueeze(-1).to(q.dtype))  # (S, n, 1)
        key_kept = _to_rows(keep, length, w, right).unfold(0, window, block) > 0  # (S nb, 1, W)
        block_start = torch.arange(num_blocks, device=q.device).repeat(num_seq) * block
        block_start = block_start.view(-1, 1, 1)  # (S nb, 1, 1)
        key_position = block_start - w + col  # (S nb, 1, W)
        inside = (key_position >= 0) & (key_position < n)
        query_is_padding = (block_start + row) >= n  # (S nb, B, 1)
        allowed = in_band & ((key_kept & inside) | query_is_padding)  # (S nb, B, W)
        scores = scores.masked_fill_(~allowed, float("-inf"))
        empty = ~allowed.any(dim=-1, keepdim=True)  # real queries with no key left
        weights = torch.softmax(scores.masked_fill_(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = torch.bmm(weights, v_windows.transpose(-2, -1))  # (S nb, B, d_v)
    out = out.view(num_seq, length, d_v)[:, :n]  # (S, n, d_v)
    return out.reshape(*batch, n, d_v)


def _as_weight(value: object, name: str, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(like.dtype) if value.dtype != like.dtype else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    return torch.tensor(float(value), dtype=like.dtype, device=like.device)


def fmm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bandwidth: int,
    feature_maps: Sequence[FeatureMap] | FeatureMap,
    near_weight: float | torch.Tensor,
    far_weight: Sequence[float] | torch.Tensor | float,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FMMformer attention: ``near_weight * banded + sum_l far_weight[l] * linear_l``.

    ``banded = banded_attention(q, k, v, bandwidth)`` is the near field and
    ``linear_l = linear_attention(q, k, v, feature_maps[l])`` the ``l``-th far-field
    term, all with the same ``causal`` and ``key_padding_mask``.

    Args:
        q, k, v: ``(..., n, d)``, ``(..., n, d)``, ``(..., n, d_v)``.
        bandwidth: near-field band ``w >= 0``.
        feature_maps: one feature map or a non-empty sequence of them.
        near_weight: scalar (number or 0-d tensor).
        far_weight: one weight per feature map (sequence or 1-D tensor; a scalar is
            accepted when there is one map).

    Returns ``(..., n, d_v)``. Cost: ``O(n w d)`` for the band plus ``O(n d d_v)`` per
    feature map (more if a map enlarges the features); memory ``O(n w + d d_v)``.
    """
    q, k, v = check_qkv(q, k, v)
    maps = [feature_maps] if callable(feature_maps) else feature_maps
    if not isinstance(maps, Sequence) or len(maps) == 0:
        raise TypeError(
            "feature_maps must be a callable or a non-empty sequence of callables, "
            f"got {type(feature_maps).__name__}"
        )
    for index, feature_map in enumerate(maps):
        if not callable(feature_map):
            raise TypeError(
                f"feature_maps[{index}] must be callable, got {type(feature_map).__name__}"
            )
    near = _as_weight(near_weight, "near_weight", q)
    if near.dim() != 0:
        raise ValueError(f"near_weight must be a scalar, got shape {tuple(near.shape)}")
    if isinstance(far_weight, torch.Tensor):
        far = far_weight.to(q.dtype).reshape(-1) if far_weight.dim() == 0 else far_weight
    elif isinstance(far_weight, Sequence):
        far = [_as_weight(value, f"far_weight[{i}]", q) for i, value in enumerate(far_weight)]
    else:
        far = [_as_weight(far_weight, "far_weight", q)]
    if len(far) != len(maps):
        raise ValueError(
            f"far_weight must have one weight per feature map ({len(maps)}), got {len(far)}"
        )
    near_field = banded_attention(
        q, k, v, bandwidth, causal=causal, key_padding_mask=key_padding_mask
    )
    out = near * near_field
    for weight, feature_map in zip(far, maps, strict=True):
        far_field = linear_attention(
            q, k, v, feature_map, causal=causal, key_padding_mask=key_padding_mask
        )
        out = out + weight * far_field
    return out


def _inverse_softplus(value: float) -> float:
    """``x`` with ``softplus(x) = value`` (``value > 0``)."""
    return value + math.log(-math.expm1(-value))


class FMMAttention(nn.Module):
    """FMMformer attention with learnable positive blending weights.

    ``near_weight = softplus(raw_near)`` and ``far_weight = softplus(raw_far)``: the raw
    parameters are free, the weights are positive by construction.

    Args:
        bandwidth: near-field band ``w``.
        feature_maps: far-field maps; ``None`` means ``[elu_feature_map,
            elu_negative_feature_map]``.
        init_near_weight, init_far_weight: initial (positive) weights; every far-field
            map starts at ``init_far_weight``.

    ``forward(q, k, v, causal=False, key_padding_mask=None)`` calls :func:`fmm_attention`.
    """

    def __init__(
        self,
        bandwidth: int,
        feature_maps: Sequence[FeatureMap] | None = None,
        *,
        init_near_weight: float = 0.5,
        init_far_weight: float = 0.5,
    ) -> None:
        super().__init__()
        self.bandwidth = check_nonnegative_int(bandwidth, "bandwidth")
        if feature_maps is None:
            feature_maps = [elu_feature_map, elu_negative_feature_map]
        if callable(feature_maps):
            feature_maps = [feature_maps]
        if len(feature_maps) == 0 or not all(callable(f) for f in feature_maps):
            raise TypeError("feature_maps must be a non-empty sequence of callables")
        self.feature_maps = list(feature_maps)
        near = _inverse_softplus(check_positive_float(init_near_weight, "init_near_weight"))
        far = _inverse_softplus(check_positive_float(init_far_weight, "init_far_weight"))
        self.raw_near_weight = nn.Parameter(torch.tensor(near))
        self.raw_far_weight = nn.Parameter(torch.full((len(self.feature_maps),), far))

    @property
    def near_weight(self) -> torch.Tensor:
        """Positive near-field weight ``softplus(raw_near_weight)`` (0-d)."""
        return F.softplus(self.raw_near_weight)

    @property
    def far_weight(self) -> torch.Tensor:
        """Positive far-field weights ``softplus(raw_far_weight)``, one per feature map."""
        return F.softplus(self.raw_far_weight)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fmm_attention(
            q,
            k,
            v,
            bandwidth=self.bandwidth,
            feature_maps=self.feature_maps,
            near_weight=self.near_weight.to(q.dtype),
            far_weight=self.far_weight.to(q.dtype),
            causal=causal,
            key_padding_mask=key_padding_mask,
        )

    def extra_repr(self) -> str:
        names = ", ".join(getattr(f, "__name__", type(f).__name__) for f in self.feature_maps)
        return f"bandwidth={self.bandwidth}, feature_maps=[{names}]"
