r"""An int8 KV cache: keys and values stored in one byte each, with a scale per group.

Symmetric int8 quantisation of a group ``G`` of numbers ``x`` shares one scale:

.. math::
    s = \frac{\max_{x \in G} |x|}{127}, \qquad
    q = \operatorname{clamp}\big(\operatorname{round}(x / s), -127, 127\big), \qquad
    \hat x = s\, q, \qquad |x - \hat x| \le s / 2

(``s = 0`` for a group of zeros, whose numbers dequantise to 0 exactly). Two ways to
choose the groups of a ``(batch, kv_heads, n, d)`` tensor, the ``granularity``:

- ``"token"``: the ``d`` numbers of one token and head share a scale, shape ``(b, h, n,
  1)``. Known as soon as the token is, so every token is stored in int8 at once.
- ``"channel"``: one channel of ``group_size`` consecutive tokens shares a scale, shape
  ``(b, h, n // group_size, d)``. Keys have a few channels of large magnitude (outliers
  along channels, Liu et al. 2024, KIVI), whose own scales spare the other channels'
  precision. A group's scale needs all of its tokens: the last ``n mod group_size``
  tokens (KIVI's residual) are kept in the input dtype until their group is complete.

KIVI quantises keys per channel and values per token, the default here. Memory per token
and head, ``e`` bytes per number of the input dtype: ``d`` bytes of int8 plus ``e`` (token
scales) or ``e d / group_size`` (channel scales), against ``e d`` unquantised: a float16
cache shrinks by almost 2, a float32 one by almost 4.

The error of one attention output is bounded through the dequantisation error
``|x - \hat x| <= s / 2`` of its keys (scores move by at most ``|q|_1 s_k / (2 sqrt(d))``)
and values; the tests check both the element bound and that outputs stay within the
bound it implies.

References: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024; Hooper et al., "KVQuant", NeurIPS 2024; Dettmers et al., "LLM.int8()",
NeurIPS 2022 (absmax int8 quantisation).
"""

from __future__ import annotations

import torch

from ._checks import (
    check_choice,
    check_positive_int,
    check_tensor,
    compute_dtype,
)
from .kv_cache import CachedKeys, _check_block

__all__ = [
    "GRANULARITIES",
    "quantize_int8",
    "dequantize_int8",
    "int8_round_trip",
    "QuantizedKVCache",
]

GRANULARITIES = ("token", "channel")
_LEVELS = 127  # symmetric: -127 .. 127 (-128 unused, so that -q is representable)


def _check_group_size(granularity: str, group_size: object) -> int | None:
    if group_size is None:
        return None
    check_positive_int(group_size, "group_size")
    if granularity != "channel":
        raise ValueError(f"group_size applies to granularity='channel' only, got "
                         f"group_size={group_size} with granularity={granularity!r}")
    return group_size


