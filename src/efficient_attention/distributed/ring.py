r"""Ring attention: exact attention over a sequence split across ranks, keys passed round.

Each of the ``p`` ranks of a process group holds a shard of ``m = n / p`` queries, keys
and values. The key and value blocks travel round a ring: at step ``t = 0 .. p - 1``
rank ``r`` holds the block of rank ``s = r - t`` (mod ``p``), attends its queries to it
with the tiled online softmax (:mod:`~efficient_attention.tiling`), giving a partial
output and row log-sum-exp, and merges that into its running result with
:func:`~efficient_attention.tiling.merge_softmax_partials`:

.. math::
    \mathrm{lse} = \log(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}), \quad
    \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\, \mathrm{out}_a
                 + e^{\mathrm{lse}_b - \mathrm{lse}}\, \mathrm{out}_b .

After ``p`` steps every query has seen every key: the result is exact. The send of the
current block to rank ``r + 1`` (and the receive of the next from ``r - 1``) is posted
*before* the rank computes on it, so that communication overlaps computation.

The blocks travel in **pieces** of ``block_size`` tokens (512 by default): piece ``i`` of
every block goes round the whole ring before piece ``i + 1`` sets out, and each tile of
``block_size`` queries merges its result over the piece into the output in place. A rank
then holds, besides its own shard, scaled queries, output and ``lse``, two pieces (the
one it computes on and the one arriving) and one tile's partial output: a constant, not
a block, so that its memory is that of single-process tiled attention divided by ``p``,
plus a constant. The bytes sent are the same; the messages ``m / block_size`` times as
many (each block of ``m`` tokens splits into that many pieces).

Backward (FlashAttention-2's formulas, with the final ``lse`` and
``D_i = \sum_c dO_{ic} O_{ic}``): the pieces travel round again; for each one the rank
adds ``dQ`` locally and its contributions to that piece's ``dK, dV`` to an accumulator
that travels with the piece, one more hop at the end to come home.

Causal masks. **Contiguous** layout: rank ``r`` skips the blocks of ranks ``s > r`` (all
in its future), uses the causal mask on its own block and attends fully to ``s < r``:
rank ``r`` computes ``r + 1/2`` blocks' worth, so the last rank sets the pace.
**Zigzag** layout (rank ``r`` holds chunks ``r`` and ``2p - 1 - r`` of ``c = n / (2p)``
tokens): its own block is causal over the shard; for ``s < r`` every query sees the
first chunk of ``s`` only (``c`` keys); for ``s > r`` only the rank's second chunk sees
the block, all of it (``2c`` keys): every rank computes the same ``2c x 2c`` causal block
and ``p - 1`` blocks of ``2 c^2`` scores.

Reference: H. Liu, M. Zaharia and P. Abbeel, "Ring attention with blockwise
transformers for near-infinite context", 2023; zigzag layout from S. Zhu's
ring-flash-attention and Llama 3 (Dubey et al. 2024).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .._blockwise import flatten_batch
from .._checks import (
    check_bool,
    check_causal_lengths,
    check_layout,
    check_optional_instance,
    check_positive_int,
    check_process_group,
    check_qkv,
    check_shard_length,
    compute_dtype,
)
from ..tiling import DEFAULT_BLOCK_SIZE
from ..tiling import _backward as tile_backward
from ..tiling import _forward as tile_forward
from .comm import CommunicationLog, Ring

__all__ = ["ring_attention"]

ALL = slice(None)


def block_task(rank: int, source: int, *, causal: bool, layout: str, n_q: int,
               n_k: int) -> tuple[slice, slice, bool] | None:
    """What this rank computes with the block of rank ``source``: ``(query rows, key
    rows, causal)``, with ``causal`` True for the diagonal block; None when no query of
    this rank sees any key of that block."""
    if not causal:
        return ALL, ALL, False
    if source == rank:
        return ALL, ALL, True  # within a shard tokens are in sequence order
    if layout == "contiguous":
        return (ALL, ALL, False) if source < rank else None
    # zigzag: rank r holds chunks (r, 2p-1-r), the source (s, 2p-1-s).
    if source < rank:  # chunk s precedes both of ours; chunk 2p-1-s follows both
        return ALL, slice(0, n_k // 2), False
    return slice(n_q // 2, None), ALL, False  # only our late chunk sees s > r, all of it


def _merge_in_place(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> None:
    """``out, lse`` (views of the running result) <- their merge with a tile's partial
    result (``merge_softmax_partials``' formula), in place: no output-sized temporary
    (``block_out`` is overwritten). A side with ``lse = -inf`` gets weight 0."""
    merged = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    add = torch.exp(block_lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(keep).add_(block_out.mul_(add))
    lse.copy_(merged)


def _pieces(length: int, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the pieces of ``size`` keys (the last may be shorter)."""
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _piece_tiles(task, start: int, stop: int, n_q: int, n_k: int, tile: int) -> list:
    """The work on keys ``[start, stop)`` of a block: per tile of at most ``tile`` query
    rows, ``(query rows, the piece's key columns, causal, q_offset)``, where a causal
    tile's row ``u`` sees the piece's column ``t <= u + q_offset``; empty when no query
    of ``task`` (:func:`block_task`) sees a key of the piece."""
    rows, keys, diagonal = task
    row_start, row_stop, _ = rows.indices(n_q)
    key_start, key_stop, _ = keys.indices(n_k)
    key_start, key_stop = max(key_start, start), min(key_stop, stop)
    if key_start >= key_stop:
        return []
    if diagonal:  # query i sees key j <= i: the queries before the piece see none of it
        row_start = max(row_start, key_start)
    columns = slice(key_start - start, key_stop - start)
    return [(slice(first, min(first + tile, row_stop)), columns, diagonal, first - key_start)
            for first in range(row_start, row_stop, tile)]


def _step_tiles(ring, step, current, piece, n_q, n_k, causal, layout, dtype, block):
    """The tiles this rank computes at ``step`` on the piece ``current`` (keys, values) of
    keys ``piece = (start, stop)``: ``(query rows, key columns of the piece, keys, values,
    causal, q_offset)`` each, keys and values in the compute ``dtype``; none when no query
    of this rank sees that block (:func:`block_task`)."""
    task = block_task(ring.rank, ring.source(step), causal=causal, layout=layout, n_q=n_q,
                      n_k=n_k)
    if task is None:
        return
    piece_k, piece_v = (x.to(dtype) for x in current)
    for rows, columns, diagonal, offset in _piece_tiles(task, *piece, n_q, n_k, block):
        yield rows, columns, piece_k[:, columns], piece_v[:, columns], diagonal, offset


def _ring_forward(q, k, v, causal, layout, ring, block):
    """``q (B, m_q, d)`` (scaled, compute dtype), ``k (B, m_k, d)``, ``v (B, m_k, d_v)`` ->
    ``out (B, m_q, d_v)`` and ``lse (B, m_q)``.

    The keys and values travel in pieces of ``block`` tokens, piece by piece: piece ``i``
    of every rank's block goes round the whole ring before piece ``i + 1`` sets out, so a
    rank holds two pieces at a time (the one it computes on and the one arriving),
    whatever ``n``. Each tile of ``block`` queries attends to the piece and is merged
    into the output in place: besides its inputs, scaled queries, output and ``lse``, a
    rank holds a constant number of ``block``-sized buffers."""
    dtype, (batch, n_q, _), n_k = q.dtype, q.shape, k.shape[1]
    out = q.new_zeros(batch, n_q, v.shape[-1])
    lse = q.new_full((batch, n_q), float("-inf"))
    for start, stop in _pieces(n_k, block):
        current = [k[:, start:stop], v[:, start:stop]]
        for step in range(ring.size):
            # Pass the piece on before computing on it: the transfer overlaps.
            last = step == ring.size - 1
            pending = None if last else ring.start_exchange(current, "forward")
            for rows, _, keys, values, diagonal, offset in _step_tiles(
                    ring, step, current, (start, stop), n_q, n_k, causal, layout, dtype,
                    block):
                part_out, part_lse = tile_forward(q[:, rows], keys, values, None, diagonal,
                                                  block, block, offset)
                _merge_in_place(out[:, rows], lse[:, rows], part_out, part_lse)
            if pending is not None:
                current = pending.wait()
    return out, lse


def _ring_backward(q, k, v, out, lse, grad_out, causal, layout, ring, block):
    """Gradients ``dq (B, m_q, d)``, ``dk (B, m_k, d)``, ``dv (B, m_k, d_v)`` (compute
    dtype). The pieces go round again in the forward's order, each with the accumulator
    of its ``dK, dV`` (``(B, piece, d + d_v)``), which one more hop brings home."""
    dtype, (batch, n_q, _), n_k, key_dim = q.dtype, q.shape, k.shape[1], k.shape[-1]
    grad_out = grad_out.to(dtype)
    delta = (grad_out * out).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), (B, m_q)
    grad_q = torch.zeros_like(q)
    grad_k = torch.zeros(k.shape, dtype=dtype, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=dtype, device=v.device)

    def deliver(piece, accumulated):  # the complete dK, dV of one of this rank's pieces
        grad_k[:, piece[0]:piece[1]] = accumulated[..., :key_dim]
        grad_v[:, piece[0]:piece[1]] = accumulated[..., key_dim:]

    finished, previous = None, None  # the accumulator to pass on, and its piece
    for start, stop in _pieces(n_k, block):
        current = [k[:, start:stop], v[:, start:stop]]
        for step in range(ring.size):
            # Post: this piece on to the next rank, and the accumulator of the piece held
            # at the previous step (complete up to this rank; at step 0 the previous
            # piece's, complete, going home); receive their counterparts.
            last = step == ring.size - 1
            sends = ([] if last else current) + ([] if finished is None else [finished])
            pending = ring.start_exchange(sends, "backward") if sends else None
            grad_piece = q.new_zeros(batch, stop - start, key_dim + v.shape[-1])
            for rows, columns, keys, values, diagonal, offset in _step_tiles(
                    ring, step, current, (start, stop), n_q, n_k, causal, layout, dtype,
                    block):
                grads = tile_backward(q[:, rows], keys, values, None, diagonal, block, block,
                                      lse[:, rows], grad_out[:, rows], delta[:, rows], offset)
                grad_q[:, rows] += grads[0]
                grad_piece[:, columns, :key_dim] += grads[1]
                grad_piece[:, columns, key_dim:] += grads[2]
                del grads
            if pending is not None:
                received = pending.wait()
                if not last:
                    current = received[:2]
                if finished is not None and step == 0:
                    deliver(previous, received[-1])  # our previous piece, every rank's share
                elif finished is not None:
                    grad_piece += received[-1]  # the shares of the ranks before this one
            finished, previous = grad_piece, (start, stop)
            if ring.size == 1:  # no ring: this rank's share is the whole gradient
                deliver(previous, finished)
                finished = None
    if finished is not None:  # the last accumulator goes home
        (accumulated,) = ring.start_exchange([finished], "backward").wait()
        deliver(previous, accumulated)
    return grad_q, grad_k, grad_v


