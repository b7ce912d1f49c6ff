"""Key-value caches: decoding one token (or one block of tokens) at a time.

A decoder generates token ``L`` after tokens ``0 .. L-1``. Its query must attend to the
keys and values of every earlier token, which do not change once computed, so they are
kept in a **KV cache** and each step appends the new ones instead of projecting the whole
prefix again. For each new block of ``t`` tokens (``t`` = the prompt for the prefill,
``t = 1`` for a decoding step), query ``L + i`` sees the cached keys and the new keys up to
itself; the outputs are exactly those of causal attention over the whole sequence.

- :class:`KVCache` keeps every key: preallocated buffers ``(batch, kv_heads, max_len, d)``,
  memory ``2 b h_kv n d`` numbers after ``n`` tokens, and a step at position ``n`` costs
  ``O(n d)`` per head (it reads the whole cache: memory bound).
- :class:`SlidingWindowKVCache` keeps the last ``w + 1`` keys in a ring buffer: query ``i``
  sees keys ``i - w .. i``, the causal band of ``fmm.banded_attention`` with
  ``bandwidth = w``; memory and cost per step are ``O(w d)`` whatever the length.
- :func:`cached_attention` is softmax attention of new queries over what a cache returns.
  Its query heads may outnumber the key-value heads (grouped-query attention: each group
  of ``h / h_kv`` query heads shares one key-value head, multi-query when ``h_kv = 1``);
  the groups are folded into the query rows, so no key or value is copied.
- :func:`cache_bytes_per_token` is the memory a model's cache grows by per token.

References: Shazeer, "Fast Transformer Decoding: One Write-Head is All You Need", 2019
(multi-query attention); Ainslie et al., "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints", EMNLP 2023; Pope et al., "Efficiently
Scaling Transformer Inference", MLSys 2023.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._checks import (
    check_nonnegative_int,
    check_positive_int,
    check_real,
    check_tensor,
)
from ._padding import zero_padded_rows

__all__ = [
    "CachedKeys",
    "KVCache",
    "SlidingWindowKVCache",
    "cached_attention",
    "cache_bytes_per_token",
]


class CachedKeys(NamedTuple):
    """What a new block of ``t`` queries may attend to, as returned by ``append``.

    ``keys (batch, kv_heads, m, d)`` and ``values (batch, kv_heads, m, d_v)`` (views of the
    cache's buffers where possible), and ``blocked``: ``None`` when every query sees every
    key, else a bool tensor broadcastable to ``(batch, 1, t, m)``, ``True`` where new query
    ``i`` may *not* see key ``j`` (a later position, outside the window, or padding).
    """

    keys: torch.Tensor
    values: torch.Tensor
    blocked: torch.Tensor | None


def cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, d_head: int, dtype: torch.dtype = torch.float16
) -> int:
    """Bytes a KV cache grows by per token and sequence: ``2 L h_kv d_head`` numbers.

    One key and one value of ``d_head`` numbers for each of the ``num_kv_heads`` heads of
    each of the ``num_layers`` layers. Multi-head attention has ``h_kv = h``, multi-query
    ``h_kv = 1``, grouped-query attention ``1 < h_kv < h``.
    """
    check_positive_int(num_layers, "num_layers")
    check_positive_int(num_kv_heads, "num_kv_heads")
    check_positive_int(d_head, "d_head")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return 2 * num_layers * num_kv_heads * d_head * dtype.itemsize


def _check_block(
    k: object, v: object, key_padding_mask: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate new keys ``(b, h_kv, t, d)``, values ``(b, h_kv, t, d_v)``, mask ``(b, t)``."""
    k = check_tensor(k, "k")
    v = check_tensor(v, "v")
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "k and v must have shapes (batch, kv_heads, t, d) and (batch, kv_heads, t, d_v), "
            f"got k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)}"
        )
    if k.shape[-1] == 0:
        raise ValueError(f"k must have at least one feature (d >= 1), got {tuple(k.shape)}")
    if k.dtype != v.dtype or k.device != v.device:
        raise TypeError(
            f"k and v must share dtype and device, got {k.dtype} on {k.device} and "
            f"{v.dtype} on {v.device}"
        )
    if key_padding_mask is None:
        return k, v, None
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
        raise TypeError(f"key_padding_mask must be a bool torch.Tensor, got {got}")
    expected = (k.shape[0], k.shape[2])
    if tuple(key_padding_mask.shape) != expected:
        raise ValueError(
            f"key_padding_mask must have shape (batch, t)={expected}, "
            f"got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device != k.device:
        raise ValueError(
            f"key_padding_mask must be on the keys' device {k.device}, "
            f"got {key_padding_mask.device}"
        )
    # A padded token is stored as a zero key and value: NaN or inf there cannot leak.
    padded = key_padding_mask[:, None, :]  # (b, 1, t): every head
    return zero_padded_rows(k, padded), zero_padded_rows(v, padded), key_padding_mask


class _BufferedCache:
    """Buffers of ``capacity`` positions, allocated from the first keys that arrive."""

    capacity: int

    def __init__(self) -> None:
        self.length = 0  # tokens appended since the last reset (positions 0 .. length-1)
        self._keys: torch.Tensor | None = None  # (b, h_kv, capacity, d)
        self._values: torch.Tensor | None = None  # (b, h_kv, capacity, d_v)
        self._padding: torch.Tensor | None = None  # (b, capacity), made at the first mask

    def reset(self) -> None:
        """Start a new sequence: the buffers are kept and reused if the next keys fit."""
        self.length = 0
        self._padding = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the buffers (0 before the first ``append``)."""
        buffers = (self._keys, self._values, self._padding)
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the keys and values held now: ``min(length, capacity)`` positions."""
        if self._keys is None:
            return 0
        held = min(self.length, self.capacity)
        batch, heads = self._keys.shape[:2]
        width = self._keys.shape[-1] + self._values.shape[-1]  # d + d_v numbers per position
        return batch * heads * held * width * self._keys.element_size()

    def _leave_inference_mode(self) -> None:
        """Buffers made under ``torch.inference_mode()`` cannot be written outside it:
        replace them by ordinary tensors (new ones for a new sequence, else copies)."""
        renew = torch.empty_like if self.length == 0 else torch.clone
        for name in ("_keys", "_values", "_padding"):
            buffer = getattr(self, name)
            if buffer is not None and buffer.is_inference():
                setattr(self, name, renew(buffer))

    def _prepare(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Allocate the buffers for a new sequence, or check that ``k, v`` continue it."""
        b, h_kv, _, d = k.shape
        if self._keys is not None:
            same = (self._keys.shape[:2] == (b, h_kv) and self._keys.shape[-1] == d
                    and self._values.shape[-1] == v.shape[-1] and self._keys.dtype == k.dtype
                    and self._keys.device == k.device)
            if not same and self.length > 0:
                raise ValueError(
                    f"k, v of shapes {tuple(k.shape)}, {tuple(v.shape)} ({k.dtype}, "
                    f"{k.device}) do not continue the cached sequence "
                    f"{tuple(self._keys.shape)}, {tuple(self._values.shape)} "
                    f"({self._keys.dtype}, {self._keys.device}); call reset() first"
                )
            if not same:
                self._keys = self._values = self._padding = None
        if not torch.is_inference_mode_enabled():
            self._leave_inference_mode()
        if self._keys is None:
            self._keys = k.new_empty(b, h_kv, self.capacity, d)
            self._values = v.new_empty(b, h_kv, self.capacity, v.shape[-1])
        if mask is not None and self._padding is None:
            self._padding = torch.zeros(b, self.capacity, dtype=torch.bool, device=k.device)


class KVCache(_BufferedCache):
    """Every key and value of one attention layer, in preallocated buffers.

    Args:
        max_len: positions the buffers hold; appending past it raises ``ValueError``.

    ``append(k, v, key_padding_mask=None)`` takes the ``t >= 0`` new keys
    ``(batch, kv_heads, t, d)`` and values ``(batch, kv_heads, t, d_v)`` of positions
    ``L .. L+t-1`` (``L = length``), and optionally a bool ``(batch, t)`` mask, ``True`` at
    padding tokens (which no later query sees). The buffers ``(batch, kv_heads, max_len,
    d)`` are allocated at the first append, in the dtype and on the device of ``k``. It
    returns :class:`CachedKeys`: views of the ``L + t`` keys and values (no copy), and the
    mask ``j > L + i`` (query ``i`` of the block sees the keys up to its own position),
    ``None`` for ``t = 1`` without padding.

    Attributes: ``length``, ``keys`` and ``values`` (views of the filled part), ``nbytes``
    (allocated), ``used_nbytes`` (held keys and values). ``reset()`` starts a new sequence;
    ``truncate(length)`` forgets the tokens from position ``length`` on (draft tokens
    rejected in speculative decoding, or a benchmark that repeats one step).

    Cost: ``append`` copies the ``t`` new keys and values, ``O(b h_kv t d)``; memory
    ``2 b h_kv max_len d`` numbers. The buffers are written in place: decode under
    ``torch.inference_mode()`` (autograd can go through the latest append only). Buffers
    made there are replaced by ordinary tensors at the first append outside it (new ones
    after ``reset()``, a copy if a sequence is under way), so the cache can be reused.
    """

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = check_positive_int(max_len, "max_len")
        self.capacity = self.max_len

    @property
    def keys(self) -> torch.Tensor | None:
        """``(batch, kv_heads, length, d)``: the cached keys (``None`` before any append)."""
        return None if self._keys is None else self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        """``(batch, kv_heads, length, d_v)``: the cached values."""
        return None if self._values is None else self._values[:, :, : self.length]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (``0 <= length <= self.length``): the next
        append writes at position ``length``."""
        check_nonnegative_int(length, "length")
        if length > self.length:
            raise ValueError(
                f"length must be at most the {self.length} cached tokens, got {length}"
            )
        self.length = length

    def append(
        self, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> CachedKeys:
        k, v, mask = _check_block(k, v, key_padding_mask)
        start, t = self.length, k.shape[-2]
        if start + t > self.max_len:
            raise ValueError(
                f"KVCache(max_len={self.max_len}) holds {start} tokens and cannot take "
                f"{t} more; make a larger cache, or use SlidingWindowKVCache"
            )
        self._prepare(k, v, mask)
        stop = start + t
        self._keys[:, :, start:stop] = k
        self._values[:, :, start:stop] = v
        blocked = None
        if t > 1:  # key j is after query i (position start + i)
            blocked = torch.ones(t, stop, dtype=torch.bool, device=k.device).triu(start + 1)
        if self._padding is not None:
            self._padding[:, start:stop] = False if mask is None else mask
            padded = self._padding[:, None, None, :stop]  # (b, 1, 1, stop)
            blocked = padded if blocked is None else blocked | padded
        self.length = stop
        return CachedKeys(self.keys, self.values, blocked)


class SlidingWindowKVCache(_BufferedCache):
    """The keys and values of the last ``window + 1`` positions, in a ring buffer.

    Query ``i`` sees keys ``j`` with ``i - w <= j <= i``: the decoding form of
    ``banded_attention(q, k, v, w, causal=True)``. The buffers hold ``w + 1`` positions;
    position ``p`` lives in slot ``p mod (w + 1)``, so memory and the cost of a step are
    ``O(w d)`` per head, however long the sequence.

    Args:
        window: ``w >= 0``, how many earlier tokens a query sees.

    ``append(k, v, key_padding_mask=None)`` is that of :class:`KVCache`. For one new token
    the key is written first and the whole ring is returned (every slot is in the window;
    order does not matter to softmax attention); for a block of ``t > 1`` tokens, the ring
    and the new keys are returned concatenated (a copy), with the band mask, and then the
    last ``w + 1`` new keys are written. There is no length limit.
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = check_nonnegative_int(window, "window")
        self.capacity = self.window + 1

    def _slot_positions(self, device: torch.device) -> torch.Tensor:
        """Positions held by slots ``0 .. min(length, w+1) - 1``: the latest ``p = s mod (w+1)``."""
        slots = torch.arange(min(self.length, self.capacity), device=device)
        return slots + self.capacity * torch.div(self.length - 1 - slots, self.capacity,
                                                 rounding_mode="floor")

    def append(
        self, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> CachedKeys:
        k, v, mask = _check_block(k, v, key_padding_mask)
        self._prepare(k, v, mask)
        start, t, size = self.length, k.shape[-2], self.capacity
        if t == 1:  # write first: every slot then holds a key of the window
            slot = start % size
            self._keys[:, :, slot : slot + 1] = k
            self._values[:, :, slot : slot + 1] = v
            self.length = start + 1
            held = min(self.length, size)
            blocked = None
            if self._padding is not None:
                self._padding[:, slot] = False if mask is None else mask[:, 0]
                blocked = self._padding[:, None, None, :held]  # (b, 1, 1, held)
            return CachedKeys(self._keys[:, :, :held], self._values[:, :, :held], blocked)
        held = min(start, size)
        key_positions = torch.cat([self._slot_positions(k.device),
                                   torch.arange(start, start + t, device=k.device)])
        query_positions = torch.arange(start, start + t, device=k.device)[:, None]  # (t, 1)
        blocked = (key_positions > query_positions) | (
            key_positions < query_positions - self.window)  # (t, held + t)
        keys = torch.cat([self._keys[:, :, :held], k], dim=-2)
        values = torch.cat([self._values[:, :, :held], v], dim=-2)
        if self._padding is not None:
            new = mask if mask is not None else self._padding.new_zeros(k.shape[0], t)
            blocked = blocked | torch.cat([self._padding[:, :held], new], -1)[:, None, None]
        kept = min(t, size)  # only the last w + 1 new positions stay
        slots = torch.arange(start + t - kept, start + t, device=k.device) % size
        self._keys.index_copy_(2, slots, k[:, :, t - kept :])
        self._values.index_copy_(2, slots, v[:, :, t - kept :])
        if self._padding is not None and kept > 0:
            self._padding.index_copy_(1, slots, new[:, t - kept :])
        self.length = start + t
        return CachedKeys(keys, values, blocked)


def cached_attention(
    q: torch.Tensor, cached: CachedKeys, *, scale: float | None = None
) -> torch.Tensor:
    r"""Softmax attention of new queries over cached keys, heads grouped over key-value heads.

    .. math::
        \mathrm{out}_{h,i} = \sum_{j \text{ not blocked}}
        \operatorname{softmax}_j\!\big(s\, q_{h,i}^\top k_{g(h),j}\big)\, v_{g(h),j},
        \qquad g(h) = \lfloor h / (h_q / h_{kv}) \rfloor

    Args:
        q: queries ``(batch, h_q, t, d)``; ``h_q`` a multiple of the cache's ``h_kv``.
        cached: keys ``(batch, h_kv, m, d)``, values ``(batch, h_kv, m, d_v)`` and mask,
            as returned by :meth:`KVCache.append`.
        scale: multiplies the scores; ``None`` means ``1/sqrt(d)``.

    Returns ``(batch, h_q, t, d_v)`` in the dtype of ``q``. A query that sees no key gets
    zeros, as in ``softmax_attention``. Half precision (float16, bfloat16) goes to SDPA as
    it is: its fused kernels read the half-precision keys and values and accumulate in
    float32, so no float32 copy of the cache is made (converting it would allocate twice
    the cache's bytes per step).

    The ``g = h_q / h_kv`` query heads of a group are stacked as ``g t`` rows against their
    shared keys, and PyTorch's fused ``scaled_dot_product_attention`` runs on these 4-D
    ``(b, h_kv, g t, d)`` queries and the cache's ``(b, h_kv, m, d)`` keys: no copy of the
    cache for any number of groups. Cost: time ``O(b h_q t m d)``, reading the
    ``2 b h_kv m d`` cached numbers once; memory ``O(b h_q t m)`` at most (the mask).
    """
    q = check_tensor(q, "q", min_dim=4)
    if not isinstance(cached, CachedKeys):
        raise TypeError(f"cached must be the CachedKeys of a cache, got {type(cached).__name__}")
    keys, values, blocked = cached
    b, h_q, t, d = q.shape if q.dim() == 4 else (None,) * 4
    if q.dim() != 4 or b != keys.shape[0] or d != keys.shape[-1] or h_q % keys.shape[1] != 0:
        raise ValueError(
            f"q must be (batch, h_q, t, d) with the batch and d of the keys "
            f"{tuple(keys.shape)} and h_q a multiple of their {keys.shape[1]} heads, "
            f"got q.shape={tuple(q.shape)}"
        )
    if q.dtype != keys.dtype or q.device != keys.device:
        raise TypeError(
            f"q must share the cache's dtype and device, got {q.dtype} on {q.device} and "
            f"{keys.dtype} on {keys.device}"
        )
    h_kv, m = keys.shape[1], keys.shape[2]
    group = h_q // h_kv
    scale = d**-0.5 if scale is None else check_real(scale, "scale")
    rows = q.reshape(b, h_kv, group * t, d)  # query head h -> kv head h // group
    if blocked is None:
        out = F.scaled_dot_product_attention(rows, keys, values, scale=scale)
    else:
        blocked = blocked.reshape((1,) * (4 - blocked.dim()) + tuple(blocked.shape))
        mask_batch = blocked.shape[0]  # 1 or b
        mask = blocked.expand(mask_batch, 1, t, m).unsqueeze(2).expand(-1, -1, group, -1, -1)
        mask = mask.reshape(mask_batch, 1, group * t, m)  # the same mask for every query head
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=~mask, scale=scale)
        # A query with no key left gets zeros (SDPA would give 0 / 0 = NaN there).
        out = out.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return out.reshape(b, h_q, t, values.shape[-1])  # (b, h_q, t, d_v)
