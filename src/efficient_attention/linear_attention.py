"""Kernelized and linear attention (Katharopoulos et al. 2020).

Replace the softmax weight ``exp(q_i^T k_j / sqrt(d))`` by a kernel ``K(q_i, k_j)``.
If the kernel is an inner product of features, ``K(q, k) = phi(q)^T phi(k)``, the
sums can be regrouped:

    out_i = sum_j phi(q_i)^T phi(k_j) v_j / sum_j phi(q_i)^T phi(k_j)
          = phi(q_i)^T (sum_j phi(k_j) v_j^T) / phi(q_i)^T (sum_j phi(k_j)),

that is ``out = D^-1 phi(Q) (phi(K)^T V)`` with ``D = diag(phi(Q) phi(K)^T 1)``: time
``O(n m d)`` instead of ``O(n^2 d)`` and no ``n x n`` matrix. Causal attention keeps
running sums ``S_i = sum_{j<=i} phi(k_j) v_j^T`` and ``z_i = sum_{j<=i} phi(k_j)``:
a recurrent network whose state has a fixed size ``m x d_v``.

Shapes follow ``(..., n, d)``. Half-precision inputs are computed in float32 and the
result is returned in the input dtype.

Reference: Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention", ICML 2020.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_key_padding_mask, check_positive_int, check_qkv, check_tensor

__all__ = [
    "elu_feature_map",
    "kernelized_attention",
    "linear_attention",
    "RecurrentLinearAttention",
]

_HALF = (torch.float16, torch.bfloat16)

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020).

    Shapes: ``(..., n, d) -> (..., n, d)``. Cost: ``O(n d)``.
    """
    x = check_tensor(x, "x", min_dim=1)
    return F.elu(x) + 1.0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in _HALF else x.dtype


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a number >= 0, got {type(eps).__name__} {eps!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def _check_causal_lengths(n_q: int, n_k: int) -> None:
    if n_q != n_k:
        raise ValueError(f"causal=True needs as many queries as keys, got n_q={n_q} and n_k={n_k}")


def kernelized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: Kernel,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Quadratic reference for attention with any kernel.

    .. math:: \mathrm{out}_i = \frac{\sum_j K(q_i, k_j) v_j}{\sum_j K(q_i, k_j)}

    with ``K = kernel(q, k)`` a ``(..., n_q, n_k)`` matrix; causal and padded entries
    are set to zero first. With :func:`~efficient_attention.softmax_kernel` (scale
    ``1/sqrt(d)``) this is softmax attention. A row whose weights sum to zero (every key
    masked) gets an output of zeros.

    Shapes: q ``(..., n_q, d)``, k ``(..., n_k, d)``, v ``(..., n_k, d_v)`` ->
    ``(..., n_q, d_v)``. Cost: time ``O(n_q n_k (d + d_v))``, memory ``O(n_q n_k)``.
    """
    q, k, v = check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    if not callable(kernel):
        raise TypeError(f"kernel must be callable kernel(q, k), got {type(kernel).__name__}")
    weights = kernel(q, k)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape[-2:]) != (n_q, n_k):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"kernel(q, k) must return (..., n_q, n_k)=(..., {n_q}, {n_k}), got {got}")
    if causal:
        _check_causal_lengths(n_q, n_k)
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(diagonal=1)
        weights = weights.masked_fill(future, 0.0)
    if mask is not None:
        weights = weights.masked_fill(mask.unsqueeze(-2), 0.0)
    total = weights.sum(-1, keepdim=True)  # (..., n_q, 1)
    safe_total = torch.where(total == 0, torch.ones_like(total), total)
    return (weights @ v) / safe_total


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
    """Rows of features computed at a time: about 2^19 numbers (2 MiB in float32) per block.

    Small blocks stay in cache and reuse freed memory, so the cost is the arithmetic,
    not page faults on large fresh buffers. At least 64 rows; at most ``n``.
    """
    rows = 64
    while rows * 2 * batch * width <= 2**19:
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


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap = elu_feature_map,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk_size: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    r"""Linear attention ``out = D^-1 phi(Q) (phi(K)^T V)``, ``D = diag(phi(Q) phi(K)^T 1)``.

    .. math:: \mathrm{out}_i = \frac{\phi(q_i)^\top \sum_j \phi(k_j) v_j^\top}
                                    {\phi(q_i)^\top \sum_j \phi(k_j) + \epsilon}

    with the sums over ``j <= i`` when ``causal``. The feature map is applied to ``q``
    and ``k`` as they are: no ``d^-1/4`` scaling (this is the Katharopoulos form with
    ``phi = elu + 1``); :func:`~efficient_attention.favor_attention` is the version
    that approximates softmax attention.

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``.
        feature_map: ``phi``, maps ``(..., n, d)`` to ``(..., n, m)`` row by row; should
            be non-negative so that ``D > 0``.
        causal: query ``i`` sees keys ``j <= i`` (needs ``n_q == n_k``), computed by
            chunked prefix sums.
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` = padding. A
            padded key's feature row is zeroed, so it is in neither the numerator nor
            the normaliser.
        eps: added to the denominator.
        chunk_size: chunk length ``C`` of the causal prefix sums (default
            :func:`default_chunk_size`).
        block_size: rows of features computed at a time (default
            :func:`default_block_size`); changes speed and memory, not the result.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``.

    Cost: time ``O(n m d_v)`` (+ ``O(n C (m + d_v))`` causal); memory ``O(n (m + d_v))``
    (one block of features at a time without autograd), plus, when causal, one
    ``m x d_v`` state per chunk, ``O(n m d_v / C) <= O(n (m + d_v))`` for the default
    ``C``, kept for the backward pass.
    """
    q, k, v = check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    if not callable(feature_map):
        raise TypeError(f"feature_map must be callable, got {type(feature_map).__name__}")
    eps = _check_eps(eps)
    _check_causal_and_block(causal, q.shape[-2], k.shape[-2], chunk_size, block_size)
    dtype = _compute_dtype(q)
    batch, (q3, k3, v3, mask2) = _flatten_batch(q, k, v, mask)

    def features(x: torch.Tensor) -> torch.Tensor:
        phi = feature_map(x.to(dtype))
        if not isinstance(phi, torch.Tensor) or phi.shape[:-1] != x.shape[:-1]:
            got = tuple(phi.shape) if isinstance(phi, torch.Tensor) else type(phi).__name__
            raise ValueError(
                f"feature_map must map (..., n, d) to (..., n, m), got {tuple(x.shape)} -> {got}"
            )
        return phi

    def key_features(x: torch.Tensor, mask_b: torch.Tensor | None, top: None):
        phi = features(x)
        if mask_b is not None:
            phi = phi.masked_fill(mask_b.unsqueeze(-1), 0.0)
        return phi, None

    size = block_size or default_block_size(q3.shape[0], q.shape[-1], max(q.shape[-2], 1))
    out = _blockwise_attention(
        q3, k3, v3.to(dtype), features, key_features, causal=causal, mask=mask2, eps=eps,
        block_size=size, chunk_size=chunk_size,
    )
    return out.reshape(*batch, q.shape[-2], v.shape[-1]).to(q.dtype)


class RecurrentLinearAttention(nn.Module):
    r"""Causal linear attention as a recurrent network, one token at a time.

    State: ``S = sum_{j <= t} phi(k_j) v_j^T`` (``(..., m, d_v)``) and
    ``z = sum_{j <= t} phi(k_j)`` (``(..., m)``). Each :meth:`step` adds the new key and
    value and returns ``phi(q_t)^T S / (phi(q_t)^T z + eps)``, the same output as
    ``linear_attention(..., causal=True)`` at position ``t``, in ``O(m d_v)`` time and
    memory per token whatever the length of the history.

    Args:
        feature_map: ``phi`` (default :func:`elu_feature_map`).
        eps: added to the denominator, as in :func:`linear_attention`.

    Methods: ``step(q_t, k_t, v_t)`` with ``q_t, k_t`` ``(..., d)`` and ``v_t``
    ``(..., d_v)`` returns ``(..., d_v)``; ``forward(q, k, v)`` runs ``step`` over a
    sequence ``(..., n, d)`` (continuing from the current state) and returns
    ``(..., n, d_v)``; ``reset()`` forgets the state.
    """

    def __init__(self, feature_map: FeatureMap = elu_feature_map, eps: float = 1e-6) -> None:
        super().__init__()
        if not callable(feature_map):
            raise TypeError(f"feature_map must be callable, got {type(feature_map).__name__}")
        self.feature_map = feature_map
        self.eps = _check_eps(eps)
        self.state: torch.Tensor | None = None  # S, (..., m, d_v)
        self.normalizer: torch.Tensor | None = None  # z, (..., m)

    def reset(self) -> None:
        """Forget the history: the next step starts from ``S = 0, z = 0``."""
        self.state = None
        self.normalizer = None

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """Add ``(k_t, v_t)`` to the state and return the output for ``q_t``, ``(..., d_v)``."""
        q_t = check_tensor(q_t, "q_t", min_dim=1)
        k_t = check_tensor(k_t, "k_t", min_dim=1)
        v_t = check_tensor(v_t, "v_t", min_dim=1)
        if q_t.shape[-1] != k_t.shape[-1]:
            raise ValueError(
                f"q_t and k_t must have the same last dimension d, got {tuple(q_t.shape)} "
                f"and {tuple(k_t.shape)}"
            )
        dtype = _compute_dtype(q_t)
        phi_q = self.feature_map(q_t.to(dtype))  # (..., m)
        phi_k = self.feature_map(k_t.to(dtype))  # (..., m)
        update = phi_k.unsqueeze(-1) * v_t.to(dtype).unsqueeze(-2)  # (..., m, d_v)
        if self.state is None:
            self.state, self.normalizer = update, phi_k
        else:
            if self.state.shape[-1] != v_t.shape[-1]:
                raise ValueError(
                    f"v_t must have d_v={self.state.shape[-1]} like the state, got "
                    f"shape {tuple(v_t.shape)}; call reset() to start a new sequence"
                )
            self.state = self.state + update
            self.normalizer = self.normalizer + phi_k
        numerator = (phi_q.unsqueeze(-2) @ self.state).squeeze(-2)  # (..., d_v)
        denominator = (phi_q * self.normalizer).sum(-1, keepdim=True)  # (..., 1)
        return (numerator / (denominator + self.eps)).to(q_t.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = check_qkv(q, k, v)
        _check_causal_lengths(q.shape[-2], k.shape[-2])
        outputs = [self.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])]
        return torch.stack(outputs, dim=-2)  # (..., n, d_v)

