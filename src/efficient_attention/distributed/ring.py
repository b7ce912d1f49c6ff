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

After ``p`` steps every query has seen every key: the result is exact, and no rank ever
holds more than two blocks (the current one and the one arriving). The send of the
current block to rank ``r + 1`` (and the receive of the next from ``r - 1``) is posted
*before* the rank computes on it, so that communication overlaps computation.

Backward (FlashAttention-2's formulas, with the final ``lse`` and
``D_i = \sum_c dO_{ic} O_{ic}``): the blocks travel round again; for each one the rank
adds ``dQ`` locally and its contributions to that block's ``dK, dV`` to an accumulator
that travels with the block, one more hop at the end to come home.

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
    """``out, lse`` (views of the running result) <- their merge with a block's partial
    result (``merge_softmax_partials``' formula), in place: no output-sized temporary
    (``block_out`` is overwritten). A side with ``lse = -inf`` gets weight 0."""
    merged = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    add = torch.exp(block_lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(keep).add_(block_out.mul_(add))
    lse.copy_(merged)


def _ring_forward(q, k, v, causal, layout, ring):
    """``q (B, m_q, d)`` (scaled, compute dtype), ``k (B, m_k, d)``, ``v (B, m_k, d_v)`` ->
    ``out (B, m_q, d_v)`` and ``lse (B, m_q)``. The rank's own keys and values are sent
    as they are (two messages a step, no concatenated copy); at any time the rank holds
    the block it computes on and the one arriving, besides its own inputs and output."""
    dtype, n_q, n_k = q.dtype, q.shape[1], k.shape[1]
    out = lse = None
    current = [k, v]
    for step in range(ring.size):
        # Pass the current block on before computing on it: the transfer overlaps.
        last = step == ring.size - 1
        pending = None if last else ring.start_exchange(current, "forward")
        task = block_task(ring.rank, ring.source(step), causal=causal, layout=layout,
                          n_q=n_q, n_k=n_k)
        if task is not None:
            rows, keys, diagonal = task
            block_keys, block_values = (x[:, keys].to(dtype) for x in current)
            block_out, block_lse = tile_forward(q[:, rows], block_keys, block_values, None,
                                                diagonal, *DEFAULT_BLOCK_SIZE)
            if out is None:  # step 0: the rank's own block, every query
                out, lse = block_out, block_lse
            else:
                _merge_in_place(out[:, rows], lse[:, rows], block_out, block_lse)
            del block_out, block_lse, block_keys, block_values
        if pending is not None:
            current = pending.wait()
    return out, lse


def _ring_backward(q, kv, out, lse, grad_out, key_dim, causal, layout, ring):
    """Gradients ``dq (B, m_q, d)`` and ``d[k, v] (B, m_k, d + d_v)`` (compute dtype)."""
    dtype, n_q, n_k = q.dtype, q.shape[1], kv.shape[1]
    grad_out = grad_out.to(dtype)
    delta = (grad_out * out).sum(dim=-1)  # D_i = rowsum(dO_i * O_i), (B, m_q)
    grad_q = torch.zeros_like(q)
    current, finished = kv, None  # finished: dK, dV of the block held at the last step
    for step in range(ring.size):
        # Post: this block on to the next rank, and the accumulator of the previous
        # block (complete up to this rank); receive the next block and its accumulator.
        sends = ([] if step == ring.size - 1 else [current]) + ([] if step == 0 else [finished])
        pending = ring.start_exchange(sends, "backward") if sends else None
        grad_block = kv.new_zeros(kv.shape, dtype=dtype)  # this rank's share, (B, m_k, d + d_v)
        task = block_task(ring.rank, ring.source(step), causal=causal, layout=layout,
                          n_q=n_q, n_k=n_k)
        if task is not None:
            rows, keys, diagonal = task
            block = current[:, keys].to(dtype)
            grads = tile_backward(q[:, rows], block[..., :key_dim], block[..., key_dim:], None,
                                  diagonal, *DEFAULT_BLOCK_SIZE, lse[:, rows],
                                  grad_out[:, rows], delta[:, rows])
            grad_q[:, rows] += grads[0]
            grad_block[:, keys, :key_dim] += grads[1]
            grad_block[:, keys, key_dim:] += grads[2]
            del grads
        if pending is not None:
            received = pending.wait()
            if step < ring.size - 1:
                current = received.pop(0)
            if step > 0:
                grad_block += received.pop(0)  # the shares of the ranks before this one
        finished = grad_block
    if ring.size > 1:  # the last accumulator goes home: rank r holds block r + 1's
        (finished,) = ring.start_exchange([finished], "backward").wait()
    return grad_q, finished


class _RingAttention(torch.autograd.Function):
    """Forward saves this rank's ``q``, ``k``, ``v``, output and ``lse``, nothing of other
    ranks: their blocks travel round again in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, ring):
        out, lse = _ring_forward(q, k, v, causal, layout, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.ring, ctx.key_dim = causal, layout, ring, k.shape[-1]
        return out

    @staticmethod
    @once_differentiable  # a second derivative raises instead of being silently wrong
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        kv = torch.cat([k, v], dim=-1)  # (B, m_k, d + d_v): one message per step
        del k, v
        grad_q, grad_kv = _ring_backward(q, kv, out, lse, grad_out, ctx.key_dim, ctx.causal,
                                         ctx.layout, ctx.ring)
        grad_kv = grad_kv.to(kv.dtype)
        return grad_q, grad_kv[..., :ctx.key_dim], grad_kv[..., ctx.key_dim:], None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    log: CommunicationLog | None = None,
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

    Returns:
        This rank's shard of the output ``(..., n_q / p, d_v)``, in the dtype of ``q``;
        differentiable in ``q, k, v`` (a backward pass is again collective: every rank
        must run it). float16 and bfloat16 are computed in float32 and sent as they are.

    Every rank must pass the same shapes, dtype, ``causal`` and ``layout``.

    Cost per rank, ``m = n / p``, ``B`` batch elements: time ``O(B m n (d + d_v))``
    forward (``p`` blocks; causal: ``r + 1/2`` blocks on rank ``r`` contiguous,
    ``p / 2`` blocks every rank zigzag) and about 2.5 times that backward; memory
    ``O(B m (d + d_v))`` plus one tile of scores, never ``n``-sized: in the forward, besides
    its inputs, a rank holds its scaled queries, its output, one block's partial output
    (merged into the output in place) and two blocks of keys and values, the one it
    computes on and the one arriving (about ``7 B m d`` numbers for ``d_v = d``). Communication
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
    out = _RingAttention.apply(q_flat.to(dtype) * d**-0.5, k_flat, v_flat, causal, layout,
                               Ring(group, log))
    return out.reshape(*batch, n_q, d_v).to(q.dtype)
