"""Exact (quadratic) attention: the reference every efficient method is checked against.

Shapes follow ``(..., n, d)``: any leading batch dimensions (batch, heads), then
the sequence, then the features.

Reference: Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._checks import (
    check_bool,
    check_causal_lengths,
    check_key_padding_mask,
    check_module_input,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_real,
    check_tensor,
    compute_dtype,
)
from ._padding import zero_padded_rows
from .attention_sinks import SinkKVCache
from .kv_cache import KVCache, SlidingWindowKVCache, cached_attention
from .quantized_cache import QuantizedKVCache

__all__ = [
    "default_device",
    "causal_mask",
    "softmax_attention",
    "argmax_attention",
    "MultiHeadAttention",
]


def default_device() -> torch.device:
    """CUDA when a GPU is visible, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def causal_mask(n: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``(n, n)`` mask that is ``True`` where query ``i`` may *not* see key ``j`` (j > i).

    This is the PyTorch convention for masks that remove entries (``True`` = masked).
    ``n = 0`` gives the empty ``(0, 0)`` mask.
    """
    check_nonnegative_int(n, "n")
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(diagonal=1)


def _masked_positions(
    n_q: int, causal: bool, mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Bool ``(..., n_q, n_k)`` (broadcastable), ``True`` where a query may not see a key."""
    masked = causal_mask(n_q, device=device) if causal else None
    if mask is not None:
        padded = mask.unsqueeze(-2)  # (..., 1, n_k)
        masked = padded if masked is None else masked | padded
    return masked


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax attention ``softmax(q k^T * scale + mask) v``.

    .. math::
        \mathrm{out}_i = \sum_j \frac{\exp(s\, q_i^\top k_j)}{\sum_l \exp(s\, q_i^\top k_l)} v_j

    with ``s = scale`` (default ``1/sqrt(d)``).

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``.
        causal: query ``i`` sees only keys ``j <= i`` (needs ``n_q == n_k``).
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` where the key is
            padding; padded keys get zero weight.
        scale: multiplies the scores; ``None`` means ``1/sqrt(d)``.
        return_weights: also return the ``(..., n_q, n_k)`` attention matrix.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``, and the weights when
        ``return_weights``. A query whose keys are all masked (or with ``n_k = 0``) gets
        an output of zeros and a row of zero weights. Every other NaN or inf propagates
        as in ``torch.nn.functional.scaled_dot_product_attention``: a NaN in ``q``, in an
        unmasked key or value, or a NaN ``scale`` gives NaN outputs. (As in SDPA, a
        non-finite *unpadded* value can also reach an output that gives it weight zero,
        ``0 * NaN = NaN``: for instance a later value in causal attention. Padded keys
        and values never do.)

    ``q`` is multiplied by ``scale`` before the product, so that the scores are formed
    at their final size (no overflow of ``q k^T`` in float16 when ``q k^T / sqrt(d)``
    fits); half-precision inputs are computed in float32.

    Cost: time ``O(n_q n_k (d + d_v))``, memory ``O(n_q n_k)`` for the weights.
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    return_weights = check_bool(return_weights, "return_weights")
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    scale = q.shape[-1] ** -0.5 if scale is None else check_real(scale, "scale")
    n_q = q.shape[-2]
    if causal:
        check_causal_lengths(n_q, k.shape[-2])
    dtype = compute_dtype(q)
    # Padded rows become zeros before any product, so that NaN or inf there cannot leak.
    k, v = zero_padded_rows(k, mask).to(dtype), zero_padded_rows(v, mask).to(dtype)
    # Scale q before the product: scores of size |q| |k| / sqrt(d), not |q| |k|.
    scores = (q.to(dtype) * scale) @ k.transpose(-2, -1)  # (..., n_q, n_k)
    masked = _masked_positions(n_q, causal, mask, q.device)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
        # A row with no key left is all -inf, and softmax would give 0 / 0 = NaN there:
        # such rows get the documented zero output instead. Any other NaN stays.
        empty = masked.all(dim=-1, keepdim=True)  # (..., n_q, 1)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    out = (weights @ v).to(q.dtype)
    return (out, weights.to(q.dtype)) if return_weights else out


def argmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hard attention: each query returns the value of its highest-scoring key.

    ``out_i = v_{j*}`` with ``j* = argmax_j q_i^T k_j`` (first index on ties).
    The output is piecewise constant in ``q`` and ``k``: its gradients with respect
    to them are zero almost everywhere, which is why it cannot be trained by
    gradient descent.

    Shapes: q ``(..., n_q, d)``, k ``(..., n_k, d)``, v ``(..., n_k, d_v)`` ->
    ``(..., n_q, d_v)``; ``n_k = 0`` raises ``ValueError`` (nothing to select), and a
    query with a NaN score gets a NaN output. Cost: time ``O(n_q n_k d)``, memory
    ``O(n_q n_k)``.
    """
    q, k, v = check_qkv(q, k, v)
    n_k = k.shape[-2]
    if n_k == 0:
        raise ValueError(
            f"argmax_attention needs at least one key to select, got k.shape={tuple(k.shape)}"
        )
    scores = q @ k.transpose(-2, -1)  # (..., n_q, n_k)
    one_hot = torch.nn.functional.one_hot(scores.argmax(dim=-1), n_k).to(v.dtype)
    out = one_hot @ v  # (..., n_q, d_v)
    # argmax skips nothing and picks a NaN score as the largest: say so with a NaN row.
    undefined = scores.isnan().any(dim=-1, keepdim=True)  # (..., n_q, 1)
    return out.masked_fill(undefined, float("nan"))


AttentionFn = Callable[..., torch.Tensor]
# The caches MultiHeadAttention.decode takes: append(k, v, key_padding_mask) -> CachedKeys.
DecodingCache = KVCache | SlidingWindowKVCache | SinkKVCache | QuantizedKVCache


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a pluggable attention function, and shared key-value heads.

    ``x (..., n, d_model)`` is projected to queries, keys and values, split into
    ``num_heads`` query heads of size ``d_head = d_model // num_heads`` (shape
    ``(..., h, n, d_head)``) and ``num_kv_heads`` key-value heads (``(..., h_kv, n,
    d_head)``); each query head runs ``attention(q, k, v, **kwargs)`` with the key-value
    head of its group, and the heads are concatenated and projected back.

    Args:
        d_model: model width.
        num_heads: number of query heads; must divide ``d_model``.
        attention: a function ``(q, k, v, **kwargs) -> out`` on ``(..., n, d_head)``
            tensors, e.g. :func:`softmax_attention` (the default) or any efficient
            attention of this package. Keyword arguments given to :meth:`forward`
            (``causal``, ``key_padding_mask``) are passed on.
        bias: use biases in the projections.
        num_kv_heads: key-value heads ``h_kv``, a divisor of ``num_heads``; ``None`` (the
            default) means ``num_heads`` (multi-head attention), ``1`` gives multi-query
            attention (Shazeer, 2019), values in between grouped-query attention (Ainslie
            et al., 2023). Query head ``i`` uses key-value head ``i // (h / h_kv)``. The
            key and value projections are ``d_model x h_kv d_head``, and a KV cache holds
            ``h / h_kv`` times fewer numbers.

    ``forward(x, context=None, *, causal=False, key_padding_mask=None)``: with
    ``context`` given, keys and values come from it (cross-attention).
    ``key_padding_mask`` has shape ``(batch, n_k)``, ``True`` = padding. With shared heads
    the attention function gets ``(..., h_kv, h / h_kv, n, d_head)`` tensors, the keys and
    values expanded over the group without a copy.

    ``decode(x, cache, *, key_padding_mask=None)``: incremental decoding with a
    :class:`~efficient_attention.kv_cache.KVCache` (see :meth:`decode`).

    Cost: projections ``O(n d_model (2 d_model + 2 h_kv d_head))``, plus the attention.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        attention: AttentionFn = softmax_attention,
        *,
        bias: bool = True,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(d_model, "d_model")
        check_positive_int(num_heads, "num_heads")
        if d_model % num_heads != 0:
            raise ValueError(
                f"num_heads must divide d_model, got d_model={d_model} and num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads must divide num_heads (each group of query heads shares one "
                f"key-value head), got num_heads={num_heads} and num_kv_heads={num_kv_heads}"
            )
        if not callable(attention):
            raise TypeError(f"attention must be callable, got {type(attention).__name__}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.d_head = d_model // num_heads
        self.attention = attention
        kv_width = num_kv_heads * self.d_head
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        # (..., n, heads * d_head) -> (..., heads, n, d_head)
        *batch, n, _ = x.shape
        return x.reshape(*batch, n, heads, self.d_head).transpose(-3, -2)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        # (..., h, n, d_head) -> (..., n, h * d_head), then the output projection
        *batch, h, n, d_head = out.shape
        return self.out_proj(out.transpose(-3, -2).reshape(*batch, n, h * d_head))

    def _check_input(self, x: object, name: str, min_dim: int = 2) -> torch.Tensor:
        x = check_tensor(x, name, min_dim=min_dim)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} must have last dimension d_model={self.d_model}, "
                f"got shape {tuple(x.shape)}"
            )
        return check_module_input(x, name, self)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        x = self._check_input(x, "x")
        context = x if context is None else self._check_input(context, "context")
        q = self._split(self.q_proj(x), self.num_heads)  # (..., h, n_q, d_head)
        k = self._split(self.k_proj(context), self.num_kv_heads)  # (..., h_kv, n_k, d_head)
        v = self._split(self.v_proj(context), self.num_kv_heads)  # (..., h_kv, n_k, d_head)
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # (..., h_kv, g, n, d_head): the group's queries share one k and v
            q = q.unflatten(-3, (self.num_kv_heads, group))
            k = k.unsqueeze(-3).expand(*k.shape[:-2], group, *k.shape[-2:])  # a view, no copy
            v = v.unsqueeze(-3).expand(*v.shape[:-2], group, *v.shape[-2:])
        kwargs = dict(attention_kwargs)
        if check_bool(causal, "causal"):
            kwargs["causal"] = True
        if key_padding_mask is not None:
            expected = tuple(context.shape[:-1])
            check_key_padding_mask(key_padding_mask, context.shape, context.device)
            if tuple(key_padding_mask.shape) != expected:
                raise ValueError(
                    f"key_padding_mask must have shape (batch, n_k)={expected}, "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            heads = (1, 1) if group > 1 else (1,)  # broadcast over (h_kv, g) or h
            kwargs["key_padding_mask"] = key_padding_mask.reshape(
                *expected[:-1], *heads, expected[-1])
        out = self.attention(q, k, v, **kwargs)  # (..., h, n_q, d_head) or (..., h_kv, g, ...)
        if group > 1:
            out = out.flatten(-4, -3)  # (..., h, n_q, d_head): head i = (i // g, i % g)
        return self._merge(out)

    def decode(
        self,
        x: torch.Tensor,
        cache: DecodingCache,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``t`` new tokens to the cached ones and themselves; cache their keys.

        ``x (batch, t, d_model)`` holds the tokens at positions ``L .. L+t-1`` after the
        ``L = cache.length`` tokens already cached (``t`` = the prompt for the prefill,
        ``t = 1`` per generated token). Their keys and values are appended to ``cache``
        and new query ``i`` attends, with exact softmax attention
        (:func:`~efficient_attention.kv_cache.cached_attention`), to every cached key
        and the new keys up to position ``L + i``. Prefill plus decoding in any chunks
        gives the rows of ``forward(whole, causal=True)`` (with a
        :class:`~efficient_attention.kv_cache.SlidingWindowKVCache` of window ``w``: of
        the causal band of ``banded_attention`` with ``bandwidth = w``; with a
        :class:`~efficient_attention.attention_sinks.SinkKVCache`, of the same band plus
        the first tokens; with a
        :class:`~efficient_attention.quantized_cache.QuantizedKVCache`, of attention
        over the int8-rounded keys and values).

        ``key_padding_mask (batch, t)``, ``True`` at padding tokens: no later query sees
        them, as with ``forward(..., key_padding_mask=...)``.

        Returns ``(batch, t, d_model)``. Needs ``attention=softmax_attention``: the cache
        computes exact softmax attention, not the module's approximation. Cost per call:
        projections ``O(t d_model^2)`` and attention ``O(h t (L + t) d_head)``, memory
        bound for small ``t`` (every cached number is read once per call).
        """
        if self.attention is not softmax_attention:
            name = getattr(self.attention, "__name__", type(self.attention).__name__)
            raise TypeError(
                "decode computes exact softmax attention over the cache; build the module "
                f"with attention=softmax_attention, got attention={name}"
            )
        if not isinstance(cache, DecodingCache):
            raise TypeError(
                "cache must be a KVCache, SlidingWindowKVCache, SinkKVCache or "
                f"QuantizedKVCache, got {type(cache).__name__}"
            )
        x = self._check_input(x, "x", min_dim=3)
        if x.dim() != 3:
            raise ValueError(f"x must have shape (batch, t, d_model), got {tuple(x.shape)}")
        q = self._split(self.q_proj(x), self.num_heads)  # (b, h, t, d_head)
        k = self._split(self.k_proj(x), self.num_kv_heads)  # (b, h_kv, t, d_head)
        v = self._split(self.v_proj(x), self.num_kv_heads)  # (b, h_kv, t, d_head)
        visible = cache.append(k, v, key_padding_mask)
        return self._merge(cached_attention(q, visible))  # (b, t, d_model)
