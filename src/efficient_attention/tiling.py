r"""Exact attention by online softmax over tiles, with recomputation in the backward pass.

Softmax attention ``softmax(q k^T / sqrt(d)) v`` needs, for each query, a maximum and a
sum over *all* keys before any weight is known. The online softmax (Milakov and
Gimelshein 2018) removes that barrier: keep, per query ``i``, a running maximum ``m_i``,
a running normaliser ``l_i = sum_j exp(s_ij - m_i)`` and a running numerator
``acc_i = sum_j exp(s_ij - m_i) v_j`` over the keys seen so far. When a new block of
scores ``s_iJ`` arrives,

.. math::
    m_i' = \max(m_i, \max_{j \in J} s_{ij}), \quad
    l_i' = e^{m_i - m_i'} l_i + \sum_{j \in J} e^{s_{ij} - m_i'}, \quad
    \mathrm{acc}_i' = e^{m_i - m_i'} \mathrm{acc}_i + \sum_{j \in J} e^{s_{ij} - m_i'} v_j,

and after the last block ``out_i = acc_i / l_i`` and ``lse_i = m_i + log l_i`` (the row
log-sum-exp). Computed over tiles of queries *and* keys, only one tile of scores
exists at a time (Rabe and Staats 2021; FlashAttention, Dao et al. 2022). The backward
pass recomputes each tile from ``q, k`` and ``lse``, ``P_ij = exp(s_ij - lse_i)``, and uses
``D_i = sum_c dO_ic O_ic`` so that ``dS = P * (dP - D)`` (the formulas of FlashAttention-2,
Dao 2023): nothing of size ``n_q x n_k`` is ever stored.

The backward loops like the forward: query tiles outside, key tiles inside. ``dQ_i`` is
summed while query tile ``i`` is current; ``dK_j``, ``dV_j`` are accumulated across query
tiles, added to once per tile. FlashAttention-2's backward takes key tiles outside, so
that ``dK_j``, ``dV_j`` stay in fast memory and only ``dQ`` is accumulated (atomically,
by parallel GPU thread blocks): one ``B_q x d`` accumulator moved per tile instead of two
``B_k x d`` ones. Both orders add the same products (same gradients up to rounding).

Two shortcuts make the tiles cheaper, and both keep the result exact to working
precision. (1) Base 2: ``e^s = 2^(s log2 e)``, so the queries are multiplied by
``log2(e) / sqrt(d)`` once and every exponential is an ``exp2`` (FlashAttention-2 folds
the same constant into its scale; whether ``exp2`` is faster than ``exp`` depends on the
machine's vector math library, and the flash chapter times the two). (2) One shift
per query: the running maximum only guards against overflow, and any shift ``m_i`` that
keeps ``2^(s_ij - m_i)`` in the float range gives the same quotient ``acc_i / l_i``. The
forward takes ``m_i`` from the first key tile of each query and keeps it: later tiles
need no maximum, no subtraction pass (the shift is subtracted inside the score product)
and no rescaling, two elementwise passes (exponential, sum) instead of four. ``l_i >= 1``,
since the first tile's maximum has weight ``2^0``; a weight that underflows is below
``2^-126`` (float32) of that one. If a later score exceeds ``m_i`` by so much that a sum
overflows, or a query sees no key in its first tile, that query tile is recomputed with
the running maximum (the FlashAttention-4 kernels for Blackwell GPUs, in the
``flash_attn/cute`` folder of the flash-attention repository, likewise keep the old
maximum and skip the rescaling until the maximum has grown past a threshold).

The same rescaling merges two attention results over disjoint sets of keys
(:func:`merge_softmax_partials`): it is how attention over a sequence split across
devices (ring attention, Liu et al. 2023) or a KV cache split into chunks
(Flash-Decoding, Dao et al. 2023) is combined.

References: M. Milakov and N. Gimelshein, "Online normalizer calculation for softmax",
2018; M. Rabe and C. Staats, "Self-attention does not need O(n^2) memory", 2021;
T. Dao et al., "FlashAttention: fast and memory-efficient exact attention with
IO-awareness", NeurIPS 2022; T. Dao, "FlashAttention-2: faster attention with better
parallelism and work partitioning", 2023; T. Dao, D. Haziza, F. Massa and G. Sizov,
"Flash-Decoding for long-context inference", PyTorch blog, 2023; H. Liu, M. Zaharia and
P. Abbeel, "Ring attention with blockwise transformers for near-infinite context", 2023.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ._blockwise import flatten_batch
from ._checks import (
    check_bool,
    check_causal_lengths,
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_tensor,
    compute_dtype,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "tiled_attention", "merge_softmax_partials"]

# (queries, keys) per tile, from the tile sweep of benchmarks/tiled_attention.py (forward,
# (1, 8, n, 64) float32, two CPU cores, n = 8192, idle machine; results/tiled_attention.md):
# 512 x 512 took 1.13 times SDPA's time, 512 x 256 1.17, 256 x 512 1.22, 1024 x 512 1.30,
# 128 queries per tile 1.46 to 1.89, 64 queries 2.05, and one key tile spanning all 8192
# keys 2.22 (its scores leave the cache). 512 x 512 keeps 8 x 512 x 512 floats, 8 MiB, of
# scores per tile; the backward uses the same tiles.
DEFAULT_BLOCK_SIZE = (512, 512)

_LOG2E = 1.0 / math.log(2.0)  # e^s = 2^(s log2 e)
_LN2 = math.log(2.0)


def _block_sizes(block_size: object) -> tuple[int, int]:
    """``None`` -> the default; an int -> square tiles; a pair -> (queries, keys)."""
    if block_size is None:
        return DEFAULT_BLOCK_SIZE
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(
                "block_size must be an int or a pair (queries, keys), "
                f"got a sequence of length {len(block_size)}"
            )
        return (check_positive_int(block_size[0], "block_size[0]"),
                check_positive_int(block_size[1], "block_size[1]"))
    size = check_positive_int(block_size, "block_size")
    return size, size


def _future_mask(q_start: int, q_stop: int, k_start: int, k_stop: int,
                 device: torch.device) -> torch.Tensor | None:
    """``(bq, bk)`` True where key ``j`` lies after query ``i``; None if the tile has none."""
    if k_stop - 1 <= q_start:  # every key of the tile is at or before every query
        return None
    rows = torch.arange(q_start, q_stop, device=device).unsqueeze(-1)
    cols = torch.arange(k_start, k_stop, device=device)
    return cols > rows


def _tile_scores(q_tile, k, mask, causal, q_start, q_stop, k_start, k_stop, shift=None):
    """One tile ``(B, bq, bk)`` of ``q_tile k^T - shift``, masked keys at -inf (masked_fill,
    not * 0). ``shift (B, bq, 1)`` is subtracted inside the product (``baddbmm``)."""
    keys = k[:, k_start:k_stop].transpose(-2, -1)
    scores = q_tile @ keys if shift is None else torch.baddbmm(shift, q_tile, keys, beta=-1)
    hidden = _future_mask(q_start, q_stop, k_start, k_stop, q_tile.device) if causal else None
    if mask is not None:
        padding = mask[:, None, k_start:k_stop]  # (B, 1, bk)
        hidden = padding if hidden is None else hidden | padding
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def _key_tiles(causal: bool, q_stop: int, n_k: int, block_k: int) -> list[tuple[int, int]]:
    """``(k_start, k_stop)`` of the key tiles a query tile needs: all keys, or (causal)
    those up to its last query, so that no tile holds a key after the last query."""
    keys = min(q_stop, n_k) if causal else n_k
    return [(start, min(start + block_k, keys)) for start in range(0, keys, block_k)]


def _accumulate(acc, weights, values):
    """``acc += weights @ values`` in place, as ``baddbmm(out=)``: one product, which
    PyTorch's FLOP counter sees (it does not count the in-place ``baddbmm_``)."""
    return torch.baddbmm(acc, weights, values, out=acc)