def quantize_int8(
    x: torch.Tensor, *, granularity: str = "token", group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantisation of ``x (..., n, d)``: ``(q, scale)``, ``x ~ scale * q``.

    ``granularity="token"``: ``scale (..., n, 1)``, the largest ``|x|`` of each token over
    its ``d`` channels, over 127. ``"channel"``: ``scale (..., n / group_size, d)``, the
    largest ``|x|`` of each channel over each group of ``group_size`` consecutive tokens
    (``None``: all ``n`` tokens, one group; ``n`` must be a multiple of it).

    ``q`` is int8 ``(..., n, d)`` in ``[-127, 127]``; ``scale`` has the dtype of ``x``. The
    division is done in float32 for half precision (float64 for float64), by the stored
    scale, so that :func:`dequantize_int8` errs by at most ``scale / 2`` per number (plus
    the rounding of the result to the dtype of ``x``). Cost: ``O(numel)``, one pass.
    """
    x = check_tensor(x, "x", min_dim=2)
    check_choice(granularity, "granularity", GRANULARITIES)
    group_size = _check_group_size(granularity, group_size)
    n = x.shape[-2]
    if granularity == "token":
        groups = x.unsqueeze(-2)  # (..., n, 1, d): one group per token
        amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(
            *x.shape[:-1], 1)
    else:
        size = n if group_size is None else group_size
        if size == 0 or n % size:
            raise ValueError(f"x must have a number of tokens n (dimension -2) that is a "
                             f"positive multiple of group_size={size}, got x.shape="
                             f"{tuple(x.shape)}")
        groups = x.unflatten(-2, (n // size, size))  # (..., n / G, G, d)
        amax = groups.abs().amax(dim=-2)  # (..., n / G, d)
    scale = (amax / _LEVELS).to(x.dtype)
    dtype = compute_dtype(x)
    divisor = scale.to(dtype).masked_fill(scale == 0, 1.0).unsqueeze(-2)  # no 0 / 0
    q = (groups.to(dtype) / divisor).round().clamp(-_LEVELS, _LEVELS).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * q`` in the dtype of ``scale``: ``(..., n, d)`` from int8 ``q (..., n, d)``.

    ``scale`` is ``(..., n / r, 1)`` or ``(..., n / r, d)``: each of its rows serves ``r``
    consecutive tokens (``r = 1`` for token scales, ``group_size`` for channel scales).
    The product is formed in float32 for half precision. Cost: ``O(numel)``.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() < 2:
        raise TypeError(f"q must be an int8 torch.Tensor (..., n, d), got "
                        f"{getattr(q, 'dtype', type(q).__name__)}")
    scale = check_tensor(scale, "scale", min_dim=2)
    n, groups = q.shape[-2], scale.shape[-2]
    if (scale.shape[-1] not in (1, q.shape[-1]) or scale.shape[:-2] != q.shape[:-2]
            or (groups == 0) != (n == 0) or (groups and n % groups)):
        raise ValueError(f"scale must have shape (..., n / r, 1) or (..., n / r, d) for q of "
                         f"shape {tuple(q.shape)}, got {tuple(scale.shape)}")
    if n == 0:
        return q.to(scale.dtype)
    dtype = compute_dtype(scale)
    grouped = q.unflatten(-2, (groups, n // groups)).to(dtype)  # (..., n / r, r, d)
    return (grouped * scale.to(dtype).unsqueeze(-2)).reshape(q.shape).to(scale.dtype)


def int8_round_trip(
    x: torch.Tensor, *, granularity: str = "token", group_size: int | None = None
) -> torch.Tensor:
    """What a :class:`QuantizedKVCache` returns for the keys (or values) ``x (..., n, d)``.

    ``dequantize_int8(*quantize_int8(x, ...))``, with ``"channel"`` scales over the
    ``floor(n / group_size)`` complete groups of ``group_size`` tokens; the last
    ``n mod group_size`` tokens are returned as they are (the cache keeps them unquantised
    until their group is complete). The reference for decoding with the cache.
    """
    x = check_tensor(x, "x", min_dim=2)
    check_choice(granularity, "granularity", GRANULARITIES)
    group_size = _check_group_size(granularity, group_size)
    if granularity == "token":
        return dequantize_int8(*quantize_int8(x))
    size = x.shape[-2] if group_size is None else group_size
    full = x.shape[-2] - x.shape[-2] % size if size else 0
    head = x[..., :full, :]
    if full:
        head = dequantize_int8(*quantize_int8(head, granularity="channel", group_size=size))
    return torch.cat([head, x[..., full:, :]], dim=-2)


class _Int8Store:
    """``capacity`` positions of int8 ``(b, h, capacity, d)`` with their scales."""

    def __init__(self, x: torch.Tensor, capacity: int, granularity: str, group_size: int):
        b, h, _, d = x.shape
        self.granularity, self.group_size = granularity, group_size
        self.data = torch.zeros(b, h, capacity, d, dtype=torch.int8, device=x.device)
        if granularity == "token":
            self.scales = x.new_zeros(b, h, capacity, 1)
            self.residual = None
        else:
            self.scales = x.new_zeros(b, h, capacity // group_size, d)
            self.residual = x.new_zeros(b, h, group_size, d)  # the incomplete group
        self.length = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.data, self.scales, self.residual) if t is not None)

    def matches(self, x: torch.Tensor) -> bool:
        return (self.data.shape[:2] == x.shape[:2] and self.data.shape[-1] == x.shape[-1]
                and self.scales.dtype == x.dtype and self.data.device == x.device)

    def renew(self, copy: bool) -> None:
        """Replace tensors made under ``torch.inference_mode()`` by ordinary ones."""
        for name in ("data", "scales", "residual"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.is_inference():
                setattr(self, name, tensor.clone() if copy else torch.zeros_like(tensor))

    def _split(self) -> tuple[int, int]:
        """Tokens in complete (quantised) groups, and in the residual."""
        if self.granularity == "token":
            return self.length, 0
        rest = self.length % self.group_size
        return self.length - rest, rest

    def append(self, x: torch.Tensor) -> None:
        start, t = self.length, x.shape[-2]
        if self.granularity == "token":
            q, scale = quantize_int8(x)
            self.data[:, :, start : start + t] = q
            self.scales[:, :, start : start + t] = scale
        else:
            full, rest = self._split()
            size = self.group_size
            pending = torch.cat([self.residual[:, :, :rest], x], dim=-2)  # (b, h, rest + t, d)
            done = pending.shape[-2] - pending.shape[-2] % size
            if done:
                q, scale = quantize_int8(pending[:, :, :done], granularity="channel",
                                         group_size=size)
                self.data[:, :, full : full + done] = q
                self.scales[:, :, full // size : (full + done) // size] = scale
            self.residual[:, :, : pending.shape[-2] - done] = pending[:, :, done:]
        self.length = start + t

    def read(self) -> torch.Tensor:
        """The dequantised ``(b, h, length, d)``: a new tensor."""
        full, rest = self._split()
        rows = full if self.granularity == "token" else full // self.group_size
        out = dequantize_int8(self.data[:, :, :full], self.scales[:, :, :rows])
        if self.residual is None:
            return out
        return torch.cat([out, self.residual[:, :, :rest]], dim=-2)

    def used_nbytes(self) -> int:
        full, rest = self._split()
        b, h, _, d = self.data.shape
        rows = full if self.granularity == "token" else full // self.group_size
        scale_numbers = b * h * rows * self.scales.shape[-1]
        return (b * h * full * d + (scale_numbers + b * h * rest * d)
                * self.scales.element_size())


class QuantizedKVCache:
    """Every key and value of one attention layer, stored in int8 with per-group scales.

    Args:
        max_len: positions the buffers hold; appending past it raises ``ValueError``.
        key_granularity, value_granularity: ``"token"`` or ``"channel"`` (module
            docstring); KIVI's choice, channel scales for keys and token scales for
            values, is the default.
        group_size: tokens per channel scale (``"channel"`` only).

    ``append(k, v, key_padding_mask=None)`` is that of
    :class:`~efficient_attention.kv_cache.KVCache`: new keys ``(batch, kv_heads, t, d)``,
    values ``(batch, kv_heads, t, d_v)``, bool mask ``(batch, t)`` (``True`` = padding);
    returns the :class:`CachedKeys` of the ``t`` new queries, whose keys and values are
    the dequantised cache (a new tensor in the dtype of ``k``, equal to
    :func:`int8_round_trip` of all the keys and values appended so far, whatever the
    chunks). With channel scales a query's output thus depends on the chunks: the
    queries of a block see the keys after the whole block is appended, its complete
    groups rounded (token scales round every key at once: no such dependence). Buffers
    are allocated at the first append.

    Bytes (``nbytes``: allocated, ``used_nbytes``: held now), per batch row and head,
    ``e`` bytes per number of the dtype of ``k``: keys ``max_len d`` int8, plus scales
    ``e max_len`` (token) or ``e floor(max_len / group_size) d`` and a residual of
    ``e group_size d`` (channel); the same for values with ``d_v``; plus one bool per
    position and row once a mask is given. A ``KVCache(max_len)`` allocates ``e max_len
    (d + d_v)``.

    Cost of ``append``: quantising ``t`` tokens (and the residual's up to ``group_size -
    1``), ``O(b h t d)``; of the read, dequantising the whole cache, ``O(b h n d)``, the
    order of the attention that follows (a fused kernel dequantises in registers).
    There is no ``truncate``: a channel group once quantised cannot be reopened.
    """

    def __init__(
        self,
        max_len: int,
        *,
        key_granularity: str = "channel",
        value_granularity: str = "token",
        group_size: int = 32,
    ) -> None:
        self.max_len = check_positive_int(max_len, "max_len")
        self.key_granularity = check_choice(key_granularity, "key_granularity", GRANULARITIES)
        self.value_granularity = check_choice(value_granularity, "value_granularity",
                                              GRANULARITIES)
        self.group_size = check_positive_int(group_size, "group_size")
        self.length = 0
        self._keys: _Int8Store | None = None
        self._values: _Int8Store | None = None
        self._padding: torch.Tensor | None = None  # (b, max_len), made at the first mask

    def reset(self) -> None:
        """Start a new sequence: the buffers are kept and reused if the next keys fit."""
        self.length = 0
        self._padding = None
        for store in (self._keys, self._values):
            if store is not None:
                store.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated (0 before the first ``append``)."""
        tensors = [t for s in (self._keys, self._values) if s is not None for t in s.tensors()]
        if self._padding is not None:
            tensors.append(self._padding)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the keys and values held now: int8 numbers, scales and residuals."""
        if self._keys is None:
            return 0
        return self._keys.used_nbytes() + self._values.used_nbytes()

    def _prepare(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        if self._keys is not None:
            same = self._keys.matches(k) and self._values.matches(v)
            if not same and self.length > 0:
                raise ValueError(
                    f"k, v of shapes {tuple(k.shape)}, {tuple(v.shape)} ({k.dtype}, "
                    f"{k.device}) do not continue the cached sequence of shapes "
                    f"{tuple(self._keys.data.shape)}, {tuple(self._values.data.shape)} "
                    f"({self._keys.scales.dtype}); call reset() first")
            if not same:
                self._keys = self._values = self._padding = None
        if self._keys is None:
            self._keys = _Int8Store(k, self.max_len, self.key_granularity, self.group_size)
            self._values = _Int8Store(v, self.max_len, self.value_granularity, self.group_size)
        if not torch.is_inference_mode_enabled():
            for store in (self._keys, self._values):
                store.renew(copy=self.length > 0)
            if self._padding is not None and self._padding.is_inference():
                self._padding = self._padding.clone()
        if mask is not None and self._padding is None:
            self._padding = torch.zeros(k.shape[0], self.max_len, dtype=torch.bool,
                                        device=k.device)

    def append(
        self, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> CachedKeys:
        k, v, mask = _check_block(k, v, key_padding_mask)
        start, t = self.length, k.shape[-2]
        if start + t > self.max_len:
            raise ValueError(
                f"QuantizedKVCache(max_len={self.max_len}) holds {start} tokens and cannot "
                f"take {t} more; make a larger cache")
        self._prepare(k, v, mask)
        self._keys.append(k)
        self._values.append(v)
        stop = self.length = start + t
        blocked = None
        if t > 1:  # key j is after query i (position start + i)
            blocked = torch.ones(t, stop, dtype=torch.bool, device=k.device).triu(start + 1)
        if self._padding is not None:
            self._padding[:, start:stop] = False if mask is None else mask
            padded = self._padding[:, None, None, :stop]  # (b, 1, 1, stop)
            blocked = padded if blocked is None else blocked | padded
        return CachedKeys(self._keys.read(), self._values.read(), blocked)
