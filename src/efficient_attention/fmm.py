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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    broadcast_shapes,
    check_bool,
    check_key_padding_mask,
    check_nonnegative_float,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
    check_qkv,
    check_tensor,
    compute_dtype,
)
from ._padding import zero_padded_rows, zeros_like_result
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

    Used with :func:`~efficient_attention.elu_feature_map` as a second
    far-field kernel in FMMformer. Any shape; cost ``O(size)``.
    """
    return F.elu(-x) + 1.0


class _Layout(NamedTuple):
    """Where band blocks sit: ``S`` sequences of ``n`` rows, each stored in ``P`` rows.

    Sequence ``s`` keeps its keys at rows ``s P + w .. s P + w + n - 1`` (zeros around
    them), so the key window of query block ``b`` -- positions ``b B - w`` to ``b B + B
    - 1 + right`` -- starts at row ``s P + b B``: every window is a strided view of one
    array, and no window reaches into the next sequence. ``P = blocks * B`` holds the
    ``ceil(n / B)`` real blocks and ``ceil((w + right) / B)`` more, whose outputs are
    dropped.
    """

    n: int
    bandwidth: int
    right: int
    block: int
    blocks: int  # P / B, per sequence

    @property
    def window(self) -> int:
        return self.block + self.bandwidth + self.right


def _layout(n: int, bandwidth: int, right: int, block: int) -> _Layout:
    blocks = math.ceil(n / block) + math.ceil((bandwidth + right) / block)
    return _Layout(n, bandwidth, right, block, blocks)


def _query_blocks(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``(S, n, e) -> (S * blocks, B, e)``: each sequence zero-padded to ``P`` rows."""
    rows = layout.blocks * layout.block
    x = F.pad(x, (0, 0, 0, rows - layout.n))  # (S, P, e)
    return x.reshape(x.shape[0] * layout.blocks, layout.block, x.shape[-1])


def _key_windows(x: torch.Tensor, layout: _Layout, fill: float | bool = 0) -> torch.Tensor:
    """``(S, n, e) -> (S * blocks, e, W)``: the key window of every query block (a view).

    Rows outside ``[0, n)`` hold ``fill``. One allocation: the keys are copied once into
    the padded layout (plus the ``W - B`` rows that the last windows reach past it).
    """
    num_seq, n, e = x.shape
    rows = layout.blocks * layout.block
    tail = layout.window - layout.block
    padded = x.new_full((num_seq * rows + tail, e), fill)
    start = layout.bandwidth
    padded[: num_seq * rows].view(num_seq, rows, e)[:, start : start + n] = x
    return padded.unfold(0, layout.window, layout.block)[: num_seq * layout.blocks]


def _band_disallowed(layout: _Layout, device: torch.device) -> torch.Tensor:
    """Bool ``(blocks, B, W)``: ``True`` where query row ``r`` of block ``b`` may NOT see
    window column ``c``.

    Allowed means in the band (``r <= c <= r + w + right``, that is ``-w <= j - i <=
    right``) and a real key (position ``b B - w + c`` in ``[0, n)``).
    """
    row = torch.arange(layout.block, device=device).unsqueeze(-1)  # (B, 1)
    col = torch.arange(layout.window, device=device)  # (W,)
    outside_band = (col < row) | (col > row + layout.bandwidth + layout.right)  # (B, W)
    start = torch.arange(layout.blocks, device=device).view(-1, 1, 1) * layout.block
    position = start - layout.bandwidth + col  # (blocks, 1, W)
    return outside_band | (position < 0) | (position >= layout.n)  # (blocks, B, W)


