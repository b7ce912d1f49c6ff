r"""Attention with exponential features, stabilised so that nothing overflows or underflows.

FAVOR+ features are exponentials: the weight of key ``j`` for query ``i`` is

.. math:: W_{ij} = \sum_l s_{il}\, t_{jl}\, \exp(a_{il} + b_{jl})

with log-magnitudes ``a (n_q, m)``, ``b (n_k, m)`` and signs (or cosines) ``s, t``
(``s = t = 1`` for positive features). ``exp(a)`` and ``exp(b)`` alone over- or
underflow for large inputs, and the output ``sum_j W_ij v_j / sum_j W_ij`` only needs
``W_ij`` up to a factor common to row ``i``. The stabilisation, exact in exact
arithmetic:

* **Per-feature key constants.** ``c_l = max_j b_jl`` over the keys a query may see
  (unpadded keys; when causal, only keys ``j <= i``). Key features ``t_jl exp(b_jl -
  c_l)`` are at most 1 and the key reaching the maximum has a feature equal to 1.
* **Per-query constants.** ``M_i = max_l (a_il + c_l)``, the log of the largest term
  of row ``i``. Query features ``s_il exp(a_il + c_l - M_i)`` are at most 1.

Their product is ``exp(-M_i) W_ij``: one factor per row, which cancels between the
numerator and the denominator. The largest term of each row is exactly 1, so a query
with at least one unmasked key has a positive-feature denominator ``>= 1``: no 0 / 0,
no zero row. (A single common key constant, or constants that include keys a query
may not see, would let every term of a row underflow.)

Blocks and chunks. Keys arrive block by block (``block_size`` rows). Bidirectional:
the state ``S_l = sum_j exp(b_jl - c_l) [v_j, 1]`` is kept relative to the running
maximum ``c_l``; when a block raises it, row ``l`` of ``S`` is multiplied by
``exp(c_l^old - c_l^new)`` (as in online softmax), so after the last block ``S`` is
exactly the sum relative to the global ``c_l``, whatever the blocks.

Causal: ``c_l(i) = max_{j <= i} b_jl`` (a running maximum, ``cummax``), so no future
key enters any constant. Queries are cut into chunks of ``C`` positions. For chunk
``[t, t + C)`` let ``p_l = c_l(t - 1)`` (keys before the chunk) and ``r_l = c_l(t + C -
1)`` (through its end). Query ``i`` of the chunk gets

.. math::
    \exp(-M_i) \sum_{j \le i} W_{ij} [v_j, 1]
    = \sum_l s_{il} e^{a_{il} + p_l - M_i} P_l
    + \sum_{t \le j \le i} \Big(\sum_l s_{il} e^{a_{il} + r_l - M_i}\,
      t_{jl} e^{b_{jl} - r_l}\Big) [v_j, 1],

with ``M_i = max_l (a_il + c_l(i))`` and the prefix state ``P_l = sum_{j < t}
exp(b_jl - p_l) [v_j, 1]``, carried from chunk to chunk by ``P <- exp(p - r) P +
sum_{chunk} t_j exp(b_j - r) [v_j, 1]`` (each row ``l`` rescaled, exactly as above).
Both sides of each equation are equal term by term, so the result does not depend on
``block_size`` or ``C`` beyond rounding. Every factor is at most 1 except
``exp(a_il + r_l - M_i) <= exp(r_l - c_l(i))``, large only when a later key of the same
chunk raises the maximum a lot; when that exponent exceeds 30 anywhere in a block, the
block is redone with chunks half as long (down to ``C = 1``, where ``r_l = c_l(i)`` and
the factor is at most 1), which changes nothing but rounding.

Shapes are flattened to ``(B, n, x)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._blockwise import default_chunk_size, divide, values_with_ones
from ._padding import zeros_like_result

# (log-magnitude (B, b, m) or (B, b, 1) or None for 0, signed part (B, b, m) or None for 1)
LogFeatures = tuple[torch.Tensor | None, torch.Tensor | None]
LogFeatureMap = Callable[[torch.Tensor], LogFeatures]

_FLOOR = -1e30  # constant of a feature no key has reached yet: exp(-inf - _FLOOR) = 0
_SAFE_EXPONENT = 30.0  # largest in-chunk query exponent allowed before chunks are halved


def _features_(log: torch.Tensor, signed: torch.Tensor | None) -> torch.Tensor:
    """``signed * exp(log)`` (``exp(log)`` when there is no signed part); ``log`` must be
    a fresh tensor: it is overwritten (in place, so one block of features costs one
    buffer)."""
    return log.exp_() if signed is None else signed * log.exp_()


def _without_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows where ``rows (B, b, 1)`` holds set to ``-inf`` (feature 0)."""
    return x.masked_fill_(rows, float("-inf")) if bool(rows.any()) else x


