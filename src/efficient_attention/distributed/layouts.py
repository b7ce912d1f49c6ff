r"""How a sequence is split across ranks: the contiguous and the zigzag layouts.

Context parallelism gives each of ``p`` ranks a shard of ``n / p`` tokens of every
sequence (and the same shard of queries, keys and values).

- **contiguous**: rank ``r`` holds tokens ``r n/p .. (r + 1) n/p - 1``. Under a causal
  mask rank ``r`` needs the keys of ranks ``0 .. r`` only, so the last rank does ``p``
  times the work of the first.
- **zigzag**: the sequence is cut into ``2p`` chunks of ``c = n / (2p)`` tokens and rank
  ``r`` holds chunks ``r`` and ``2p - 1 - r``, concatenated in that order (one early, one
  late chunk). Under a causal mask every rank then does the same work (see
  :func:`~efficient_attention.distributed.ring_attention`). The load-balanced layout of
  Zhu's ring-flash-attention (``zigzag_ring_flash_attn``) and of Llama 3's context
  parallelism (Dubey et al. 2024, section 3.3.2).

Within a shard the tokens stay in sequence order in both layouts, so a causal mask on a
shard's own positions is the global one restricted to them.

References: S. Zhu, ring-flash-attention (github.com/zhuzilin/ring-flash-attention),
2024; A. Dubey et al., "The Llama 3 herd of models", 2024.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import (
    check_dim,
    check_layout,
    check_positive_int,
    check_rank,
    check_sequence_split,
    check_tensor,
)

__all__ = ["shard_sequence", "unshard_sequence", "shard_positions"]


def chunks_per_rank(layout: str) -> int:
    """Chunks of the sequence a rank holds: 1 (contiguous) or 2 (zigzag)."""
    return 2 if layout == "zigzag" else 1


def rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` holds, in shard order: ``(rank,)`` or
    ``(rank, 2p - 1 - rank)``."""
    if layout == "zigzag":
        return rank, 2 * world_size - 1 - rank
    return (rank,)


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """The shard of the whole sequence ``x`` that rank ``rank`` of ``world_size`` holds.

    Args:
        x: the whole sequence, e.g. ``(..., n, d)`` with the sequence at ``dim``.
        rank: the rank, ``0 <= rank < world_size``.
        world_size: the number of ranks ``p``.
        layout: ``"contiguous"`` (tokens ``r n/p ..``) or ``"zigzag"`` (chunks ``r`` and
            ``2p - 1 - r`` of ``2p``, concatenated), see the module docstring.
        dim: the sequence dimension.

    Returns:
        A new tensor ``(..., n / p, d)`` (never a view of ``x``); differentiable. ``n``
        must be divisible by ``p`` (contiguous) or ``2p`` (zigzag).

    Cost: one copy of ``n / p`` tokens.
    """
    x = check_tensor(x, "x", min_dim=1, floating=False)
    world_size = check_positive_int(world_size, "world_size")
    rank = check_rank(rank, world_size)
    layout = check_layout(layout)
    dim = check_dim(dim, x.dim())
    check_sequence_split(x.shape[dim], world_size, layout, "x")
    chunks = x.tensor_split(world_size * chunks_per_rank(layout), dim)
    return torch.cat([chunks[index] for index in rank_chunks(rank, world_size, layout)], dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """The whole sequence from the shards of ranks ``0 .. p - 1`` (``p = len(shards)``).

    The inverse of :func:`shard_sequence`:
    ``unshard_sequence([shard_sequence(x, r, p, layout) for r in range(p)], layout)``
    equals ``x``. Every shard must have one shape (and an even length at ``dim`` in the
    zigzag layout). Differentiable; cost: one copy of the ``n`` tokens.
    """
    layout = check_layout(layout)
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence) or not shards:
        raise TypeError(
            "shards must be a non-empty list or tuple of tensors (one per rank), got "
            f"{type(shards).__name__}"
        )
    shards = [check_tensor(shard, f"shards[{r}]", floating=False)
              for r, shard in enumerate(shards)]
    shape = tuple(shards[0].shape)
    for r, shard in enumerate(shards):
        if tuple(shard.shape) != shape:
            raise ValueError(
                f"shards must share one shape, got shards[0].shape={shape} and "
                f"shards[{r}].shape={tuple(shard.shape)}"
            )
    dim = check_dim(dim, len(shape))
    world_size, per_rank = len(shards), chunks_per_rank(layout)
    if shape[dim] % per_rank:
        raise ValueError(
            f"shards must have an even length at dim={dim} in the zigzag layout (two equal "
            f"chunks per rank), got {shape[dim]}"
        )
    chunks: list[torch.Tensor | None] = [None] * (world_size * per_rank)
    for rank, shard in enumerate(shards):
        pieces = shard.tensor_split(per_rank, dim)
        for piece, index in zip(pieces, rank_chunks(rank, world_size, layout), strict=True):
            chunks[index] = piece
    return torch.cat(chunks, dim)


def shard_positions(
    n: int, rank: int, world_size: int, layout: str = "contiguous",
    *, device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions ``(n / p,)`` (int64) of the tokens rank ``rank`` holds, e.g. for
    positional encodings of a shard: ``shard_sequence(arange(n), rank, world_size,
    layout, dim=0)``."""
    n = check_positive_int(n, "n")
    return shard_sequence(torch.arange(n, device=device), rank, world_size, layout, dim=0)
