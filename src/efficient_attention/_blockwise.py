"""Feature attention computed block by block, with chunked causal prefix sums.

The machinery shared by linear attention (a fixed feature map, :mod:`.linearized`) and
FAVOR+ (random features, :mod:`.performer`): given feature maps for queries and keys,
compute ``D^-1 phi(Q) (phi(K)^T V)`` without ever holding all the features at once,
and, when causal, with prefix sums over chunks instead of an ``n x n`` mask or an
``n x m x d_v`` tensor of running states. The stabilised form for exponential
features lives in :mod:`._stabilised`.

Shapes inside this module are flattened to ``(B, n, x)``: one batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import broadcast_shapes, check_positive_int
from ._padding import zero_padded_rows, zeros_like_result


def default_chunk_size(num_features: int, d_v: int) -> int:
    """Chunk length for causal prefix sums: the power of two ``>= m d_v / (m + d_v)``, >= 16.

    Chunked causal attention keeps one ``m x d_v`` state per chunk, ``n m d_v / C``
    numbers, plus ``C x C`` scores per chunk, ``n C`` numbers. ``C >= m d_v / (m + d_v)``
    keeps the states below ``n (m + d_v)``, the size of the features themselves, while
    a small ``C`` keeps the quadratic in-chunk work ``O(n C (m + d_v))`` small.
    """
    target = num_features * d_v / max(num_features + d_v, 1)
    return max(16, 1 << max(0, math.ceil(math.log2(max(target, 1.0)))))


def default_block_size(batch: int, width: int, n: int, numbers: int = 2**20) -> int:
    """Rows of features computed at a time: about ``numbers`` (default 2^20, 4 MiB in
    float32) per block.

    Blocks of a few MiB stay in cache and reuse freed memory, so the cost is the
    arithmetic, not page faults on large fresh buffers; blocks much smaller than that
    multiply the fixed cost of each operation (on two cores, waking a sleeping OpenMP
    thread costs tens of microseconds per operation). Linear attention uses 2^20 (for
    FAVOR+ at ``n = 8192``, ``B = 8``, ``m = 256`` its 512-row blocks were once the
    fastest); FAVOR+ passes 2^20 per intra-op thread (``performer.favor_block_size``).
    The smallest power of two with ``rows * 2 * batch * width > numbers``, at least 64
    rows, at most ``n`` (and at least 1); 64 rows when ``batch * width = 0``.
    """
    per_row = 2 * batch * width
    rows = 64
    if per_row > 0:
        rows = max(64, 1 << max(0, math.floor(math.log2(numbers / per_row)) + 1))
    return max(1, min(rows, n))


def check_block_sizes(chunk_size: object, block_size: object) -> None:
    """``chunk_size`` and ``block_size`` are ``None`` (the defaults) or positive ints."""
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    if block_size is not None:
        check_positive_int(block_size, "block_size")


def flatten_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
    """Broadcast the batch dimensions and flatten them: ``(..., n, x) -> (B, n, x)``.

    Padded keys and values are replaced by zeros here (``torch.where``), so that NaN or
    inf padding can take no part in any later product.
    """
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        batch = broadcast_shapes(batch, mask.shape[:-1])
        k, v = zero_padded_rows(k, mask), zero_padded_rows(v, mask)
    size = math.prod(batch)
    flat = [t.expand(*batch, *t.shape[-2:]).reshape(size, *t.shape[-2:]) for t in (q, k, v)]
    if mask is not None:
        flat.append(mask.expand(*batch, mask.shape[-1]).reshape(size, mask.shape[-1]))
    else:
        flat.append(None)
    return tuple(batch), flat


def values_with_ones(v: torch.Tensor, mask: torch.Tensor | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``[v, 1]`` ``(..., n_k, d_v + 1)`` with padded rows zero.

    The column of ones carries the normaliser: ``phi(Q) (phi(K)^T [V, 1])`` holds the
    numerators and, in its last column, the denominators ``D``. ``out`` (no autograd): a
    buffer of that shape to write it into.
    """
    ones = v.new_ones(()).expand(*v.shape[:-1], 1)  # no buffer of its own
    if out is None:
        return zero_padded_rows(torch.cat([v, ones], dim=-1), mask)
    torch.cat([v, ones], dim=-1, out=out)
    return out if mask is None else out.masked_fill_(mask.unsqueeze(-1), 0.0)