def _plus(log: torch.Tensor | None, constant: torch.Tensor) -> torch.Tensor:
    """``log + constant`` with ``None`` standing for a zero log-magnitude."""
    return constant if log is None else log + constant


def _key_logs(
    key_features: LogFeatureMap, k: torch.Tensor, mask: torch.Tensor | None
) -> LogFeatures:
    """Key log-features with padded keys at ``-inf`` (feature 0, never in a maximum)."""
    log, signed = key_features(k)
    if mask is not None:
        log = log.masked_fill(mask.unsqueeze(-1), float("-inf"))
    return log, signed


def _bidirectional(q, k, v, query_features, key_features, mask, block_size):
    constant = None  # (B, 1, w): running per-feature maximum c_l
    state = None  # (B, m, d_v + 1), relative to exp(constant)
    for start in range(0, k.shape[1], block_size):
        mask_b = None if mask is None else mask[:, start : start + block_size]
        log, signed = _key_logs(key_features, k[:, start : start + block_size], mask_b)
        top = log.detach().amax(dim=-2, keepdim=True)  # (B, 1, w)
        new = top.clamp_min(_FLOOR) if constant is None else torch.maximum(constant, top)
        phi_k = _features_(log.sub_(new), signed)  # (B, b, m), entries <= 1
        values = values_with_ones(v[:, start : start + block_size], mask_b)
        contribution = phi_k.transpose(-2, -1) @ values  # (B, m, d_v + 1)
        if state is None:
            state = contribution
        else:  # re-express the old sums relative to the new maximum, feature by feature
            state = state * torch.exp(constant - new).transpose(-2, -1) + contribution
        constant = new
    outputs = []
    for start in range(0, q.shape[1], block_size):
        log, signed = query_features(q[:, start : start + block_size])
        shifted = constant.clone() if log is None else log.add_(constant)  # (B, b, w)
        top = shifted.detach().amax(dim=-1, keepdim=True)  # (B, b, 1): M_i
        exponent = _without_rows(shifted.sub_(top), _no_key_yet(constant))
        both = _features_(exponent, signed) @ state  # (B, b, d_v + 1)
        outputs.append(divide(both[..., :-1], both[..., -1:], 0.0))
    return torch.cat(outputs, dim=1)


def _pad_rows(x: torch.Tensor | None, rows: int, value: float) -> torch.Tensor | None:
    """``x (B, b, w)`` with ``rows`` more rows of ``value`` (padding to whole chunks)."""
    if x is None or rows == 0:
        return x
    return F.pad(x, (0, 0, 0, rows), value=value)


def _no_key_yet(constant: torch.Tensor) -> torch.Tensor:
    """``True`` where every feature constant is still the floor: no key seen (all padded)."""
    return constant.amax(dim=-1, keepdim=True) <= _FLOOR


