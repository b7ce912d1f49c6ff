r"""Communication for context parallelism, and the count of the bytes each rank sends.

Two patterns move data between the ``p`` ranks of a process group:

- the **ring** (:class:`Ring`): every rank sends to rank ``r + 1`` and receives from rank
  ``r - 1`` (mod ``p``) with point-to-point ``isend``/``irecv``, posted together with
  ``torch.distributed.batch_isend_irecv`` and waited on later, so that a transfer runs
  while the rank computes;
- the **all-to-all** (:func:`all_to_all_blocks`): a tensor ``(p, ...)`` whose block ``j``
  goes to rank ``j``; block ``j`` of the result came from rank ``j``.

A :class:`CommunicationLog` passed as ``log=`` to
:func:`~efficient_attention.distributed.ring_attention` or
:func:`~efficient_attention.distributed.ulysses_attention` adds up what this rank sends;
:func:`ring_communication_bytes` and :func:`ulysses_communication_bytes` give the same
numbers in closed form. The same code runs with the ``gloo`` backend (CPU tensors) and
``nccl`` (CUDA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import HALF_DTYPES, check_nonnegative_int, check_positive_int

__all__ = ["CommunicationLog", "ring_communication_bytes", "ulysses_communication_bytes"]

PHASES = ("forward", "backward")


@dataclass
class CommunicationLog:
    """Bytes (and messages) this rank sends, by phase; pass one as ``log=``.

    Counts the payload of each point-to-point send and, for an all-to-all, the blocks
    that go to other ranks (the block a rank keeps is a local copy, not sent). Adds up
    over every call it is passed to, backward passes included.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_messages: int = 0
    backward_messages: int = 0

    def record(self, phase: str, nbytes: int, messages: int = 1) -> None:
        """Add ``nbytes`` sent in ``messages`` message(s) during ``phase``."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        setattr(self, f"{phase}_bytes", getattr(self, f"{phase}_bytes") + nbytes)
        setattr(self, f"{phase}_messages", getattr(self, f"{phase}_messages") + messages)

    @property
    def total_bytes(self) -> int:
        """Forward plus backward bytes."""
        return self.forward_bytes + self.backward_bytes


def _sizes(batch, d, d_v, world_size, dtype):
    for value, name in ((batch, "batch"), (d, "d"), (d_v, "d_v")):
        check_nonnegative_int(value, name)
    check_positive_int(world_size, "world_size")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    element = dtype.itemsize
    return element, (torch.float32.itemsize if dtype in HALF_DTYPES else element)


def ring_communication_bytes(
    *, batch: int, keys_per_rank: int, d: int, d_v: int, world_size: int, dtype: torch.dtype
) -> tuple[int, int]:
    r"""Bytes each rank sends in :func:`ring_attention`: ``(forward, backward)``.

    With ``p = world_size``, ``m = keys_per_rank`` (``n / p``), ``B = batch`` (the product
    of the batch dimensions, heads included), ``s`` the element size of ``dtype`` and
    ``s_acc`` that of its compute dtype (4 for float16 and bfloat16, else ``s``):

    .. math::
        \text{forward} = (p - 1)\, B\, m\, (d + d_v)\, s, \qquad
        \text{backward} = (p - 1)\, B\, m\, (d + d_v)\, s + p\, B\, m\, (d + d_v)\, s_{acc}.

    Forward: the key and value block travels ``p - 1`` hops (``2 (p - 1) (n/p) d B s``
    for ``d_v = d``). Backward: the blocks travel round again (they are not kept), and
    so do their gradient accumulators ``dK, dV``, one more hop, to come home; ``dQ``
    stays on its rank. Nothing is sent when ``p = 1``. Every layout and mask sends the
    same: under a causal mask a rank still passes on the blocks it skips.
    """
    element, accumulator = _sizes(batch, d, d_v, world_size, dtype)
    check_nonnegative_int(keys_per_rank, "keys_per_rank")
    block = batch * keys_per_rank * (d + d_v)
    if world_size == 1:
        return 0, 0
    forward = (world_size - 1) * block * element
    return forward, forward + world_size * block * accumulator


def ulysses_communication_bytes(
    *, batch: int, queries_per_rank: int, keys_per_rank: int, d: int, d_v: int,
    world_size: int, dtype: torch.dtype,
) -> tuple[int, int]:
    r"""Bytes each rank sends in :func:`ulysses_attention`: ``(forward, backward)``.

    With ``p = world_size``, ``B = batch`` (the product of the batch dimensions, heads
    included), ``m_q, m_k`` the queries and keys per rank and ``s`` the element size of
    ``dtype``: each all-to-all keeps ``1/p`` of its tensor and sends the rest, so

    .. math::
        \text{forward} = \text{backward}
        = \frac{p - 1}{p}\, B\, \big(m_q (d + d_v) + m_k (d + d_v)\big)\, s:

    forward ``q`` (``m_q d``), ``k, v`` (``m_k (d + d_v)``) to head shards and the output
    (``m_q d_v``) back; backward the output's gradient one way and the gradients of
    ``q, k, v`` the other. For ``m_q = m_k = n/p`` and ``d_v = d``: ``4 (p-1)/p (n/p) d B s``
    each way, a factor ``p`` less than the ring's as ``p`` grows.
    """
    element, _ = _sizes(batch, d, d_v, world_size, dtype)
    check_nonnegative_int(queries_per_rank, "queries_per_rank")
    check_nonnegative_int(keys_per_rank, "keys_per_rank")
    total = batch * (queries_per_rank + keys_per_rank) * (d + d_v) * element
    sent = total * (world_size - 1) // world_size
    return sent, sent


class _PendingExchange:
    """Posted transfers of a ring step: :meth:`wait` returns the received tensors."""

    def __init__(self, received: list[torch.Tensor], works: list) -> None:
        self.received, self.works = received, works

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


class Ring:
    """The ranks of ``group`` in a ring: rank ``r`` sends to ``r + 1``, receives from ``r - 1``.

    ``log`` (a :class:`CommunicationLog` or None) records each send.
    """

    def __init__(self, group, log: CommunicationLog | None) -> None:
        self.group, self.log = group, log
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The rank whose block this rank holds after ``step`` hops: ``r - step`` mod ``p``."""
        return (self.rank - step) % self.size

    def start_exchange(self, tensors: list[torch.Tensor], phase: str) -> _PendingExchange:
        """Post the send of each tensor to the next rank and the receive of one of the same
        shape from the previous rank (tags 0, 1, ..., in order); returns without waiting."""
        operations, received = [], []
        for tag, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            incoming = torch.empty_like(tensor)
            operations.append(dist.P2POp(dist.isend, tensor, self.next_peer, self.group, tag))
            operations.append(dist.P2POp(dist.irecv, incoming, self.previous_peer, self.group,
                                         tag))
            received.append(incoming)
            if self.log is not None:
                self.log.record(phase, tensor.numel() * tensor.element_size())
        return _PendingExchange(received, dist.batch_isend_irecv(operations))


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dimension 0. Its own adjoint (block ``j`` of the result is
    rank ``j``'s block for this rank), so the backward is the same exchange of the
    gradient."""

    @staticmethod
    def forward(ctx, blocks, group, log):
        ctx.group, ctx.log = group, log
        return _exchange_blocks(blocks, group, log, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchange_blocks(grad, ctx.group, ctx.log, "backward"), None, None


def _exchange_blocks(blocks: torch.Tensor, group, log: CommunicationLog | None,
                     phase: str) -> torch.Tensor:
    blocks = blocks.contiguous()
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    if log is not None:
        world_size = blocks.shape[0]
        log.record(phase, blocks.numel() * blocks.element_size() * (world_size - 1) // world_size,
                   messages=world_size - 1)
    return received


def all_to_all_blocks(blocks: torch.Tensor, group, log: CommunicationLog | None) -> torch.Tensor:
    """``(p, ...)`` -> ``(p, ...)``: block ``j`` goes to rank ``j``, block ``j`` of the result
    came from rank ``j``. Differentiable; the identity (no communication) for ``p = 1``."""
    if blocks.shape[0] == 1:
        return blocks
    return _AllToAll.apply(blocks, group, log)
