r"""Ulysses attention: trade the sequence split for a head split with two all-to-alls.

Each of the ``p`` ranks holds a shard of ``m = n / p`` tokens of every head,
``(..., h, m, d)``. Attention mixes tokens but never heads, so one all-to-all regroups
the data by heads: rank ``r`` sends heads ``j h/p .. (j + 1) h/p - 1`` of its shard to
rank ``j`` and receives its own group of heads from every rank,

.. math::
    (\ldots, h, n/p, d) \xrightarrow{\text{all-to-all}} (\ldots, h/p, n, d),

computes exact attention over the whole sequence for its ``h / p`` heads
(:func:`~efficient_attention.tiled_attention`), and a second all-to-all returns the
output to sequence shards ``(..., h, n/p, d_v)``. The backward runs the same exchanges
on the gradients, in reverse.

Each all-to-all moves ``(p - 1)/p`` of a shard, whatever ``p``: the communication per
rank shrinks as ``1/p`` with more ranks, unlike the ring's, but ``p`` can be at most the
number of heads (and must divide it).

Reference: S. A. Jacobs et al., "DeepSpeed Ulysses: system optimizations for enabling
training of extreme long sequence transformer models", 2023.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import (
    broadcast_shapes,
    check_bool,
    check_causal_lengths,
    check_head_shards,
    check_layout,
    check_optional_instance,
    check_process_group,
    check_qkv,
    check_shard_length,
)
from ..tiling import tiled_attention
from .comm import CommunicationLog, all_to_all_blocks
from .layouts import shard_sequence, unshard_sequence

__all__ = ["ulysses_attention"]


def _sequence_to_heads(x, world_size, layout, group, log):
    """``(..., h, m, e)`` sequence shard -> ``(..., h/p, n, e)`` head shard."""
    *lead, heads, length, width = x.shape
    blocks = x.reshape(*lead, world_size, heads // world_size, length, width)
    blocks = blocks.movedim(-4, 0)  # (p, ..., h/p, m, e): block j goes to rank j
    received = all_to_all_blocks(blocks, group, log)  # block j: rank j's tokens, our heads
    return unshard_sequence(list(received.unbind(0)), layout, dim=-2)


def _heads_to_sequence(y, world_size, layout, group, log):
    """``(..., h/p, n, e)`` head shard -> ``(..., h, m, e)`` sequence shard."""
    *lead, group_heads, _, width = y.shape
    blocks = torch.stack([shard_sequence(y, rank, world_size, layout, dim=-2)
                          for rank in range(world_size)])  # (p, ..., h/p, m, e): to rank j
    received = all_to_all_blocks(blocks, group, log)  # block j: our tokens, rank j's heads
    received = received.movedim(0, -4)  # (..., p, h/p, m, e)
    return received.reshape(*lead, world_size * group_heads, received.shape[-2], width)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    log: CommunicationLog | None = None,
) -> torch.Tensor:
    r"""This rank's shard of exact multi-head attention over a sequence split across ranks,
    by all-to-all to head shards (DeepSpeed Ulysses).

    Called on every rank of ``group`` at once, each with its shard of the sequence for
    all ``h`` heads: with ``Q, K, V`` the whole sequences and ``S_r`` the positions rank
    ``r`` holds, ``out[..., S_r, :] = softmax(Q K^T / sqrt(d) + M)[S_r] V`` per head, ``M``
    the causal mask (or 0). Rank ``r`` computes heads ``r h/p .. (r+1) h/p - 1`` over the
    whole sequence (see the module docstring).

    Args:
        q: this rank's queries ``(..., h, n_q / p, d)``.
        k: this rank's keys ``(..., h, n_k / p, d)``.
        v: this rank's values ``(..., h, n_k / p, d_v)``. Batch dimensions broadcast; the
            heads (dimension -3) must be divisible by ``p``.
        causal: query ``i`` sees only keys ``j <= i`` in global positions.
        group: the process group (default: the default group); ``torch.distributed``
            must be initialised.
        layout: ``"contiguous"`` or ``"zigzag"``, how the shards were cut (the head
            shards are put back in sequence order before attention).
        log: a :class:`~efficient_attention.distributed.CommunicationLog` to which the
            bytes this rank sends are added.

    Returns:
        ``(..., h, n_q / p, d_v)`` in the dtype of ``q``; differentiable (the backward is
        collective: every rank must run it). Every rank must pass the same shapes.

    Cost per rank: time ``O(B (h/p) n_q n_k (d + d_v))`` (the same as the ring's),
    memory ``O(B (h/p) n (d + d_v))`` (as much as a sequence shard of all heads) plus the
    local attention's tiles. Communication
    (:func:`~efficient_attention.distributed.ulysses_communication_bytes`):
    ``(p-1)/p B h (m_q + m_k)(d + d_v) s`` bytes forward and the same backward,
    ``m_q, m_k`` the shard lengths and ``B h`` the batch dimensions with the heads.

    Reference: Jacobs et al. 2023 (DeepSpeed Ulysses).
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    layout = check_layout(layout)
    group = check_process_group(group)
    log = check_optional_instance(log, CommunicationLog, "log")
    world_size = dist.get_world_size(group)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    check_head_shards(batch, world_size)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    check_shard_length(n_q, layout, "q")
    check_shard_length(n_k, layout, "k")
    if causal:
        check_causal_lengths(n_q, n_k)
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    kv = torch.cat([k, v], dim=-1)  # (..., h, m_k, d + d_v): one exchange for both
    q_heads = _sequence_to_heads(q, world_size, layout, group, log)  # (..., h/p, n_q, d)
    kv_heads = _sequence_to_heads(kv, world_size, layout, group, log)
    out_heads = tiled_attention(q_heads, kv_heads[..., :d], kv_heads[..., d:],
                                causal=causal)  # (..., h/p, n_q, d_v)
    return _heads_to_sequence(out_heads, world_size, layout, group, log)