def _causal_block(log_a, signed_q, log_b, signed_k, values, carried, chunk):
    """One block of causal rows; ``carried`` = (constant (B, 1, w), state (B, m, e)) or None.

    Returns the numerators and denominators ``(B, b, e)`` and the new ``carried``.
    """
    batch, rows = log_b.shape[:2]
    width = (signed_k if signed_k is not None else log_b).shape[-1]
    running = torch.cummax(log_b.detach(), dim=-2).values  # (B, b, w): c_l(i)
    if carried is None:
        previous = torch.full_like(running[:, :1], _FLOOR)  # (B, 1, w)
        state = values.new_zeros(batch, width, values.shape[-1])
    else:
        previous, state = carried
    running = torch.maximum(running, previous)
    top = _plus(log_a, running).detach().amax(dim=-1, keepdim=True)  # (B, b, 1): M_i
    no_key = _no_key_yet(running)  # (B, b, 1): these rows get 0 / 0 -> 0
    size = min(chunk, rows)
    while True:  # halve the chunks while a later key of a chunk outgrows a query by e^30
        chunks = -(-rows // size)
        ends = (torch.arange(1, chunks + 1, device=log_b.device) * size).clamp_max(rows) - 1
        through = running[:, ends]  # (B, chunks, w): r_l of each chunk
        r_rows = through.repeat_interleave(size, dim=1)[:, :rows]  # (B, b, w)
        q_inner = _plus(log_a, r_rows) - top
        if size == 1 or not bool(q_inner.detach().amax() > _SAFE_EXPONENT):
            break
        size = max(1, size // 2)
    q_inner = _without_rows(q_inner, no_key)
    before = torch.cat([previous, through[:, :-1]], dim=1)  # (B, chunks, w): p_l
    p_rows = before.repeat_interleave(size, dim=1)[:, :rows]
    q_state = _without_rows(_plus(log_a, p_rows) - top, no_key)  # <= 0
    k_inner = log_b - r_rows  # <= 0; -inf for padded keys
    pad = chunks * size - rows  # rows to whole chunks: features 0, outputs dropped
    q_inner, q_state, k_inner = (_pad_rows(t, pad, float("-inf")) for t in
                                 (q_inner, q_state, k_inner))
    signed_q, signed_k, values = (_pad_rows(t, pad, 0.0) for t in (signed_q, signed_k, values))
    e = values.shape[-1]

    def split(x: torch.Tensor) -> torch.Tensor:  # (B, chunks * C, x) -> (B, chunks, C, x)
        return x.reshape(batch, chunks, size, x.shape[-1])

    phi_k = split(_features_(k_inner, signed_k))  # (B, chunks, C, m), entries <= 1
    values_c = split(values)  # (B, chunks, C, e)
    future = torch.ones(size, size, dtype=torch.bool, device=log_b.device).triu(diagonal=1)
    scores = split(_features_(q_inner, signed_q)) @ phi_k.transpose(-2, -1)  # (B, chunks, C, C)
    inner = scores.masked_fill(future, 0.0) @ values_c  # (B, chunks, C, e)
    # Prefix states P before each chunk, rescaled feature by feature as the maximum grows.
    sums = phi_k.transpose(-2, -1) @ values_c  # (B, chunks, m, e), relative to r
    decay = torch.exp(before - through).unsqueeze(-1)  # (B, chunks, w, 1), <= 1
    prefixes = []
    for c in range(chunks):
        prefixes.append(state)
        state = state * decay[:, c] + sums[:, c]
    out = split(_features_(q_state, signed_q)) @ torch.stack(prefixes, dim=1) + inner
    return out.reshape(batch, chunks * size, e)[:, :rows], (through[:, -1:], state)


def stabilised_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_features: LogFeatureMap,
    key_features: LogFeatureMap,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    block_size: int,
    chunk_size: int | None,
) -> torch.Tensor:
    """``D^-1 phi(Q) (phi(K)^T V)`` for exponential features given by their logs.

    q ``(B, n_q, d)``, k ``(B, n_k, d)``, v ``(B, n_k, d_v)`` (compute dtype, padded
    rows already zero), mask ``(B, n_k)`` or None -> ``(B, n_q, d_v)``. The feature maps
    return ``(log, signed)`` with the feature ``signed * exp(log)``, any constant per
    query row dropped. A query with no unmasked key gets zeros.

    Memory: one block of features at a time in the forward pass; autograd keeps the
    features ``O(n m)`` and, when causal, one ``m x (d_v + 1)`` state per chunk.
    """
    n_q, n_k, d_v = q.shape[1], k.shape[1], v.shape[2]
    if n_q == 0 or n_k == 0 or q.shape[0] == 0:  # empty, or zeros for queries with no key
        return zeros_like_result((q.shape[0], n_q, d_v), q, k, v)
    if not causal:
        return _bidirectional(q, k, v, query_features, key_features, mask, block_size)
    outputs, carried = [], None
    for start in range(0, n_k, block_size):
        stop = min(start + block_size, n_k)
        mask_b = None if mask is None else mask[:, start:stop]
        log_b, signed_k = _key_logs(key_features, k[:, start:stop], mask_b)
        log_a, signed_q = query_features(q[:, start:stop])
        values = values_with_ones(v[:, start:stop], mask_b)
        width = (signed_k if signed_k is not None else log_b).shape[-1]
        chunk = chunk_size or default_chunk_size(width, d_v + 1)
        both, carried = _causal_block(log_a, signed_q, log_b, signed_k, values, carried, chunk)
        outputs.append(divide(both[..., :-1], both[..., -1:], 0.0))
    return torch.cat(outputs, dim=1)
