"""Paged KV cache: the keys and values of many sequences in one pool of fixed-size blocks.

A server decodes many sequences at once, of lengths it does not know in advance. A
:class:`~efficient_attention.kv_cache.KVCache` per sequence must reserve ``max_len``
positions, most of them never used. PagedAttention (Kwon et al. 2023, the vLLM server)
stores the cache like virtual memory: one preallocated **pool** of ``num_blocks`` blocks
of ``block_size`` positions, keys ``(num_blocks, kv_heads, block_size, d)`` and values
``(num_blocks, kv_heads, block_size, d_v)``, and per sequence a **block table**: logical
block ``i`` (positions ``i B .. i B + B - 1``, ``B = block_size``) lives in physical
block ``table[i]``. Blocks are taken from a free list when a sequence grows into a new
one and returned by :meth:`PagedKVCache.free`, so a finished sequence's memory serves
the next; blocks need not be contiguous, and no sequence reserves more than the one
partly filled block at its end.

Memory, with ``c = 2 h_kv d`` numbers per token (keys and values) and lengths ``n_s``:

- a preallocated cache per sequence: ``c * S * max_len`` numbers;
- paged: ``c * B * sum_s ceil(n_s / B)``, at most ``c (B - 1)`` per sequence above
  ``c * sum_s n_s``, the tokens held (no external fragmentation, internal fragmentation
  under one block per sequence).

:func:`kv_cache_footprint` computes the three numbers for a list of lengths.

The attention read here gathers each sequence's blocks into a ``(batch, kv_heads, m, d)``
copy (``m`` = the longest sequence's blocks times ``B``) and masks the positions beyond
each length: :func:`~efficient_attention.kv_cache.cached_attention` over it is exact
attention over every sequence's own tokens. vLLM's kernel reads the blocks in place
through the table instead; the gather costs one more copy, ``O(b h_kv m (d + d_v))``.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._checks import (
    check_dtype,
    check_nonnegative_int,
    check_nonnegative_ints,
    check_positive_int,
)
from .kv_cache import CachedKeys, _check_block, cache_bytes_per_token

__all__ = ["CacheFullError", "PagedKVCache", "CacheFootprint", "kv_cache_footprint"]


class CacheFullError(RuntimeError):
    """The pool of a :class:`PagedKVCache` has too few free blocks for an append.

    A server would preempt a sequence (free it, recompute it later) or wait; the cache is
    left as it was before the append.
    """


class PagedKVCache:
    """Keys and values of many sequences in a shared pool of fixed-size blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: ``B``, positions per block.
        num_kv_heads, d_head: the key-value heads and their size ``d``.
        d_value: the size ``d_v`` of the values; ``None`` means ``d_head``.
        dtype, device: of the pool, allocated (zeros) at construction: keys
            ``(num_blocks, num_kv_heads, B, d)`` and values ``(num_blocks, num_kv_heads,
            B, d_v)``, ``num_blocks * block_nbytes`` bytes.

    Sequences are named by ints (any, ``>= 0``); one is created by its first append.

    - ``append(sequences, k, v)``: ``k (b, h_kv, t, d)`` and ``v (b, h_kv, t, d_v)`` are
      the next ``t`` tokens of each of the ``b`` sequences (an int for ``b = 1``, else a
      list of ``b`` distinct ids; lengths may differ). Takes a block from the free list
      whenever a sequence crosses into a new one (all or nothing:
      :class:`CacheFullError` when too few are free), writes the tokens at
      ``block_table[p // B]``, offset ``p % B`` and returns the :class:`CachedKeys` of the
      ``t`` new queries: query ``i`` of sequence ``s`` sees the keys ``0 .. L_s + i``
      (``L_s`` its length before the append).
    - ``gather(sequences)``: the :class:`CachedKeys` of one query after each sequence's
      cached tokens (every one of its keys, none of the positions beyond).
    - ``free(sequence)``, ``truncate(sequence, length)``: return the blocks no longer
      needed to the free list (most recently freed are reused first).
    - ``length(sequence)``, ``block_table(sequence)``, ``sequences``,
      ``num_free_blocks``.
    - Bytes: ``nbytes`` (the pool), ``allocated_nbytes`` (the blocks held by sequences),
      ``used_nbytes`` (the tokens held: ``sum n_s`` times ``h_kv (d + d_v)`` numbers).

    Writes are in place: decode under ``torch.no_grad()`` or ``torch.inference_mode()``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        d_head: int,
        *,
        d_value: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self.block_size = check_positive_int(block_size, "block_size")
        check_positive_int(num_kv_heads, "num_kv_heads")
        check_positive_int(d_head, "d_head")
        d_value = d_head if d_value is None else check_positive_int(d_value, "d_value")
        check_dtype(dtype, "dtype", floating=True)
        self.key_pool = torch.zeros(num_blocks, num_kv_heads, block_size, d_head, dtype=dtype,
                                    device=device)
        self.value_pool = torch.zeros(num_blocks, num_kv_heads, block_size, d_value,
                                      dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    # --- bookkeeping -------------------------------------------------------------------

    @property
    def sequences(self) -> tuple[int, ...]:
        """The ids of the sequences held, in the order they were created."""
        return tuple(self._tables)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _known(self, sequence: object) -> int:
        sequence = check_nonnegative_int(sequence, "sequence")
        if sequence not in self._tables:
            raise ValueError(
                f"sequence {sequence} is not in the cache (it holds {list(self._tables)})"
            )
        return sequence

    def length(self, sequence: int) -> int:
        """Tokens held for ``sequence``."""
        return self._lengths[self._known(sequence)]

    def block_table(self, sequence: int) -> tuple[int, ...]:
        """Physical blocks of ``sequence``: logical block ``i`` is ``table[i]``."""
        return tuple(self._tables[self._known(sequence)])

    def free(self, sequence: int) -> None:
        """Forget ``sequence`` and return its blocks to the free list."""
        self.truncate(sequence, 0)
        del self._tables[sequence], self._lengths[sequence]

    def truncate(self, sequence: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``sequence`` (``0 <= length <=`` its
        length; rejected draft tokens) and free the blocks past ``ceil(length / B)``."""
        sequence = self._known(sequence)
        check_nonnegative_int(length, "length")
        if length > self._lengths[sequence]:
            raise ValueError(f"length must be at most the {self._lengths[sequence]} tokens "
                             f"of sequence {sequence}, got {length}")
        table = self._tables[sequence]
        keep = -(-length // self.block_size)
        self._free.extend(reversed(table[keep:]))  # the table's first spare is reused first
        del table[keep:]
        self._lengths[sequence] = length

    # --- bytes -------------------------------------------------------------------------

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: ``h_kv B (d + d_v)`` numbers."""
        return (self.key_pool[0].numel() * self.key_pool.element_size()
                + self.value_pool[0].numel() * self.value_pool.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of the pool, allocated at construction."""
        return self.num_blocks * self.block_nbytes

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the blocks that sequences hold now."""
        return (self.num_blocks - len(self._free)) * self.block_nbytes

    @property
    def used_nbytes(self) -> int:
        """Bytes of the keys and values of the tokens held (``allocated_nbytes`` less the
        unfilled ends of the last blocks)."""
        return sum(self._lengths.values()) * self.block_nbytes // self.block_size

    # --- reads and writes --------------------------------------------------------------

    def _ids(self, sequences: object, batch: int | None) -> list[int]:
        if isinstance(sequences, int) and not isinstance(sequences, bool):
            sequences = [sequences]
        ids = check_nonnegative_ints(sequences, "sequences", distinct=True)
        if batch is not None and len(ids) != batch:
            raise ValueError(f"sequences must name one sequence per batch row of k, v: "
                             f"{batch}, got {len(ids)} ({ids})")
        return ids

    def _read(self, ids: list[int], t: int) -> CachedKeys:
        """Gather the blocks of ``ids``; the ``t`` queries are their last ``t`` tokens."""
        device = self.key_pool.device
        lengths = torch.tensor([self._lengths[s] for s in ids], device=device)  # (b,)
        width = max((len(self._tables[s]) for s in ids), default=0)
        table = torch.zeros(len(ids), width, dtype=torch.long, device=device)  # block 0 pads
        for row, s in enumerate(ids):
            table[row, : len(self._tables[s])] = torch.tensor(self._tables[s], device=device)
        b, h, m = len(ids), self.key_pool.shape[1], width * self.block_size
        # (b, width, h, B, d) -> (b, h, width B, d): position p of row r is p // B, p % B
        keys = self.key_pool[table].transpose(1, 2).reshape(b, h, m, self.key_pool.shape[-1])
        values = self.value_pool[table].transpose(1, 2).reshape(b, h, m,
                                                                self.value_pool.shape[-1])
        positions = torch.arange(m, device=device)
        beyond = positions >= lengths[:, None]  # (b, m): not a token of the sequence
        # Unwritten or stale slots are zeroed: nothing there can reach an output (0 * NaN).
        keys = keys.masked_fill(beyond[:, None, :, None], 0.0)
        values = values.masked_fill(beyond[:, None, :, None], 0.0)
        query_positions = lengths[:, None] - t + torch.arange(t, device=device)  # (b, t)
        blocked = positions > query_positions[:, :, None]  # (b, t, m): later or beyond
        return CachedKeys(keys, values, blocked[:, None])  # mask (b, 1, t, m)

    def gather(self, sequences: int | Sequence[int]) -> CachedKeys:
        """Keys ``(b, h_kv, m, d)``, values ``(b, h_kv, m, d_v)`` and the mask ``(b, 1, 1,
        m)`` of one new query per sequence, after all of its cached tokens (a copy)."""
        ids = self._ids(sequences, None)
        for s in ids:
            self._known(s)
        return self._read(ids, 1)

    def append(self, sequences: int | Sequence[int], k: torch.Tensor,
               v: torch.Tensor) -> CachedKeys:
        k, v, _ = _check_block(k, v, None)
        ids = self._ids(sequences, k.shape[0])
        b, _, t, _ = k.shape
        pool_shape = (self.key_pool.shape[1], self.key_pool.shape[3], self.value_pool.shape[3])
        if (k.shape[1], k.shape[3], v.shape[3]) != pool_shape:
            raise ValueError(
                f"k and v must have (kv_heads, d)={pool_shape[:2]} and d_v={pool_shape[2]} "
                f"of the pool, got k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)}")
        if k.dtype != self.key_pool.dtype or k.device != self.key_pool.device:
            raise TypeError(f"k and v must have the pool's dtype {self.key_pool.dtype} and "
                            f"device {self.key_pool.device}, got {k.dtype} on {k.device}")
        old = [self._lengths.get(s, 0) for s in ids]
        needed = [-(-(n + t) // self.block_size) - len(self._tables.get(s, ())) for s, n in
                  zip(ids, old, strict=True)]
        if sum(needed) > len(self._free):
            raise CacheFullError(
                f"PagedKVCache pool exhausted: appending {t} token(s) to sequences {ids} needs "
                f"{sum(needed)} new block(s) of {self.block_size} positions, and only "
                f"{len(self._free)} of the {self.num_blocks} are free; free() finished "
                "sequences or make a larger pool")
        if not torch.is_inference_mode_enabled() and self.key_pool.is_inference():
            self.key_pool, self.value_pool = self.key_pool.clone(), self.value_pool.clone()
        for s, n, extra in zip(ids, old, needed, strict=True):
            self._tables.setdefault(s, []).extend(self._free.pop() for _ in range(extra))
            self._lengths[s] = n + t
        if t > 0:
            device = k.device
            positions = torch.tensor(old, device=device)[:, None] + torch.arange(t, device=device)
            tables = [torch.tensor(self._tables[s], device=device) for s in ids]
            blocks = torch.stack([tab[p] for tab, p in
                                  zip(tables, positions // self.block_size, strict=True)])
            offsets = positions % self.block_size  # (b, t)
            # pool[blocks, :, offsets] is (b, t, h_kv, d): the new tokens, heads second
            self.key_pool[blocks, :, offsets] = k.transpose(1, 2)
            self.value_pool[blocks, :, offsets] = v.transpose(1, 2)
        return self._read(ids, t)


class CacheFootprint(NamedTuple):
    """Bytes of a KV cache for a list of sequences (see :func:`kv_cache_footprint`)."""

    used: int  # the tokens' keys and values
    paged: int  # whole blocks: used + the unfilled ends of the last blocks
    preallocated: int  # max_len positions per sequence


def kv_cache_footprint(
    lengths: Sequence[int],
    *,
    max_len: int,
    block_size: int,
    num_kv_heads: int,
    d_head: int,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float16,
) -> CacheFootprint:
    """Bytes of the KV caches of sequences of ``lengths``: held, paged, preallocated.

    With ``c = cache_bytes_per_token(num_layers, num_kv_heads, d_head, dtype)`` bytes per
    token (``2 L h_kv d`` numbers) and ``B = block_size``:

    - ``used = c * sum(n)``;
    - ``paged = c * B * sum(ceil(n / B))`` (< ``used + c B`` per sequence);
    - ``preallocated = c * max_len * len(lengths)`` (a ``KVCache(max_len)`` each).

    Every length must be at most ``max_len``. Kwon et al. (2023) measured that systems
    preallocating ``max_len`` used 20-40% of their cache for tokens; paging with
    ``B = 16`` wastes under 4%.
    """
    ids = check_nonnegative_ints(lengths, "lengths")
    check_positive_int(max_len, "max_len")
    check_positive_int(block_size, "block_size")
    too_long = [n for n in ids if n > max_len]
    if too_long:
        raise ValueError(f"lengths must be at most max_len={max_len}, got {too_long}")
    per_token = cache_bytes_per_token(num_layers, num_kv_heads, d_head, dtype)
    blocks = sum(-(-n // block_size) for n in ids)
    return CacheFootprint(used=per_token * sum(ids), paged=per_token * block_size * blocks,
                          preallocated=per_token * max_len * len(ids))