def _fixed_shift_tile(q_tile, k, v, mask, causal, q_start, q_stop, block_k):
    """One query tile with a single shift per query: base-2 output and ``lse``, or None.

    ``q_tile`` holds ``q log2(e) / sqrt(d)``, so scores are in base 2. Each query's shift
    ``m_i`` is the maximum of its scores in the first key tile; every later tile is
    ``2^(s_ij - m_i)`` with the shift subtracted inside the score product, and its sum and
    product with the values are added without rescaling. Exact: the sums are the online
    softmax's with ``m_i`` in place of the running maximum, ``l_i >= 1`` (the first tile's
    maximum has weight ``2^0``), and a weight that underflows is below ``2^-126`` of that
    one. Returns None when the shortcut does not apply: a query sees no key in the first
    tile (maximum -inf) or not a finite one, or a later score exceeds ``m_i`` so much that a
    sum leaves the float range; the caller then runs :func:`_running_max_tile`.
    """
    batch, rows = q_tile.shape[:2]
    total = q_tile.new_zeros(batch, rows)  # l
    acc = q_tile.new_zeros(batch, rows, v.shape[2])  # unnormalised output
    shift = None
    for k_start, k_stop in _key_tiles(causal, q_stop, k.shape[1], block_k):
        scores = _tile_scores(q_tile, k, mask, causal, q_start, q_stop, k_start, k_stop, shift)
        if shift is None:  # first key tile: the shift is its maximum
            shift = scores.amax(dim=-1, keepdim=True)  # (B, bq, 1)
            if not bool(torch.isfinite(shift).all()):
                return None
            scores.sub_(shift)
        weights = scores.exp2_()  # 2^(s - m), in place
        total.add_(weights.sum(dim=-1))
        _accumulate(acc, weights, v[:, k_start:k_stop])
        del scores, weights  # free the tile before the next one is made
    if shift is None or not bool(torch.isfinite(total).all() and torch.isfinite(acc).all()):
        return None
    return acc.div_(total.unsqueeze(-1)), shift.squeeze(-1) + torch.log2(total)