def _masked_softmax_(scores: torch.Tensor, disallowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the allowed entries of the fresh ``scores`` (overwritten); a row with
    none allowed gets zeros. ``disallowed`` broadcasts against ``scores``."""
    empty = disallowed.all(dim=-1, keepdim=True)
    scores.masked_fill_(disallowed, float("-inf")).masked_fill_(empty, 0.0)
    weights = torch.softmax(scores, dim=-1)
    # Softmax's backward needs its output: in place only when nothing will differentiate.
    if weights.requires_grad:
        return weights.masked_fill(empty, 0.0)
    return weights.masked_fill_(empty, 0.0)


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
            Padded keys and values take no part, even when they hold NaN or inf.
        block_size: ``B``; ``None`` means ``min(n, max(w // 2, 16))``. Smaller blocks
            waste less work on the masked corners (``B + 2w`` scores per query for
            ``2w + 1`` in the band), larger ones make bigger matrix products.

    Returns:
        ``(..., n, d_v)`` in the dtype of ``q`` (half inputs are computed in float32).
        A query with no unmasked key in its band gets zeros; ``n = 0`` gives an empty
        result. A NaN in ``q`` or in an unpadded key or value gives NaN outputs.

    Cost: time ``O(n W (d + d_v))``, memory ``O(n W)`` - linear in ``n`` for a fixed band.
    """
    q, k, v = check_qkv(q, k, v)
    w = check_nonnegative_int(bandwidth, "bandwidth")
    causal = check_bool(causal, "causal")
    n, d, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-2] != n:
        raise ValueError(
            "banded_attention needs as many queries as keys (a band of the square matrix), "
            f"got q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)}"
        )
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    block = min(n, max(w // 2, 16)) if block_size is None else block_size
    if block_size is not None or n > 0:
        block = check_positive_int(block, "block_size")
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        batch = broadcast_shapes(batch, mask.shape[:-1])
    if n == 0 or math.prod(batch) == 0:
        return zeros_like_result((*batch, n, d_v), q, k, v)
    dtype = compute_dtype(q)

    def flat(x: torch.Tensor) -> torch.Tensor:  # (..., n, e) -> (S, n, e)
        return x.expand(*batch, *x.shape[-2:]).reshape(math.prod(batch), *x.shape[-2:])

    layout = _layout(n, w, 0 if causal else w, block)
    num_seq = math.prod(batch)
    k, v = zero_padded_rows(k, mask).to(dtype), zero_padded_rows(v, mask).to(dtype)
    # Scale q before the product (scores at their final size); in place on the new blocks.
    q_blocks = _query_blocks(flat(q.to(dtype)), layout).mul_(d**-0.5)  # (S blocks, B, d)
    scores = torch.bmm(q_blocks, _key_windows(flat(k), layout))  # (S blocks, B, W)
    scores = scores.view(num_seq, layout.blocks, layout.block, layout.window)
    disallowed = _band_disallowed(layout, q.device)  # (blocks, B, W), for every sequence
    if mask is not None:
        padded = _key_windows(flat(mask.unsqueeze(-1)), layout, fill=True)  # (S blocks, 1, W)
        disallowed = disallowed | padded.view(num_seq, layout.blocks, 1, layout.window)
    weights = _masked_softmax_(scores, disallowed).flatten(0, 1)  # (S blocks, B, W)
    out = torch.bmm(weights, _key_windows(flat(v), layout).transpose(-2, -1))  # (S blocks, B, d_v)
    out = out.view(num_seq, layout.blocks * layout.block, d_v)[:, :n]  # (S, n, d_v)
    return out.reshape(*batch, n, d_v).to(q.dtype)


def _check_weight(value: object, name: str, like: torch.Tensor) -> torch.Tensor:
    """A non-negative weight (number or tensor) as a tensor of ``like``'s dtype and device."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, name, min_dim=0)
        weight = value.to(like.dtype)
        if bool((weight < 0).any()):
            raise ValueError(f"{name} must be >= 0 (a blending weight), got {value}")
        return weight
    number = check_nonnegative_float(value, name)
    return torch.tensor(number, dtype=like.dtype, device=like.device)


def _far_weights(far_weight: object, count: int, like: torch.Tensor) -> torch.Tensor:
    """``far_weight`` as a ``(count,)`` tensor: a number or 0-d tensor for one map, else a
    sequence or 1-D tensor with one weight per feature map."""
    if isinstance(far_weight, torch.Tensor):
        far = _check_weight(far_weight, "far_weight", like)
    elif isinstance(far_weight, Sequence) and not isinstance(far_weight, str):
        values = [_check_weight(x, f"far_weight[{i}]", like) for i, x in enumerate(far_weight)]
        far = torch.stack(values) if values else like.new_zeros(0)
    else:
        far = _check_weight(far_weight, "far_weight", like)
    if far.dim() == 0:
        far = far.reshape(1)
    if far.dim() != 1 or far.shape[0] != count:
        raise ValueError(
            f"far_weight must have one weight per feature map ({count}), got shape "
            f"{tuple(far.shape)}"
        )
    return far


def _feature_map_list(feature_maps: object) -> list[FeatureMap]:
    maps = [feature_maps] if callable(feature_maps) else feature_maps
    if not isinstance(maps, Sequence) or isinstance(maps, str) or len(maps) == 0:
        raise TypeError(
            "feature_maps must be a callable or a non-empty sequence of callables, "
            f"got {type(feature_maps).__name__}"
        )
    for index, feature_map in enumerate(maps):
        if not callable(feature_map):
            raise TypeError(
                f"feature_maps[{index}] must be callable, got {type(feature_map).__name__}"
            )
    return list(maps)


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
        near_weight: a number or 0-d tensor ``>= 0``.
        far_weight: one weight ``>= 0`` per feature map (a sequence or a 1-D tensor of
            length ``len(feature_maps)``; a number or 0-d tensor when there is one map).

    Returns ``(..., n, d_v)``. Cost: ``O(n w d)`` for the band plus ``O(n d d_v)`` per
    feature map (more if a map enlarges the features); memory ``O(n w + d d_v)``.
    """
    q, k, v = check_qkv(q, k, v)
    maps = _feature_map_list(feature_maps)
    near = _check_weight(near_weight, "near_weight", q)
    if near.dim() != 0:
        raise ValueError(f"near_weight must be a scalar, got shape {tuple(near.shape)}")
    far = _far_weights(far_weight, len(maps), q)
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


class _FunctionFeatureMap(nn.Module):
    """A plain function as a module, so that every feature map can sit in a ModuleList."""

    def __init__(self, function: FeatureMap) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)

    def extra_repr(self) -> str:
        return getattr(self.function, "__name__", type(self.function).__name__)


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
            elu_negative_feature_map]``. They are registered as submodules
            (``self.feature_maps`` is an ``nn.ModuleList``; plain functions are wrapped),
            so a learnable map (an ``nn.Module``) is trained, saved and moved with the
            module.
        init_near_weight, init_far_weight: initial (positive) weights; every far-field
            map starts at ``init_far_weight``.

    ``forward(q, k, v, *, causal=False, key_padding_mask=None)`` calls
    :func:`fmm_attention`.
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
        self.feature_maps = nn.ModuleList(
            f if isinstance(f, nn.Module) else _FunctionFeatureMap(f)
            for f in _feature_map_list(feature_maps)
        )
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
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fmm_attention(
            q,
            k,
            v,
            bandwidth=self.bandwidth,
            feature_maps=list(self.feature_maps),
            near_weight=self.near_weight.to(q.dtype),
            far_weight=self.far_weight.to(q.dtype),
            causal=causal,
            key_padding_mask=key_padding_mask,
        )

    def extra_repr(self) -> str:
        return f"bandwidth={self.bandwidth}"
