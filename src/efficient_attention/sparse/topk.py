r"""Top-k block selection by mean keys (MoBA; the selection branch of NSA).

Keys are cut into blocks of ``B`` tokens and each block is summarised by its mean key
``\bar k_J``. A query (or a query block) scores every key block by
``q^\top \bar k_J``, keeps the ``top_k`` best, and attends *exactly* (softmax over
the individual keys) within the kept blocks only. With ``causal=True`` the query's own
block is always kept (it counts as one of the ``top_k``) and no later block is ever a
candidate, so the selection sees no future key (MoBA's rule).

Two granularities:

- ``per_query=False``: one selection per query block, scored by its *mean query*
  ``\bar q_I^\top \bar k_J`` (as blockwise selection kernels do; NSA shares one selection
  among the queries of a GQA group);
- ``per_query=True``: every query ``q_i`` selects its own ``top_k`` blocks by
  ``q_i^\top \bar k_J`` (MoBA's gating). The attention then gathers, per query block, the
  union of its queries' blocks and masks for each query the blocks it did not pick.

The selection is a discrete choice: no gradient flows through it (as in MoBA and NSA's
selection branch); gradients flow through the attention over the kept keys.

References: E. Lu et al., "MoBA: mixture of block attention for long-context LLMs",
2025; J. Yuan et al., "Native sparse attention: hardware-aligned and natively trainable
sparse attention", 2025.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import (
    broadcast_shapes,
    check_bool,
    check_causal_lengths,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    compute_dtype,
)
from .block_sparse import _block_sparse, num_blocks

__all__ = ["topk_block_mask", "topk_block_attention"]


def _block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(..., n, d)`` -> ``(..., ceil(n / B), d)``: the mean of each block's rows (the last
    block averages only its own ``n - (nb - 1) B`` rows)."""
    n = x.shape[-2]
    nb = num_blocks(n, block_size)
    padded = F.pad(x, (0, 0, 0, nb * block_size - n))
    sums = padded.unflatten(-2, (nb, block_size)).sum(-2)
    counts = torch.full((nb,), float(block_size), dtype=x.dtype, device=x.device)
    if nb:
        counts[-1] = n - (nb - 1) * block_size
    return sums / counts.unsqueeze(-1)


