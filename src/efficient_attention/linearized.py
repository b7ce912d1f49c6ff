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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._blockwise import (
    blockwise_attention,
    causal_prefix_products,
    check_block_sizes,
    default_block_size,
    flatten_batch,
)
from ._checks import (
    broadcast_shapes,
    check_bool,
    check_causal_lengths,
    check_key_padding_mask,
    check_nonnegative_float,
    check_qkv,
    check_tensor,
    compute_dtype,
)
from ._padding import zero_padded_rows, zeros_like_result

__all__ = [
    "causal_prefix_products",  # the chunked prefix sums of the causal form (in _blockwise)
    "elu_feature_map",
    "kernelized_attention",
    "linear_attention",
    "RecurrentLinearAttention",
]

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020).

    Shapes: ``(..., n, d) -> (..., n, d)``. Cost: ``O(n d)``.
    """
    x = check_tensor(x, "x", min_dim=1)
    return F.elu(x) + 1.0


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
    masked) gets an output of zeros. Padded keys and values are replaced by zeros before
    ``kernel`` sees them, so NaN or inf padding cannot leak; any other NaN propagates.
    Half-precision inputs are computed in float32.

    Shapes: q ``(..., n_q, d)``, k ``(..., n_k, d)``, v ``(..., n_k, d_v)`` ->
    ``(..., n_q, d_v)``. Cost: time ``O(n_q n_k (d + d_v))``, memory ``O(n_q n_k)``.
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    if not callable(kernel):
        raise TypeError(f"kernel must be callable kernel(q, k), got {type(kernel).__name__}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        check_causal_lengths(n_q, n_k)
    dtype = compute_dtype(q)
    k, v = zero_padded_rows(k, mask).to(dtype), zero_padded_rows(v, mask).to(dtype)
    weights = kernel(q.to(dtype), k)
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape[-2:]) != (n_q, n_k):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"kernel(q, k) must return (..., n_q, n_k)=(..., {n_q}, {n_k}), got {got}")
    if causal:
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(diagonal=1)
        weights = weights.masked_fill(future, 0.0)
    if mask is not None:
        weights = weights.masked_fill(mask.unsqueeze(-2), 0.0)
    total = weights.sum(-1, keepdim=True)  # (..., n_q, 1)
    safe_total = torch.where(total == 0, torch.ones_like(total), total)
    return ((weights @ v) / safe_total).to(q.dtype)


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
        eps: added to the denominator; a finite number ``>= 0``. With ``eps = 0`` a query
            whose normaliser is zero (every key padded) gets zeros.
        chunk_size: chunk length ``C`` of the causal prefix sums (default: the power of
            two ``>= m d_v / (m + d_v)``, at least 16, which keeps the per-chunk states
            no larger than the features).
        block_size: rows of features computed at a time (default: about ``2^20``
            numbers per block, at least 64 rows); changes speed and memory, not the
            result beyond rounding.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``.

    Cost: time ``O(n m d_v)`` (+ ``O(n C (m + d_v))`` causal); memory ``O(n (m + d_v))``
    (one block of features at a time without autograd), plus, when causal, one
    ``m x d_v`` state per chunk, ``O(n m d_v / C) <= O(n (m + d_v))`` for the default
    ``C``, kept for the backward pass.
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    if not callable(feature_map):
        raise TypeError(f"feature_map must be callable, got {type(feature_map).__name__}")
    eps = check_nonnegative_float(eps, "eps")
    if causal:
        check_causal_lengths(q.shape[-2], k.shape[-2])
    check_block_sizes(chunk_size, block_size)
    dtype = compute_dtype(q)
    batch, (q3, k3, v3, mask2) = flatten_batch(q, k, v, mask)

    def features(x: torch.Tensor) -> torch.Tensor:
        phi = feature_map(x.to(dtype))
        if not isinstance(phi, torch.Tensor) or phi.shape[:-1] != x.shape[:-1]:
            got = tuple(phi.shape) if isinstance(phi, torch.Tensor) else type(phi).__name__
            raise ValueError(
                f"feature_map must map (..., n, d) to (..., n, m), got {tuple(x.shape)} -> {got}"
            )
        return phi

    size = block_size or default_block_size(q3.shape[0], q.shape[-1], q.shape[-2])
    out = blockwise_attention(
        q3, k3, v3.to(dtype), features, causal=causal, mask=mask2, eps=eps,
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
        self.eps = check_nonnegative_float(eps, "eps")
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
        dtype = compute_dtype(q_t)
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
        check_causal_lengths(q.shape[-2], k.shape[-2])
        n = q.shape[-2]
        if n == 0:  # nothing to add to the state
            batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
            return zeros_like_result((*batch, 0, v.shape[-1]), q, k, v)
        outputs = [self.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(n)]
        return torch.stack(outputs, dim=-2)  # (..., n, d_v)

