"""Feature attention computed block by block, with chunked causal prefix sums.

The machinery shared by :func:`~efficient_attention.linear_attention` (a fixed feature
map) and :func:`~efficient_attention.favor_attention` (random features): given feature
maps for queries and keys, compute ``D^-1 phi(Q) (phi(K)^T V)`` without ever holding
all the features at once, and, when causal, with prefix sums over chunks instead of an
``n x n`` mask or an ``n x m x d_v`` tensor of running states.

Shapes inside this module are flattened to ``(B, n, x)``: one batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import check_positive_int


def _check_causal_lengths(n_q: int, n_k: int) -> None:
    if n_q != n_k:
        raise ValueError(f"causal=True needs as many queries as keys, got n_q={n_q} and n_k={n_k}")


def default_chunk_size(num_features: int, d_v: int) -> int:
    """Chunk length for causal prefix sums: the power of two ``>= m d_v / (m + d_v)``, >= 16.

    Chunked causal attention keeps one ``m x d_v`` state per chunk, ``n m d_v / C``
    numbers, plus ``C x C`` scores per chunk, ``n C`` numbers. ``C >= m d_v / (m + d_v)``
    keeps the states below ``n (m + d_v)``, the size of the features themselves, while
    a small ``C`` keeps the quadratic in-chunk work ``O(n C (m + d_v))`` small.
    """
    target = num_features * d_v / (num_features + d_v)
    size = 16
    while size < target:
        size *= 2
    return size


def default_block_size(batch: int, width: int, n: int) -> int:
    """Rows of features computed at a time: about 2^20 numbers (4 MiB in float32) per block.

    Blocks of a few MiB stay in cache and reuse freed memory, so the cost is the
    arithmetic, not page faults on large fresh buffers; blocks much smaller than that
    multiply the fixed cost of each operation (on two cores, waking a sleeping OpenMP
    thread costs tens of microseconds per operation). Measured for FAVOR+ at
    ``n = 8192``, ``B = 8``, ``m = 256`` (``benchmarks/attention_speed.py``): 512-row
    blocks are the fastest or within 5% of it, whether idle OpenMP threads spin or sleep.
    At least 64 rows; at most ``n``.
    """
    rows = 64
    while rows * 2 * batch * width <= 2**20:
        rows *= 2
    return max(1, min(rows, n))


def _causal_prefix_products(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    values: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``out_i = phi_q_i^T (S_0 + sum_{j <= i} phi_k_j values_j^T)`` by chunked prefix sums.

    Shapes: phi_q, phi_k ``(B, n, m)``, values ``(B, n, e)``, initial_state ``S_0``
    ``(B, m, e)`` or None -> out ``(B, n, e)`` and the final state ``(B, m, e)``.
    Split the sequence into chunks of ``C``. Within a chunk the masked ``C x C``
    product is computed directly; across chunks, chunk ``c`` sees the exclusive prefix
    sum ``S_c = S_0 + sum_{c' < c} phi_k_{c'}^T values_{c'}`` (``m x e``).

    Cost: time ``O(n (m e + C (m + e)))``; memory (and what autograd saves)
    ``O(n m e / C + n C + n (m + e))`` -- never ``n x n`` and never ``n x m x e``.
    """
    batch, n, m = phi_q.shape
    e = values.shape[-1]
    size = min(chunk_size, n)
    pad = (-n) % size
    if pad:  # zero rows add nothing to any sum; the padded outputs are dropped
        phi_q, phi_k, values = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, values))
    chunks = (n + pad) // size
    q_c = phi_q.reshape(batch, chunks, size, m)
    k_c = phi_k.reshape(batch, chunks, size, m)
    v_c = values.reshape(batch, chunks, size, e)
    states = k_c.transpose(-2, -1) @ v_c  # (B, chunks, m, e): one state per chunk
    # Exclusive prefix sums (everything before the chunk), summed directly: taking
    # "inclusive - states" instead would cancel catastrophically when a chunk's state
    # dwarfs the earlier ones (weights spanning many orders of magnitude).
    shifted = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)
    prefix = shifted.cumsum(dim=1)  # (B, chunks, m, e)
    final = prefix[:, -1] + states[:, -1]  # (B, m, e)
    if initial_state is not None:
        prefix = prefix + initial_state.unsqueeze(1)
        final = final + initial_state
    position = torch.arange(size, device=phi_q.device)
    future = position.unsqueeze(-1) < position  # (C, C), True above the diagonal (j > i)
    # masked_fill rather than tril: CPU tril on many small matrices is very slow.
    scores = (q_c @ k_c.transpose(-2, -1)).masked_fill(future, 0.0)  # (B, chunks, C, C)
    out = q_c @ prefix + scores @ v_c  # (B, chunks, C, e)
    return out.reshape(batch, chunks * size, e)[:, :n], final