def _select(q, k, block_size, top_k, causal, per_query):
    """The selection on validated inputs: bool ``(..., rows, nb_k)``."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    nb_k = num_blocks(n_k, block_size)
    dtype = compute_dtype(q, k)
    with torch.no_grad():
        means = _block_means(k.detach().to(dtype), block_size)  # (..., nb_k, d)
        if per_query:
            queries = q.detach().to(dtype)
            own = torch.arange(n_q, device=q.device) // block_size  # each query's block
        else:
            queries = _block_means(q.detach().to(dtype), block_size)
            own = torch.arange(queries.shape[-2], device=q.device)
        scores = queries @ means.transpose(-2, -1)  # (..., rows, nb_k)
        blocks = torch.arange(nb_k, device=q.device)
        allowed = None
        if causal:
            allowed = blocks <= own.unsqueeze(-1)  # (rows, nb_k)
            scores = scores.masked_fill(~allowed, float("-inf"))
            scores = scores.masked_fill(blocks == own.unsqueeze(-1), float("inf"))
        chosen = scores.topk(min(top_k, nb_k), dim=-1).indices
        selected = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
        selected.scatter_(-1, chosen, True)
        if allowed is not None:  # fewer than top_k allowed blocks: -inf ones were taken
            selected &= allowed
    return selected


def _validate(q, k, block_size, top_k, causal, per_query):
    check_positive_int(block_size, "block_size")
    check_nonnegative_int(top_k, "top_k")
    check_bool(causal, "causal")
    check_bool(per_query, "per_query")
    if causal:
        check_causal_lengths(q.shape[-2], k.shape[-2])


def topk_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    causal: bool = False,
    per_query: bool = False,
) -> torch.Tensor:
    r"""The key blocks :func:`topk_block_attention` selects, as a bool mask.

    .. math::
        \bar k_J = \mathrm{mean}_{j \in J} k_j, \quad
        \mathrm{score}_{xJ} = x^\top \bar k_J, \quad
        \mathrm{selected}_x = \mathrm{top}_k\{J : \mathrm{score}_{xJ}\}

    with ``x = q_i`` (``per_query=True``) or ``x = \bar q_I``, the mean query of block
    ``I`` (``per_query=False``). Causal: the own block (``J = I``, ``I`` the query's
    block) is always selected, blocks ``J > I`` never, the others compete for the
    remaining ``top_k - 1`` places. Ties go to ``torch.topk``'s choice.
    ``top_k >= ceil(n_k / B)`` selects every (allowed) block.

    Args:
        q: queries ``(..., n_q, d)``; k: keys ``(..., n_k, d)`` (batch dims broadcast).
        block_size: tokens per block ``B``.
        top_k: blocks kept per query (or query block), ``>= 0``.
        causal: as above (needs ``n_q == n_k``).
        per_query: one selection per query instead of per query block.

    Returns:
        bool ``(..., ceil(n_q / B), ceil(n_k / B))`` (``per_query=False``; a block mask
        for :func:`block_sparse_attention`) or ``(..., n_q, ceil(n_k / B))``
        (``per_query=True``), ``True`` = selected. Not differentiable (a choice).

    Cost: ``O(n_k d)`` for the means and ``O(r nb_k d)`` for the scores, ``r`` = query
    blocks or queries (``n_q n_k / B`` per query: the selection's own quadratic term,
    ``B`` times smaller than attention's), plus a top-k per row.

    References: Lu et al., "MoBA", 2025; Yuan et al., "Native sparse attention", 2025.
    """
    q, k, _ = check_qkv(q, k, k)
    _validate(q, k, block_size, top_k, causal, per_query)
    return _select(q, k, block_size, top_k, causal, per_query)


def topk_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    causal: bool = False,
    per_query: bool = False,
) -> torch.Tensor:
    r"""Exact softmax attention within the ``top_k`` key blocks each query selects.

    .. math::
        \mathrm{out}_i = \sum_{j \in V_i} \frac{e^{q_i^\top k_j / \sqrt{d}}}
        {\sum_{l \in V_i} e^{q_i^\top k_l / \sqrt{d}}}\, v_j, \quad
        V_i = \{ j : \lfloor j / B \rfloor \in \mathrm{selected}_i,\
        (j \le i \text{ if causal}) \}

    where ``selected_i`` is the row of :func:`topk_block_mask` (same arguments) for
    query ``i`` (``per_query=True``) or for its block (``per_query=False``, the mean
    query of the block selects). Equal (up to rounding) to
    ``softmax_attention`` with every key outside ``V_i`` masked. Causal attention always
    keeps the query's own block, so every query sees at least itself; ``top_k = 0`` (or
    ``n_k = 0``) gives zeros.

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``. Batch dimensions broadcast.
        block_size: tokens per block ``B`` (selection and attention).
        top_k: blocks kept per query (block).
        causal: query ``i`` sees only keys ``j <= i`` (needs ``n_q == n_k``).
        per_query: MoBA's per-query selection (see :func:`topk_block_mask`).

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``. Gradients flow through the attention,
        not through the selection.

    Cost: the selection (see :func:`topk_block_mask`) plus the block-sparse attention,
    ``O(n_q top_k B (d + d_v))`` with ``per_query=False``; with ``per_query=True`` each
    query block gathers the union ``U_I`` of its queries' blocks, ``O(B |U_I| B (d +
    d_v))`` per query block (between ``top_k`` and ``min(nb_k, B top_k)`` blocks).

    References: Lu et al., "MoBA: mixture of block attention for long-context LLMs",
    2025; Yuan et al., "Native sparse attention", 2025.
    """
    q, k, v = check_qkv(q, k, v)
    _validate(q, k, block_size, top_k, causal, per_query)
    selected = _select(q, k, block_size, top_k, causal, per_query)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_q = q.shape[-2]
    if per_query:
        nb_q = num_blocks(n_q, block_size)
        padded = F.pad(selected, (0, 0, 0, nb_q * block_size - n_q), value=False)
        union = padded.unflatten(-2, (nb_q, block_size)).any(-2)  # (..., nb_q, nb_k)
        return _block_sparse(q, k, v, union.expand(*batch, *union.shape[-2:]), None,
                             selected, batch, block_size, causal)
    return _block_sparse(q, k, v, selected.expand(*batch, *selected.shape[-2:]), None, None,
                         batch, block_size, causal)