def _running_max_tile(q_tile, k, v, mask, causal, q_start, q_stop, block_k):
    """One query tile by the online softmax with a running maximum (base 2, never fails).

    Returns the output ``(B, bq, d_v)`` and the base-2 ``lse (B, bq)``; a query with no
    visible key gets zeros and ``-inf``.
    """
    batch, rows = q_tile.shape[:2]
    top = q_tile.new_full((batch, rows), float("-inf"))  # running maximum m
    total = q_tile.new_zeros(batch, rows)  # running normaliser l
    acc = q_tile.new_zeros(batch, rows, v.shape[2])  # running numerator
    for k_start, k_stop in _key_tiles(causal, q_stop, k.shape[1], block_k):
        scores = _tile_scores(q_tile, k, mask, causal, q_start, q_stop, k_start, k_stop)
        new_top = torch.maximum(top, scores.amax(dim=-1))
        # Rows that have seen only masked keys keep a maximum of -inf: shift by 0
        # there, so that 2^(-inf - 0) = 0 instead of 2^(-inf + inf) = NaN.
        shift = torch.where(new_top == float("-inf"), 0.0, new_top)
        weights = scores.sub_(shift.unsqueeze(-1)).exp2_()  # (B, bq, bk), in place
        rescale = torch.exp2(top - shift)  # 2^(m - m'); 0 while m = -inf
        total.mul_(rescale).add_(weights.sum(dim=-1))
        _accumulate(acc.mul_(rescale.unsqueeze(-1)), weights, v[:, k_start:k_stop])
        top = new_top
        del scores, weights  # free the tile before the next one is made
    seen = total > 0  # False: no visible key, the output stays 0 and lse -inf
    out = acc.div_(torch.where(seen, total, 1.0).unsqueeze(-1))
    return out, torch.where(seen, top + torch.log2(total), float("-inf"))