class _RingAttention(torch.autograd.Function):
    """Forward saves this rank's ``q``, ``k``, ``v``, output and ``lse``, nothing of other
    ranks: their pieces travel round again in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, ring, block):
        out, lse = _ring_forward(q, k, v, causal, layout, ring, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.ring, ctx.block = causal, layout, ring, block
        return out

    @staticmethod
    @once_differentiable  # a second derivative raises instead of being silently wrong
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ring_backward(q, k, v, out, lse, grad_out, ctx.causal,
                                                ctx.layout, ctx.ring, ctx.block)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    log: CommunicationLog | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    r"""This rank's shard of exact ``softmax(q k^T / sqrt(d)) v`` over a sequence split across
    the ranks of ``group`` (ring attention).

    Called on every rank of ``group`` at once, each with its shard of the sequence
    (:func:`~efficient_attention.distributed.shard_sequence`): with ``Q, K, V`` the
    whole sequences and ``S_r`` the positions rank ``r`` holds,

    .. math::
        \mathrm{out}[S_r] = \mathrm{softmax}\big(Q[S_r] K^\top / \sqrt{d} + M[S_r]\big) V,

    ``M`` the causal mask (or 0), computed without any rank holding ``K`` or ``V``: the
    key and value blocks travel round the ring (see the module docstring).

    Args:
        q: this rank's queries ``(..., n_q / p, d)``.
        k: this rank's keys ``(..., n_k / p, d)``.
        v: this rank's values ``(..., n_k / p, d_v)``. Batch dimensions broadcast.
        causal: query ``i`` sees only keys ``j <= i`` in global positions (needs
            ``n_q = n_k``).
        group: the process group (default: the default group); ``torch.distributed``
            must be initialised (``gloo`` for CPU tensors, ``nccl`` for CUDA).
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced causal work), how the shards
            were cut; see :mod:`~efficient_attention.distributed.layouts`.
        log: a :class:`~efficient_attention.distributed.CommunicationLog` to which the
            bytes this rank sends are added, forward and backward.
        block_size: the keys of a block sent in one message, and the queries computed
            on them at once (default ``ea.DEFAULT_BLOCK_SIZE[1]``, 512): the rank's
            memory beyond its shard is a constant number of pieces of this size.

    Returns:
        This rank's shard of the output ``(..., n_q / p, d_v)``, in the dtype of ``q``;
        differentiable in ``q, k, v`` (a backward pass is again collective: every rank
        must run it). float16 and bfloat16 are computed in float32 and sent as they are.

    Every rank must pass the same shapes, dtype, ``causal`` and ``layout``.

    Cost per rank, ``m = n / p``, ``B`` batch elements: time ``O(B m n (d + d_v))``
    forward (``p`` blocks; causal: ``r + 1/2`` blocks on rank ``r`` contiguous,
    ``p / 2`` blocks every rank zigzag) and about 2.5 times that backward; memory
    ``O(B m (d + d_v))``, never ``n``-sized: in the forward, besides its inputs, a rank
    holds its scaled queries, its output and ``lse`` (``2 B m d + B m`` numbers for
    ``d_v = d``, what single-process tiled attention holds divided by ``p``) and a constant:
    two pieces of keys and values (the one it computes on and the one arriving), one
    tile's partial output and one tile of scores, each of ``block_size`` tokens; the
    backward likewise, with two pieces' ``dK, dV`` accumulators. Communication
    (:func:`~efficient_attention.distributed.ring_communication_bytes`): forward
    ``(p - 1) B m (d + d_v) s`` bytes (``s`` the element size; ``2 (p - 1) (n/p) d B s``
    for ``d_v = d``), backward that again plus ``p B m (d + d_v) s_acc`` for the
    travelling ``dK, dV``; ``p = 1`` sends nothing.

    Reference: Liu, Zaharia and Abbeel 2023 (ring attention); zigzag: Zhu's
    ring-flash-attention, Dubey et al. 2024 (Llama 3).
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    layout = check_layout(layout)
    group = check_process_group(group)
    log = check_optional_instance(log, CommunicationLog, "log")
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    check_shard_length(n_q, layout, "q")
    check_shard_length(n_k, layout, "k")
    if causal:
        check_causal_lengths(n_q, n_k)
    dtype = compute_dtype(q, k, v)
    batch, (q_flat, k_flat, v_flat, _) = flatten_batch(q, k, v, None)  # (B, m, x)
    block = DEFAULT_BLOCK_SIZE[1] if block_size is None else check_positive_int(
        block_size, "block_size")
    out = _RingAttention.apply(q_flat.to(dtype) * d**-0.5, k_flat, v_flat, causal, layout,
                               Ring(group, log), block)
    return out.reshape(*batch, n_q, d_v).to(q.dtype)
