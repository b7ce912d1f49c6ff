r"""Attention sinks (StreamingLLM): a sliding window that also keeps the first tokens.

A model decoding with only a sliding window of its last ``w`` keys fails as soon as the
first tokens leave the window: trained models put much of their attention weight on the
first few tokens whatever their content ("attention sinks"), and the softmax spreads that
weight over the others once they are gone. StreamingLLM (Xiao et al. 2023) keeps the keys
and values of the first ``S`` tokens for ever, beside the window: query ``i`` sees

.. math::
    \{\, j \le i : j < S \ \text{ or }\ i - w \le j \,\}

— memory ``S + w + 1`` positions per head however long the stream, and the attention is
exact softmax attention under that mask (:func:`sink_window_mask`).

:class:`SinkKVCache` is a :class:`~efficient_attention.kv_cache.SlidingWindowKVCache` of
window ``w`` (the ring buffer, written as before) beside a
:class:`~efficient_attention.kv_cache.KVCache` of ``S`` positions that takes the first
``S`` tokens. A step returns the sinks and the window concatenated, with a mask that hides
a sink from query ``i`` once ``j >= i - w`` (then the window holds it: no key is counted
twice). Until the first token leaves the window, the window's keys are returned alone.

Positions: this package's models add absolute positions to the tokens before the keys
are made, so the cached keys are those of the full sequence and the attention above is
exact. StreamingLLM, for rotary models, re-numbers the positions inside the cache (the
sinks ``0 .. S-1``, the window after them), which changes the keys; that variant is not
implemented here.

Reference: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024 (arXiv:2309.17453, 2023).
"""

from __future__ import annotations

import torch

from ._checks import check_nonnegative_int
from .kv_cache import CachedKeys, KVCache, SlidingWindowKVCache, _check_block

__all__ = ["SinkKVCache", "sink_window_mask"]


def sink_window_mask(
    n: int, num_sinks: int, window: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool ``(n, n)``, ``True`` where query ``i`` may *not* see key ``j``: unless
    ``j <= i`` and (``j < num_sinks`` or ``j >= i - window``).

    ``num_sinks = 0`` gives the causal band of ``banded_attention(..., window,
    causal=True)``; ``num_sinks + window >= n - 1`` gives the causal mask.
    """
    check_nonnegative_int(n, "n")
    check_nonnegative_int(num_sinks, "num_sinks")
    check_nonnegative_int(window, "window")
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j > i) | ((j >= num_sinks) & (j < i - window))


class SinkKVCache:
    """The first ``num_sinks`` tokens' keys and values, and those of the last ``window + 1``.

    Args:
        num_sinks: ``S >= 0``, the first tokens kept for ever (StreamingLLM uses 4).
        window: ``w >= 0``, how many earlier tokens a query sees besides the sinks.

    ``append(k, v, key_padding_mask=None)`` is that of
    :class:`~efficient_attention.kv_cache.KVCache` (new keys ``(batch, kv_heads, t, d)``,
    values ``(batch, kv_heads, t, d_v)``, bool mask ``(batch, t)``, ``True`` at padding)
    and returns the :class:`CachedKeys` of the ``t`` new queries under
    :func:`sink_window_mask`. There is no length limit.

    Memory: ``S + w + 1`` positions, ``(S + w + 1) (d + d_v)`` numbers per row and head
    (``nbytes``, ``used_nbytes`` as for the other caches). A step costs ``O((S + w) d)``
    per head; once the sinks are out of the window it copies them and the window into one
    tensor (the same order as the attention's read of them).
    """

    def __init__(self, num_sinks: int, window: int) -> None:
        self.num_sinks = check_nonnegative_int(num_sinks, "num_sinks")
        self.window = check_nonnegative_int(window, "window")
        self._ring = SlidingWindowKVCache(window)
        self._sinks = KVCache(num_sinks) if num_sinks else None
        self._sink_padding: torch.Tensor | None = None  # (b, S) once a mask was given

    @property
    def length(self) -> int:
        """Tokens appended since the last reset."""
        return self._ring.length

    def reset(self) -> None:
        """Start a new sequence: the buffers are kept and reused if the next keys fit."""
        self._ring.reset()
        self._sink_padding = None
        if self._sinks is not None:
            self._sinks.reset()

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the window and the sinks."""
        sinks = 0 if self._sinks is None else self._sinks.nbytes
        padding = self._sink_padding
        return self._ring.nbytes + sinks + (0 if padding is None else padding.numel())

    @property
    def used_nbytes(self) -> int:
        """Bytes of the keys and values held: ``min(n, S) + min(n, w + 1)`` positions."""
        sinks = 0 if self._sinks is None else self._sinks.used_nbytes
        return self._ring.used_nbytes + sinks

    def append(
        self, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> CachedKeys:
        k, v, mask = _check_block(k, v, key_padding_mask)
        start, t = self.length, k.shape[-2]
        window = self._ring.append(k, v, mask)  # validates that k, v continue the sequence
        if self._sinks is None:
            return window
        new_sinks = max(0, min(self.num_sinks - start, t))  # positions start .. S - 1
        if new_sinks:
            self._sinks.append(k[:, :, :new_sinks], v[:, :, :new_sinks])
        held = self._sinks.length  # min(start + t, S)
        if mask is not None and self._sink_padding is None:
            self._sink_padding = torch.zeros(k.shape[0], self.num_sinks, dtype=torch.bool,
                                             device=k.device)
        if self._sink_padding is not None and new_sinks:
            self._sink_padding[:, start : start + new_sinks] = (
                False if mask is None else mask[:, :new_sinks])
        if start + t - 1 - self.window <= 0:  # every sink is still in every query's window
            return window
        queries = torch.arange(start, start + t, device=k.device)[:, None]  # (t, 1)
        sink_blocked = torch.arange(held, device=k.device) >= queries - self.window  # (t, S)
        keys = torch.cat([self._sinks.keys, window.keys], dim=-2)
        values = torch.cat([self._sinks.values, window.values], dim=-2)
        if self._sink_padding is None and window.blocked is None:  # t = 1, no padding
            return CachedKeys(keys, values, torch.cat(
                [sink_blocked, sink_blocked.new_zeros(1, window.keys.shape[-2])], dim=-1))
        rows = k.shape[0] if self._sink_padding is not None or (
            window.blocked is not None and window.blocked.dim() == 4) else 1
        shape = (rows, 1, t)
        if self._sink_padding is not None:
            sink_blocked = sink_blocked | self._sink_padding[:, None, None, :held]
        ring_blocked = (torch.zeros((), dtype=torch.bool, device=k.device)
                        if window.blocked is None else window.blocked)
        blocked = torch.cat([sink_blocked.expand(*shape, held),
                             ring_blocked.expand(*shape, window.keys.shape[-2])], dim=-1)
        return CachedKeys(keys, values, blocked)
