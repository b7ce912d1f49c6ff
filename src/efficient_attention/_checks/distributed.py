"""Context parallelism: sequence layouts, ranks, shards, process groups, head shards."""

from __future__ import annotations

from collections.abc import Sequence

from .values import check_nonnegative_int

__all__ = [
    "SEQUENCE_LAYOUTS",
    "check_layout",
    "check_rank",
    "check_sequence_split",
    "check_shard_length",
    "check_process_group",
    "check_head_shards",
]


SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is one of :data:`SEQUENCE_LAYOUTS`."""
    if not isinstance(layout, str):
        raise TypeError(
            f"layout must be a str, one of {SEQUENCE_LAYOUTS}, got {type(layout).__name__} "
            f"{layout!r}"
        )
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}")
    return layout


def check_rank(rank: object, world_size: int) -> int:
    """Return ``rank`` if it is an ``int`` in ``[0, world_size)``."""
    rank = check_nonnegative_int(rank, "rank")
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    return rank


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_sequence_split(n: int, world_size: int, layout: str, name: str) -> None:
    """A sequence of ``n`` tokens splits into ``world_size`` equal shards: ``n`` divisible by
    ``world_size`` (contiguous) or by ``2 world_size`` (zigzag: two chunks per rank)."""
    parts = world_size * _chunks_per_rank(layout)
    if n % parts:
        raise ValueError(
            f"{name} must have a sequence length divisible by {parts} ({layout} layout over "
            f"world_size={world_size}: {_chunks_per_rank(layout)} equal chunk(s) per rank), "
            f"got n={n}"
        )


def check_shard_length(n_shard: int, layout: str, name: str) -> None:
    """A rank's shard holds at least one token; in the zigzag layout an even number (its
    two chunks, ``i`` and ``2p - 1 - i``, have one length)."""
    if n_shard < 1:
        raise ValueError(
            f"{name} must hold at least one token of the sequence (dimension -2), got "
            f"{name}.shape[-2]={n_shard}"
        )
    if layout == "zigzag" and n_shard % 2:
        raise ValueError(
            f"{name} must hold an even number of tokens in the zigzag layout (two equal "
            f"chunks per rank), got {name}.shape[-2]={n_shard}"
        )


def check_process_group(group: object) -> object:
    """Return the process group to use: ``group``, or the default group for ``None``.

    ``RuntimeError`` when ``torch.distributed`` is unavailable or not initialised (call
    ``torch.distributed.init_process_group`` first, on every rank) or when this process is
    not a member of ``group``; ``TypeError`` when ``group`` is not a process group.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("context parallelism needs torch.distributed, which this build of "
                           "PyTorch does not provide")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on CUDA) on every rank before any distributed "
            "attention, or pass tensors to a single-device function instead"
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # from new_group
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of group: "
            "torch.distributed.new_group returned NON_GROUP_MEMBER on this rank"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), "
            f"got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of group"
        )
    return group


def check_head_shards(batch: Sequence[int], world_size: int) -> int:
    """Heads for head parallelism: the last of the batch dimensions ``batch`` of q, k and v
    (broadcast; shapes ``(..., h, n, d)``), divisible by ``world_size``. Returns ``h``."""
    if len(batch) < 1:
        raise ValueError(
            "q, k and v must have a heads dimension, shape (..., h, n, d), got no dimension "
            "before the sequence"
        )
    heads = batch[-1]
    if heads < 1 or heads % world_size:
        raise ValueError(
            f"the number of heads h (dimension -3 of q, k and v) must be divisible by the "
            f"world size to split heads across ranks, got h={heads} and "
            f"world_size={world_size}"
        )
    return heads