def _forward(q, k, v, mask, causal, block_q, block_k, q_offset=0):
    """Tiled online-softmax forward on ``(B, n, d)``: returns ``out (B, n_q, d_v)`` and
    ``lse (B, n_q)``. ``q`` is already multiplied by ``1/sqrt(d)``. Causal: query row ``i``
    stands at key position ``i + q_offset`` and sees keys ``j <= i + q_offset`` (ring
    attention passes a piece of a diagonal block with its offset)."""
    batch, n_q, _ = q.shape
    out = q.new_empty(batch, n_q, v.shape[2])
    lse = q.new_empty(batch, n_q)
    for q_start in range(0, n_q, block_q):
        q_stop = min(q_start + block_q, n_q)
        q_tile = q[:, q_start:q_stop] * _LOG2E  # base-2 scores: 2^(s log2 e) = e^s
        first, last = q_start + q_offset, q_stop + q_offset  # positions among the keys
        tile = _fixed_shift_tile(q_tile, k, v, mask, causal, first, last, block_k)
        if tile is None:
            tile = _running_max_tile(q_tile, k, v, mask, causal, first, last, block_k)
        out[:, q_start:q_stop] = tile[0]
        torch.mul(tile[1], _LN2, out=lse[:, q_start:q_stop])  # back to base e
    return out, lse


def _backward(q, k, v, mask, causal, block_q, block_k, lse, grad_out, delta, q_offset=0):
    """Backward by recomputation. ``delta = rowsum(dO * O) - dlse``.

    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ = dS K``,
    ``dK = dS^T Q`` (with the ``1/sqrt(d)`` folded into ``q``), one tile at a time;
    ``P = 2^(s log2 e - lse log2 e)`` with the shift subtracted inside the score product.
    FlashAttention-2's formulas, not its loop order: query tiles outside, key tiles inside;
    ``dQ`` of a query tile is summed over its key tiles, ``dK`` and ``dV`` are accumulated
    across the query tiles (FlashAttention-2 puts the key tiles outside; see the module
    docstring). ``q_offset``: the query rows' positions among the keys, as in
    :func:`_forward`.
    """
    n_q, n_k = q.shape[1], k.shape[1]
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # Rows without any visible key have lse = -inf and all their scores at -inf: any
    # finite shift gives P = 0 there.
    shift = torch.where(lse == float("-inf"), 0.0, lse).mul_(_LOG2E)
    for q_start in range(0, n_q, block_q):
        q_stop = min(q_start + block_q, n_q)
        q_tile, d_out = q[:, q_start:q_stop], grad_out[:, q_start:q_stop]
        q_base2 = q_tile * _LOG2E
        row_shift = shift[:, q_start:q_stop].unsqueeze(-1)
        row_delta = delta[:, q_start:q_stop].unsqueeze(-1)
        first, last = q_start + q_offset, q_stop + q_offset  # positions among the keys
        for k_start, k_stop in _key_tiles(causal, last, n_k, block_k):
            probs = _tile_scores(q_base2, k, mask, causal, first, last, k_start, k_stop,
                                 row_shift).exp2_()  # P, recomputed
            _accumulate(grad_v[:, k_start:k_stop], probs.transpose(-2, -1), d_out)
            grad_scores = d_out @ v[:, k_start:k_stop].transpose(-2, -1)  # dP
            grad_scores.sub_(row_delta).mul_(probs)  # dS
            _accumulate(grad_q[:, q_start:q_stop], grad_scores, k[:, k_start:k_stop])
            _accumulate(grad_k[:, k_start:k_stop], grad_scores.transpose(-2, -1), q_tile)
            del probs, grad_scores  # free both tiles before the next ones are made
    return grad_q, grad_k, grad_v


