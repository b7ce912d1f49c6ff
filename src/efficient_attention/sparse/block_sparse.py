r"""Block-sparse attention: exact softmax attention over the key blocks a mask selects.

The sequence is cut into blocks of ``B`` tokens (the last one may be short): query
block ``I`` holds queries ``I B .. I B + B - 1``, key block ``J`` keys ``J B .. J B + B - 1``.
A bool *block mask* ``M (..., ceil(n_q / B), ceil(n_k / B))`` says which key blocks each
query block attends to (``True`` = attend). Query ``i`` in block ``I`` gets

.. math::
    \mathrm{out}_i = \frac{\sum_{j \in V_i} e^{s_{ij}} v_j}{\sum_{j \in V_i} e^{s_{ij}}},
    \quad s_{ij} = q_i^\top k_j / \sqrt{d}, \quad
    V_i = \{ j : M_{I, \lfloor j / B \rfloor},\ j \text{ not padding},\
              (j \le i \text{ if causal}) \},

exactly what :func:`~efficient_attention.softmax_attention` computes with the dense mask
that expands ``M`` to tokens (:func:`block_mask_to_token_mask`); a query with ``V_i``
empty outputs zeros, as there.

How: rows (pairs batch element x query block) are sorted by the number ``S`` of blocks
they select and grouped into steps of rows with the same ``S``, about ``2^24`` scores per
step (``2^22`` with a mask per query). In a step, the selected key blocks of every row
are gathered into one ``(S B) x d`` matrix of keys (and of values), and the step is one
call of PyTorch's fused ``scaled_dot_product_attention`` on ``(rows, 1, B, d)`` queries
against those ``(rows, 1, S B, d)`` keys (on CPU its flash kernel: online softmax over
tiles, the scores never stored; a bool mask hides padding and, in the diagonal block,
the future). A global row that selects every block (Longformer, BigBird) costs its own
``n_k`` keys, and no row pays for another's; nothing of size ``n_q x n_k`` is ever
formed.

References: the block masks of Longformer (Beltagy et al. 2020), BigBird (Zaheer et al.
2020) and sparse transformers (Child et al. 2019); the gather-per-block-row layout is
that of block-sparse kernels such as FlexAttention's block masks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import (
    broadcast_shapes,
    check_block_mask,
    check_bool,
    check_causal_lengths,
    check_key_padding_mask,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    compute_dtype,
)
from .._padding import zero_padded_rows, zeros_like_result

__all__ = ["block_sparse_attention", "block_mask_to_token_mask"]

# Work per step, in scores (rows x B x S B): 2^24, for which the gathered keys and values
# take 2^24 (d + d_v) / B numbers (32 MiB each in float32 for d = d_v = B / 2); 2^22 when
# the step needs a mask per query (causal, per-query selection), a bool per score that the
# fused kernel turns into a float one. On two threads of a busy machine (n = 16384, 4 heads,
# B = 128, 1/8 of the blocks), steps of 2^24 took 1.27 to 1.39 s against 1.58 to 2.0 s for
# 2^22 (fewer steps, fewer barriers at the end of parallel operations); one thread timed
# them alike.
_SCORES_PER_STEP = 2**24
_MASKED_SCORES_PER_STEP = 2**22

def num_blocks(n: int, block_size: int) -> int:
    """``ceil(n / block_size)``: blocks of a sequence of ``n`` tokens, the last may be short."""
    return -(-n // block_size)


def block_mask_to_token_mask(
    block_mask: torch.Tensor, n_q: int, n_k: int, *, block_size: int
) -> torch.Tensor:
    """The dense ``(..., n_q, n_k)`` bool mask (``True`` = query ``i`` may see key ``j``)
    of a block mask ``(..., ceil(n_q / B), ceil(n_k / B))``: ``M[i // B, j // B]``.

    For tests and figures: it has ``n_q n_k`` entries. Causality and key padding are not
    included (``block_sparse_attention`` applies them on top).
    """
    block_size = check_positive_int(block_size, "block_size")
    check_nonnegative_int(n_q, "n_q")
    check_nonnegative_int(n_k, "n_k")
    is_tensor = isinstance(block_mask, torch.Tensor)
    block_mask = check_block_mask(
        block_mask, tuple(block_mask.shape[:-2]) if is_tensor else (),
        (num_blocks(n_q, block_size), num_blocks(n_k, block_size)),
        block_mask.device if is_tensor else torch.device("cpu"))
    dense = block_mask.repeat_interleave(block_size, -2).repeat_interleave(block_size, -1)
    return dense[..., :n_q, :n_k]


def _flatten(x: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``(..., n, e)`` broadcast to ``batch`` and flattened to ``(prod(batch), n, e)``."""
    return x.expand(*batch, *x.shape[-2:]).reshape(math.prod(batch), *x.shape[-2:])


def _blocks(x: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """``(B, n, e)`` zero-padded to ``nb B`` rows and cut into ``(B nb, B, e)`` blocks."""
    pad = nb * block_size - x.shape[1]
    return F.pad(x, (0, 0, 0, pad)).reshape(x.shape[0] * nb, block_size, x.shape[2])


def _gather(blocks, flat, buffers, name):
    """``blocks (N, B, e)`` at the indices ``flat`` as ``(len(flat), B e)`` rows (2-d:
    index_select is several times faster so). Without autograd (``buffers`` given) into a
    buffer reused across steps: a fresh allocation per step took 2.5 times as long."""
    rows = blocks.flatten(1)
    if buffers is None:
        return rows.index_select(0, flat)
    buffer = buffers.get(name)
    if buffer is None or buffer.shape[0] < flat.shape[0]:
        buffer = buffers[name] = rows.new_empty(flat.shape[0], rows.shape[1])
    return torch.index_select(rows, 0, flat, out=buffer[:flat.shape[0]])


def _step(q_rows, kb, vb, key_ok, ids, diagonal, row_query_mask, nb_k, block_size, scale,
          buffers):
    """One step: ``R`` query-block rows, each with the ``S`` key blocks ``ids (R, S)`` (flat
    indices into ``kb``, increasing); ``diagonal``: each row's last block is its own
    (causal: masked per token). Returns ``(R, B, d_v)``."""
    rows_count, slots = ids.shape
    flat = ids.reshape(-1)
    keys = _gather(kb, flat, buffers, "keys").view(rows_count, 1, slots * block_size, -1)
    values = _gather(vb, flat, buffers, "values").view(rows_count, 1, slots * block_size, -1)
    allowed = None  # bool, broadcastable to (R, 1, B, S B): True = the key takes part
    ok = None
    if key_ok is not None:  # padding, and the missing keys of a short last block
        ok = key_ok.index_select(0, flat).view(rows_count, 1, 1, slots * block_size)
        allowed = ok
    if diagonal:  # the same for every row: the earlier blocks whole, the last one causal
        allowed_diagonal = torch.ones(block_size, slots * block_size, dtype=torch.bool,
                                      device=ids.device)
        allowed_diagonal[:, -block_size:].tril_()
        allowed = allowed_diagonal if allowed is None else allowed & allowed_diagonal
    if row_query_mask is not None:  # per-query selection among the row's blocks
        picked = row_query_mask.gather(-1, (ids % nb_k).unsqueeze(1).expand(-1, block_size, -1))
        picked = picked.repeat_interleave(block_size, -1).unsqueeze(1)  # (R, 1, B, S B)
        allowed = picked if allowed is None else allowed & picked
    empty = None
    if ok is not None or row_query_mask is not None:  # (causal alone leaves none empty)
        empty = ~allowed.any(dim=-1, keepdim=True)  # queries with no key: zero output
        if bool(empty.any()):
            allowed = allowed | empty  # any finite softmax there; replaced by 0 below
        else:
            empty = None
    out = F.scaled_dot_product_attention(q_rows.unsqueeze(1), keys, values, attn_mask=allowed,
                                         scale=scale)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.squeeze(1)


def _block_sparse(q, k, v, block_mask, mask, query_mask, batch, block_size, causal):
    """The engine, on validated inputs. ``block_mask (*batch, nb_q, nb_k)``; ``query_mask``
    ``(*batch, n_q, nb_k)`` or None: per-query selection within the selected blocks."""
    n_q, n_k, d, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    nb_q, nb_k = num_blocks(n_q, block_size), num_blocks(n_k, block_size)
    if causal:  # never a block after the query block (the diagonal is masked per token)
        block_mask = block_mask & torch.ones(nb_q, nb_k, dtype=torch.bool,
                                             device=q.device).tril()
    size = math.prod(batch)
    shape = (*batch, n_q, d_v)
    if size == 0 or n_q == 0 or n_k == 0 or d_v == 0:
        return zeros_like_result(shape, q, k, v)
    dtype = compute_dtype(q)
    # Padded keys and values become 0 before any product (NaN there cannot leak).
    k, v = zero_padded_rows(k, mask), zero_padded_rows(v, mask)
    qb = _blocks(_flatten(q.to(dtype), batch), nb_q, block_size)
    kb = _blocks(_flatten(k.to(dtype), batch), nb_k, block_size)
    vb = _blocks(_flatten(v.to(dtype), batch), nb_k, block_size)
    key_ok = None
    if mask is not None or n_k % block_size:
        ok = torch.ones(size, n_k, dtype=torch.bool, device=q.device)
        if mask is not None:
            ok = ~mask.expand(*batch, n_k).reshape(size, n_k)
        key_ok = F.pad(ok, (0, nb_k * block_size - n_k), value=False).view(-1, block_size)
    row_queries = None
    if query_mask is not None:
        query_mask = query_mask.expand(*batch, n_q, nb_k).reshape(size, n_q, nb_k)
        row_queries = F.pad(query_mask, (0, 0, 0, nb_q * block_size - n_q), value=False)
        row_queries = row_queries.view(size * nb_q, block_size, nb_k)
    selected = block_mask.reshape(size * nb_q, nb_k)
    counts = selected.sum(-1)
    # Selected block indices first, in increasing order; flat indices into kb.
    order = torch.argsort((~selected).to(torch.uint8), dim=-1, stable=True)
    base = torch.arange(size, device=q.device).repeat_interleave(nb_q) * nb_k
    ids_all = order + base.unsqueeze(-1)
    # Rows sorted by count and, when causal, whether their own block is selected (the
    # last one then, masked per token): each step takes rows of one kind.
    kind = counts * 2
    if causal:
        own = torch.arange(size * nb_q, device=q.device) % nb_q
        kind = kind + selected.gather(-1, own.unsqueeze(-1)).squeeze(-1)
    rows_by_count = torch.argsort(kind, descending=True, stable=True)
    sorted_kinds = kind[rows_by_count].tolist()
    sorted_counts = [value // 2 for value in sorted_kinds]
    start, total = 0, size * nb_q
    busy = total - sorted_counts.count(0)  # rows that select at least one block
    if busy == 0:  # no block selected anywhere
        return zeros_like_result(shape, q, k, v)
    # The busy rows in that order, so that each step takes contiguous slices.
    rows_busy = rows_by_count[:busy]
    qb, ids_all = qb[rows_busy], ids_all[rows_busy]
    if row_queries is not None:
        row_queries = row_queries[rows_busy]
    run_end = {}  # kind -> the end of its run of rows (kinds decrease along the list)
    for position, value in enumerate(sorted_kinds[:busy]):
        run_end[value] = position + 1
    # Without autograd, gather into reused buffers and write each step in place.
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    buffers = None if grad else {}
    outs = [] if grad else None
    out = None if grad else qb.new_zeros(total, block_size, d_v)  # rows without keys: 0
    per_query_mask = row_queries is not None or (causal and key_ok is not None)
    budget = _MASKED_SCORES_PER_STEP if per_query_mask else _SCORES_PER_STEP
    while start < busy:  # each step: rows of one kind (no unused slot), about a budget
        slots, diagonal = divmod(sorted_kinds[start], 2)
        step = max(1, budget // (slots * block_size * block_size))
        part = slice(start, min(start + step, run_end[sorted_kinds[start]]))
        result = _step(qb[part], kb, vb, key_ok, ids_all[part, :slots], bool(diagonal),
                       None if row_queries is None else row_queries[part], nb_k, block_size,
                       d ** -0.5, buffers)
        if grad:
            outs.append(result)
        else:
            out.index_copy_(0, rows_busy[part], result)
        start = part.stop
    if grad:
        if busy < total:  # rows that select nothing
            outs.append(qb.new_zeros(total - busy, block_size, d_v))
        out = torch.cat(outs)[torch.argsort(rows_by_count)]  # back to the rows' order
    out = out.view(size, nb_q * block_size, d_v)[:, :n_q]
    return out.reshape(shape).to(q.dtype)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    block_size: int,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Exact softmax attention restricted to the key blocks ``block_mask`` selects.

    .. math::
        \mathrm{out}_i = \sum_{j \in V_i} \frac{e^{q_i^\top k_j / \sqrt{d}}}
        {\sum_{l \in V_i} e^{q_i^\top k_l / \sqrt{d}}}\, v_j, \quad
        V_i = \{ j : \mathrm{block\_mask}[\lfloor i/B \rfloor, \lfloor j/B \rfloor]
        \wedge \neg \mathrm{pad}_j \wedge (j \le i \text{ if causal}) \}

    with ``B = block_size``. Equal (up to rounding) to ``softmax_attention(q, k, v,
    causal=causal, key_padding_mask=...)`` with every key outside the selected blocks
    also masked; see :func:`block_mask_to_token_mask`.

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``. Batch dimensions broadcast.
        block_mask: bool ``(..., ceil(n_q / B), ceil(n_k / B))``, broadcastable over the
            batch dimensions; ``True`` where query block ``I`` attends to key block ``J``
            (the opposite sense of ``key_padding_mask``, whose ``True`` removes a key).
            Any ``n`` works: the last block is short, its missing tokens are masked.
            Builders: :func:`longformer_block_mask`, :func:`bigbird_block_mask`,
            :func:`topk_block_mask`.
        block_size: tokens per block ``B`` (64 to 128 is fast on CPU).
        causal: query ``i`` sees only keys ``j <= i`` (needs ``n_q == n_k``): selected
            blocks after the query block are ignored, the diagonal block is masked per
            token.
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` where the key is
            padding (the convention of :func:`~efficient_attention.softmax_attention`);
            padded keys take no part, even if they hold NaN or inf.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q`` (half precision is computed in
        float32). A query that sees no key (no selected block, or all its keys padded or
        in the future) outputs zeros and gets zero gradients, as in
        ``softmax_attention``.

    Cost: with ``N`` selected (query block, key block) pairs, time
    ``O(N B^2 (d + d_v))`` (the dense cost has ``N = nb_q nb_k``); rows (query blocks)
    selecting different numbers of blocks are grouped by that number, so an uneven mask
    costs its own ``N``. Extra memory: copies of ``q, k, v`` (padded to whole blocks),
    ``O(n (d + d_v))``; per step the gathered keys and values, about ``2^24 (d + d_v) /
    B`` numbers (more only for a row with more than ``2^24 / B^2`` blocks), or, when the
    step needs a mask per query (causal, per-query selection), ``2^22 (d + d_v) / B``
    numbers and ``2^22`` booleans (floats inside the fused kernel); the block-level
    bookkeeping, ``O(nb_q nb_k)`` indices. Under autograd every step keeps its gathered
    keys and values and its output, ``O(N B (d + d_v))`` in all (the fused kernel
    recomputes the weights in its backward). Never ``n_q x n_k`` for ``B > 1``.

    References: Beltagy et al., "Longformer: the long-document transformer", 2020;
    Zaheer et al., "Big Bird: transformers for longer sequences", NeurIPS 2020.
    """
    q, k, v = check_qkv(q, k, v)
    block_size = check_positive_int(block_size, "block_size")
    causal = check_bool(causal, "causal")
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        check_causal_lengths(n_q, n_k)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    block_mask = check_block_mask(block_mask, batch, (num_blocks(n_q, block_size),
                                                      num_blocks(n_k, block_size)), q.device)
    return _block_sparse(q, k, v, block_mask, mask, None, batch, block_size, causal)
