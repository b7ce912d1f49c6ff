"""Context parallelism: exact attention over a sequence split across ``torch.distributed`` ranks.

Each of ``p`` ranks holds a shard of ``n / p`` tokens (:mod:`.layouts`: contiguous or
zigzag) and calls the same function with its shard; the result is its shard of exact
softmax attention over the whole sequence, differentiable:

- :mod:`.ring`: :func:`ring_attention`, key and value blocks passed round a ring of
  point-to-point transfers, partial results merged by log-sum-exp (Liu et al. 2023);
- :mod:`.ulysses`: :func:`ulysses_attention`, all-to-all from sequence shards to head
  shards and back (Jacobs et al. 2023, DeepSpeed Ulysses);
- :mod:`.comm`: :class:`CommunicationLog`, the bytes a rank sends, and their formulas
  :func:`ring_communication_bytes`, :func:`ulysses_communication_bytes`;
- :mod:`.processes`: :func:`run_on_processes`, a function run on ``p`` local processes
  joined in a process group (examples, tests, the chapter on context parallelism).

Both run with the ``gloo`` backend on CPU tensors and ``nccl`` on CUDA tensors;
``torch.distributed.init_process_group`` must have been called on every rank. With one
rank they compute exact attention without communicating. Each equals
:func:`~efficient_attention.softmax_attention` on the whole sequence (tested in float64
on 2 and 4 processes).
"""

from .comm import CommunicationLog, ring_communication_bytes, ulysses_communication_bytes
from .layouts import shard_positions, shard_sequence, unshard_sequence
from .processes import run_on_processes
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "CommunicationLog",
    "ring_communication_bytes",
    "ulysses_communication_bytes",
    "run_on_processes",
]