class _TiledAttention(torch.autograd.Function):
    """Forward saves ``q, k, v``, the output and ``lse`` (never the weights)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, block_q, block_k):
        out, lse = _forward(q, k, v, mask, causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.causal, ctx.blocks = mask, causal, (block_q, block_k)
        return out, lse

    @staticmethod
    @once_differentiable  # a second derivative raises instead of being silently wrong
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        delta = (grad_out * out).sum(dim=-1)  # D_i = rowsum(dO_i * O_i)
        if grad_lse is not None:  # d lse_i / d s_ij = P_ij: enters dS like -D
            delta = delta - torch.where(lse == float("-inf"), 0.0, grad_lse)
        grads = _backward(q, k, v, ctx.mask, ctx.causal, *ctx.blocks, lse, grad_out, delta)
        return (*grads, None, None, None, None)


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    block_size: int | tuple[int, int] | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Exact ``softmax(q k^T / sqrt(d)) v`` by online softmax over tiles (FlashAttention).

    .. math::
        \mathrm{out}_i = \sum_j \frac{e^{s_{ij}}}{\sum_l e^{s_{il}}} v_j, \quad
        s_{ij} = q_i^\top k_j / \sqrt{d}, \quad
        \mathrm{lse}_i = \log \sum_j e^{s_{ij}},

    the sums running over the keys that are neither padding nor (when causal) after
    ``i``. Queries are taken ``block_q`` at a time and keys ``block_k`` at a time; each
    ``block_q x block_k`` tile of scores updates a normaliser and a numerator per query
    (the online softmax, in base 2 and with one shift per query taken from the first key
    tile; a query tile whose sums would overflow is redone with the running maximum, see
    the module docstring). All leading
    dimensions (batch, heads) are processed together in each tile. Under autograd the
    forward keeps only ``q, k, v``, the output and ``lse``; the backward recomputes the
    tiles with FlashAttention-2's formulas, query tiles outside and key tiles inside,
    accumulating ``dK`` and ``dV`` across query tiles (FlashAttention-2 takes the key
    tiles outside; see the module docstring).

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``. Batch dimensions broadcast.
        causal: query ``i`` sees only keys ``j <= i`` (needs ``n_q == n_k``); tiles that
            lie entirely after the diagonal are skipped, not masked, and the keys of a
            query tile stop at its last query.
        key_padding_mask: bool, broadcastable to ``k.shape[:-1]`` ``(..., n_k)``, ``True``
            where the key is padding. Padded keys take no part in any sum, even if they
            hold NaN or infinity.
        block_size: ``None`` (default :data:`DEFAULT_BLOCK_SIZE`), an int (square tiles)
            or a pair ``(block_q, block_k)``. Any ``n`` works; the last tile may be short.
        return_lse: also return the row log-sum-exp ``lse (..., n_q)``, for
            :func:`merge_softmax_partials`; it is differentiable too.

    Returns:
        ``out (..., n_q, d_v)`` in the dtype of the inputs (and ``lse``). A query with no
        unmasked key outputs zeros and has ``lse = -inf`` (its gradients are zero, never
        NaN). float16 and bfloat16 inputs are computed in float32 and the output is cast
        back; ``lse`` stays in the compute dtype (float32 or float64).

    Cost: time ``O(n_q n_k (d + d_v))`` forward (two products and two elementwise
    passes per tile, three where masked) and about 2.5 times that backward (about half
    of each when causal; twice the forward for a query tile that falls back to the
    running maximum). Extra
    memory ``O(B n (d + d_v) + B block_q block_k)`` for ``B`` batch elements and
    ``n = max(n_q, n_k)``: the output, the ``lse``, a scaled copy of ``q`` (and of
    ``k, v`` when padded or in half precision) and one or two tiles of scores, never
    ``n_q x n_k``; a training step stores only ``q, k, v``, the output and ``lse``.

    References: Milakov and Gimelshein 2018 (online softmax); Rabe and Staats 2021;
    Dao et al. 2022 (FlashAttention); Dao 2023 (FlashAttention-2).
    """
    q, k, v = check_qkv(q, k, v)
    dtype = compute_dtype(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    check_bool(causal, "causal")
    check_bool(return_lse, "return_lse")
    block_q, block_k = _block_sizes(block_size)
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if causal:
        check_causal_lengths(n_q, n_k)
    # Batch dimensions broadcast and flattened; padded keys and values become 0 so that
    # NaN or inf there cannot reach a sum (P = 0 times a NaN value would still be NaN).
    batch, (q_flat, k_flat, v_flat, mask) = flatten_batch(q.to(dtype), k.to(dtype),
                                                          v.to(dtype), mask)
    out, lse = _TiledAttention.apply(q_flat * (1.0 / math.sqrt(d)), k_flat, v_flat, mask,
                                     causal, block_q, block_k)
    out = out.reshape(*batch, n_q, d_v).to(q.dtype)
    lse = lse.reshape(*batch, n_q)
    return (out, lse) if return_lse else out


def _check_partial(out: object, lse: object, name_out: str, name_lse: str) -> None:
    check_tensor(out, name_out, min_dim=1)
    check_tensor(lse, name_lse, min_dim=0)
    if tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(
            f"{name_lse} must have the shape of {name_out} without its last dimension, "
            f"{tuple(out.shape[:-1])}, got {tuple(lse.shape)}"
        )


def merge_softmax_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Combine attention over two disjoint sets of keys into attention over their union.

    If ``out_a = softmax(s_A) v_A`` with ``lse_a = log sum_{j in A} e^{s_j}`` (per query),
    and likewise for ``B``, then over ``A ∪ B``

    .. math::
        \mathrm{lse} = \log(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}), \quad
        \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\, \mathrm{out}_a
                     + e^{\mathrm{lse}_b - \mathrm{lse}}\, \mathrm{out}_b,

    exactly (the two weights are the shares of the normaliser). This is the step the
    online softmax repeats for every block of keys, and how attention over a sequence
    split across devices is combined: each device attends to its own keys and returns
    ``(out, lse)``; merging the partials in any order gives exact attention (the merge is
    associative and commutative). A side with ``lse = -inf`` (no key) gets weight 0,
    whatever its output holds; if both are ``-inf`` the result is ``(0, -inf)``.

    Args:
        out_a, out_b: partial outputs ``(..., n_q, d_v)``, same shape.
        lse_a, lse_b: their row log-sum-exps ``(..., n_q)``, e.g. from
            ``tiled_attention(..., return_lse=True)``.

    Returns:
        ``(out (..., n_q, d_v), lse (..., n_q))``. Differentiable.

    Cost: ``O(n_q d_v)`` time and memory.
    """
    _check_partial(out_a, lse_a, "out_a", "lse_a")
    _check_partial(out_b, lse_b, "out_b", "lse_b")
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} and "
            f"{tuple(out_b.shape)}"
        )
    # lse = top + log(e^{lse_a - top} + e^{lse_b - top}) with top = max(lse_a, lse_b);
    # a shift of 0 where both are -inf, so that no -inf - (-inf) = NaN appears (nor in
    # the gradients, hence the inner torch.where on the total).
    top = torch.maximum(lse_a, lse_b).detach()
    shift = torch.where(top == float("-inf"), 0.0, top)
    weight_a, weight_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = weight_a + weight_b
    some = total > 0
    total = torch.where(some, total, 1.0)
    lse = torch.where(some, shift + torch.log(total), float("-inf"))

    def share(out: torch.Tensor, part: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        empty = (part == float("-inf")).unsqueeze(-1)  # no key: weight 0, whatever out holds
        return torch.where(empty, 0.0, (weight / total).unsqueeze(-1) * out)

    return share(out_a, lse_a, weight_a) + share(out_b, lse_b, weight_b), lse