def divide(
    numerator: torch.Tensor,
    denominator: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``numerator / (denominator + eps)``; with ``eps = 0`` a zero denominator gives 0.

    A zero denominator with positive features means that no key was seen (every key
    padded): the documented output is zeros. NaN denominators stay NaN. ``out`` (no
    autograd) receives the result without a copy.
    """
    if eps > 0:
        return torch.div(numerator, denominator + eps, out=out)
    return torch.div(numerator, torch.where(denominator == 0, 1.0, denominator), out=out)


def causal_prefix_products(
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
    # (B * chunks, C, x): bmm takes transposed operands as they are (matmul would copy)
    q_c = phi_q.reshape(batch * chunks, size, m)
    k_c = phi_k.reshape(batch * chunks, size, m)
    v_c = values.reshape(batch * chunks, size, e)
    states = torch.bmm(k_c.transpose(-2, -1), v_c).view(batch, chunks, m, e)  # chunk states
    # Exclusive prefix sums (everything before the chunk, from S_0), summed directly:
    # taking "inclusive - states" instead would cancel catastrophically when a chunk's
    # state dwarfs the earlier ones (weights spanning many orders of magnitude).
    first = (states.new_zeros(batch, 1, m, e) if initial_state is None
             else initial_state.unsqueeze(1))
    prefix = torch.cat([first, states[:, :-1]], dim=1).cumsum_(dim=1)  # (B, chunks, m, e)
    final = prefix[:, -1] + states[:, -1]  # (B, m, e)
    position = torch.arange(size, device=phi_q.device)
    future = position.unsqueeze(-1) < position  # (C, C), True above the diagonal (j > i)
    # masked_fill rather than tril: CPU tril on many small matrices is very slow.
    scores = torch.bmm(q_c, k_c.transpose(-2, -1)).masked_fill_(future, 0.0)  # (B chunks, C, C)
    # scores @ v_c + q_c @ prefix, the sum accumulated by the second product itself (in
    # place without autograd: no copy of the first product)
    local = torch.bmm(scores, v_c)  # (B * chunks, C, e)
    prefix = prefix.view(batch * chunks, m, e)
    if torch.is_grad_enabled() and (local.requires_grad or q_c.requires_grad
                                    or prefix.requires_grad):
        out = torch.baddbmm(local, q_c, prefix)
    else:
        out = local.baddbmm_(q_c, prefix)
    return out.reshape(batch, chunks * size, e)[:, :n], final


FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: FeatureMap,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    eps: float,
    block_size: int,
    chunk_size: int | None,
) -> torch.Tensor:
    r"""``D^-1 phi(Q) (phi(K)^T V)`` for a feature map ``phi``, ``block_size`` rows at a time.

    q ``(B, n_q, d)``, k ``(B, n_k, d)``, v ``(B, n_k, d_v)`` (v in the compute dtype,
    padded rows already zero), mask ``(B, n_k)`` or None -> ``(B, n_q, d_v)``.

    Keys are reduced block by block into the state ``phi(K)^T [V, 1]`` (``m x (d_v +
    1)``, the last column giving ``D``); padded keys get a zero feature row. Causal
    blocks add their in-block prefix products (:func:`causal_prefix_products`) on top
    of the state of the earlier blocks.

    Memory: one block of features at a time in the forward pass (autograd keeps the
    features, ``O(n m)``, and one ``m x d_v`` state per block or chunk).
    """
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    if n_k == 0 or n_q == 0 or q.shape[0] == 0:  # no keys: zeros (as fully padded rows)
        return zeros_like_result((q.shape[0], n_q, d_v), q, k, v)
    outputs = []
    state: torch.Tensor | None = None  # (B, m, d_v + 1)

    def key_features(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask_b = None if mask is None else mask[:, start:stop]
        phi = zero_padded_rows(features(k[:, start:stop]), mask_b)  # (B, b, m)
        return phi, values_with_ones(v[:, start:stop], mask_b)  # (B, b, d_v + 1)

    for start in range(0, n_k, block_size):
        stop = min(start + block_size, n_k)
        phi_k, values = key_features(start, stop)
        if causal:
            phi_q = features(q[:, start:stop])  # (B, b, m)
            chunk = chunk_size or default_chunk_size(phi_k.shape[-1], d_v + 1)
            both, state = causal_prefix_products(phi_q, phi_k, values, chunk, state)
            outputs.append(divide(both[..., :-1], both[..., -1:], eps))
        else:
            contribution = phi_k.transpose(-2, -1) @ values  # (B, m, d_v + 1)
            state = contribution if state is None else state + contribution
    if not causal:
        for start in range(0, n_q, block_size):
            both = features(q[:, start : start + block_size]) @ state  # (B, b, d_v + 1)
            outputs.append(divide(both[..., :-1], both[..., -1:], eps))
    return torch.cat(outputs, dim=1)  # (B, n_q, d_v)