def _values_with_ones(v: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``[v, 1]`` ``(..., n_k, d_v + 1)`` with padded rows zeroed (so NaN padding cannot leak).

    The column of ones carries the normaliser: ``phi(Q) (phi(K)^T [V, 1])`` holds the
    numerators and, in its last column, the denominators ``D``.
    """
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    values = torch.cat([v, ones], dim=-1)
    if key_padding_mask is not None:
        values = values.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
    return values


# query_features(q_block) -> phi_q (B, b, m), any positive constant per row allowed.
QueryFeatures = Callable[[torch.Tensor], torch.Tensor]
# key_features(k_block, mask_block, top) -> (phi_k, new_top): phi_k (B, b, m) with padded
# rows zero, such that the true features are phi_k * exp(new_top), where new_top
# (B, 1, 1) is max(top, this block's largest log-feature), finite (a block of padding
# only gives a very negative number, not -inf); None when not stabilised.
KeyFeatures = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None],
]


def _blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_features: QueryFeatures,
    key_features: KeyFeatures,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    eps: float,
    block_size: int,
    chunk_size: int | None,
) -> torch.Tensor:
    r"""``D^-1 phi(Q) (phi(K)^T V)``, features computed ``block_size`` rows at a time.

    q ``(B, n_q, d)``, k ``(B, n_k, d)``, v ``(B, n_k, d_v)`` (v in the compute dtype),
    mask ``(B, n_k)`` or None -> ``(B, n_q, d_v)``.

    Keys are reduced block by block into the state ``S = phi(K)^T V`` and the key sum
    ``z = phi(K)^T 1`` (one ``m x (d_v + 1)`` state ``phi(K)^T [V, 1]`` when causal, the
    last column giving ``D``). Stabilised key features are relative to
    ``exp(top)``, the largest log-feature seen so far; when a block raises ``top`` the
    state is rescaled by ``exp(top_old - top_new)`` (as in online softmax). Every
    output thus uses one common constant for all the keys it sums over, and that
    constant cancels in ``D^-1``. Causal blocks add their in-block prefix products
    (:func:`_causal_prefix_products`) on top of the state of the earlier blocks.

    Memory: one block of features at a time in the forward pass (autograd keeps the
    features, ``O(n m)``, and one ``m x d_v`` state per block or chunk).
    """
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    if n_k == 0:  # no keys: nothing to attend to, zeros as for fully padded rows
        return v.new_zeros(q.shape[0], n_q, d_v)
    # Under no_grad / inference_mode, write each block straight into the output (no final
    # concat). With autograd on, out= is not allowed (w or a feature map may have
    # parameters even when q, k and v do not), so the blocks are concatenated.
    out = None if torch.is_grad_enabled() else v.new_empty(q.shape[0], n_q, d_v)
    outputs = []
    state: torch.Tensor | None = None  # (B, m, d_v + 1) causal; (B, m, d_v) bidirectional
    normaliser: torch.Tensor | None = None  # (B, m, 1) bidirectional: sum of phi(k)
    top: torch.Tensor | None = None  # (B, 1, 1)

    def emit(start: int, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        if eps > 0:
            denominator = denominator + eps
        else:  # every key masked: 0 / 0 -> 0
            denominator = torch.where(denominator == 0, 1.0, denominator)
        if out is None:
            outputs.append(numerator / denominator)
        else:
            torch.div(numerator, denominator, out=out[:, start : start + numerator.shape[1]])

    for start in range(0, n_k, block_size):
        stop = min(start + block_size, n_k)
        mask_b = None if mask is None else mask[:, start:stop]
        phi_k, new_top = key_features(k[:, start:stop], mask_b, top)  # (B, b, m)
        if state is not None and new_top is not None:
            ratio = torch.exp(top - new_top)  # re-express the sums relative to the new top
            state = state * ratio
            normaliser = None if normaliser is None else normaliser * ratio
        top = new_top
        if causal:
            values = _values_with_ones(v[:, start:stop], mask_b)  # (B, b, d_v + 1)
            phi_q = query_features(q[:, start:stop])  # (B, b, m)
            chunk = chunk_size or default_chunk_size(phi_k.shape[-1], d_v + 1)
            both, state = _causal_prefix_products(phi_q, phi_k, values, chunk, state)
            emit(start, both[..., :-1], both[..., -1:])
            continue
        values = v[:, start:stop]
        if mask_b is not None:  # phi_k is already zero there; this keeps NaN padding out
            values = values.masked_fill(mask_b.unsqueeze(-1), 0.0)
        contribution = phi_k.transpose(-2, -1) @ values  # (B, m, d_v)
        key_sum = phi_k.sum(dim=-2).unsqueeze(-1)  # (B, m, 1)
        state = contribution if state is None else state + contribution
        normaliser = key_sum if normaliser is None else normaliser + key_sum
    if not causal:
        state = torch.cat([state, normaliser], dim=-1)  # (B, m, d_v + 1): [S, z]
        for start in range(0, n_q, block_size):
            phi_q = query_features(q[:, start : start + block_size])  # (B, b, m)
            both = phi_q @ state  # (B, b, d_v + 1): numerators and denominators
            emit(start, both[..., :-1], both[..., -1:])
    return out if out is not None else torch.cat(outputs, dim=1)  # (B, n_q, d_v)


def _flatten_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
    """Broadcast the batch dimensions and flatten them: ``(..., n, x) -> (B, n, x)``."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        batch = torch.broadcast_shapes(batch, mask.shape[:-1])
    size = math.prod(batch)
    flat = [t.expand(*batch, *t.shape[-2:]).reshape(size, *t.shape[-2:]) for t in (q, k, v)]
    if mask is not None:
        flat.append(mask.expand(*batch, mask.shape[-1]).reshape(size, mask.shape[-1]))
    else:
        flat.append(None)
    return tuple(batch), flat


def _check_causal_and_block(
    causal: object, n_q: int, n_k: int, chunk_size: object, block_size: object
) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        _check_causal_lengths(n_q, n_k)
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if block_size is not None:
        check_positive_int(block_size, "block_size")
