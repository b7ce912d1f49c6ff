r"""Reformer's LSH attention: shared queries and keys, angular hashing, sorted chunks.

With shared query-key vectors ``x_i`` (queries ``x_i``, keys ``\hat x_j = x_j / |x_j|``),
the keys a query attends to most are those pointing its way. Angular LSH finds them:
a random rotation ``R (d, nbuckets/2)`` per hash round and

.. math::
    h(x) = \operatorname{argmax}([x R; -x R])

puts nearby directions in the same bucket with high probability. In each round the
tokens are sorted by ``(bucket, position)``, the sorted order is cut into chunks of
``C`` tokens, and each chunk attends to itself and the previous chunk (no wrap-around:
the first chunk only to itself): query ``i`` of chunk ``c`` sees the keys in chunks
``c - 1`` and ``c``, ``2 C`` keys, so a round costs ``O(n C d)``, not ``O(n^2 d)``.

The equivalent dense mask, for given hashes. Let ``c_r(i) = p_r(i) // C`` with
``p_r(i)`` the rank of ``(h_r(i), i)`` in round ``r``'s sort. Then ``j`` is in ``i``'s
window in round ``r`` iff ``c_r(j) \in \{c_r(i) - 1, c_r(i)\}``, and

.. math::
    \mathrm{visible}_{ij} = (i \ne j) \wedge (\exists r: j \in W_r(i)) \wedge
    (j \le i \text{ if causal}),

except that a token that sees no other token in any round attends to itself only
(Reformer's rule: a token does not attend to itself, whose score ``x_i^\top \hat x_i =
|x_i|`` would dominate, unless it has no other choice). The rounds are attended
separately and combined exactly with their log-sum-exps (as in
:func:`~efficient_attention.merge_softmax_partials`). A key in ``i``'s window in
``m_{ij}`` rounds would be counted ``m_{ij}`` times; with ``deduplicate=True`` (the
default) its score is lowered by ``log m_{ij}`` in each round, so the result is *exact*
masked softmax attention over the union:

.. math::
    \mathrm{out}_i = \frac{\sum_j \mathrm{visible}_{ij}\, e^{s_{ij}} v_j}
                          {\sum_j \mathrm{visible}_{ij}\, e^{s_{ij}}}, \quad
    s_{ij} = x_i^\top \hat x_j / \sqrt{d};

with ``deduplicate=False`` the weights are ``m_{ij} e^{s_{ij}}`` (the plain merge of
the rounds: duplicates counted once per round).

Reference: N. Kitaev, L. Kaiser and A. Levskaya, "Reformer: the efficient transformer",
ICLR 2020.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import (
    broadcast_shapes,
    check_bool,
    check_even_positive_int,
    check_generator,
    check_positive_int,
    check_shared_qk,
    check_tensor,
    compute_dtype,
)
from .._padding import zeros_like_result

__all__ = ["lsh_buckets", "lsh_attention"]


def _rotations(d, num_hashes, num_buckets, generator, dtype, device):
    """``(num_hashes, d, num_buckets / 2)`` Gaussian rotations, drawn on the generator's
    device (the CPU without one) so that one seed gives the same hashes everywhere."""
    draw_on = generator.device if generator is not None else torch.device("cpu")
    shape = (num_hashes, d, num_buckets // 2)
    return torch.randn(shape, generator=generator, dtype=dtype, device=draw_on).to(device)


def _hash(qk, rotations):
    """``qk (B, n, d)`` -> buckets ``(B, H, n)``: argmax over ``[x R, -x R]``."""
    projected = torch.einsum("bnd,hdk->bhnk", qk, rotations)
    return torch.cat([projected, -projected], dim=-1).argmax(dim=-1)


def lsh_buckets(
    qk: torch.Tensor,
    *,
    num_hashes: int,
    num_buckets: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""The angular-LSH buckets :func:`lsh_attention` uses: ``h_r(x) = argmax([x R_r;
    -x R_r])`` with ``R_r (d, nbuckets/2)`` standard Gaussian, ``r = 1..num_hashes``.

    Called with a generator in the same state (same seed), it returns the buckets that
    ``lsh_attention`` computes, so tests and figures can rebuild its mask. The rotations
    are shared by every batch element and head, and drawn in the compute dtype of ``qk``
    (float32 for half precision) on the generator's device (CPU without one).

    Args:
        qk: shared queries-keys ``(..., n, d)``.
        num_hashes: hash rounds ``H``.
        num_buckets: buckets per round, even.
        generator: source of the rotations.

    Returns:
        int64 ``(..., H, n)`` in ``[0, num_buckets)``. Cost ``O(H n d nbuckets)``.

    Reference: Kitaev et al., "Reformer: the efficient transformer", ICLR 2020.
    """
    qk = check_tensor(qk, "qk", min_dim=2)
    num_hashes = check_positive_int(num_hashes, "num_hashes")
    num_buckets = check_even_positive_int(num_buckets, "num_buckets")
    generator = check_generator(generator)
    *batch, n, d = qk.shape
    dtype = compute_dtype(qk)
    rotations = _rotations(d, num_hashes, num_buckets, generator, dtype, qk.device)
    flat = qk.detach().to(dtype).reshape(-1, n, d)
    return _hash(flat, rotations).reshape(*batch, num_hashes, n)


def _gather_rows(x, index):
    """``x (B, m, e)``, ``index (B, H, p)`` -> ``(B, H, p, e)``: rows of each batch element."""
    batch, hashes, p = index.shape
    flat = index.reshape(batch, hashes * p, 1).expand(-1, -1, x.shape[-1])
    return x.gather(1, flat).view(batch, hashes, p, x.shape[-1])


def _with_previous(x, fill):
    """``(B, H, nc, C, ...)`` -> ``(B, H, nc, 2C, ...)``: chunk ``c - 1`` then chunk ``c``;
    before chunk 0 comes a chunk of ``fill``."""
    previous = torch.cat([torch.full_like(x[:, :, :1], fill), x[:, :, :-1]], dim=2)
    return torch.cat([previous, x], dim=3)


def _lsh_forward(qk, v, buckets, chunk_size, causal, deduplicate):
    """Flat inputs ``qk (B, n, d)``, ``v (B, n, d_v)``, ``buckets (B, H, n)``."""
    batch, n, d = qk.shape
    hashes = buckets.shape[1]
    size = chunk_size
    chunks = -(-n // size)
    padded = chunks * size
    positions = torch.arange(n, device=qk.device)
    order = torch.argsort(buckets * n + positions, dim=-1)  # sorted slot -> token
    slot_of = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
    chunk_of = torch.div(slot_of, size, rounding_mode="floor")  # (B, H, n)
    # A dummy token n (zeros) fills the last chunk; it is hidden from every query.
    order = F.pad(order, (0, padded - n), value=n)
    zero = qk.new_zeros(batch, 1, d)
    queries = _gather_rows(torch.cat([qk, zero], 1), order).view(batch, hashes, chunks, size, d)
    keys = _gather_rows(torch.cat([F.normalize(qk, dim=-1), zero], 1), order)
    keys = _with_previous(keys.view(batch, hashes, chunks, size, d), 0.0)
    values = _gather_rows(torch.cat([v, v.new_zeros(batch, 1, v.shape[-1])], 1), order)
    values = _with_previous(values.view(batch, hashes, chunks, size, -1), 0.0)
    query_pos = order.view(batch, hashes, chunks, size)
    key_pos = _with_previous(query_pos, n)  # (B, H, nc, 2C); n = no key
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(d)  # (B, H, nc, C, 2C)
    pairs = (query_pos.unsqueeze(-1), key_pos.unsqueeze(-2))
    hidden = (pairs[1] == n) | (pairs[1] == pairs[0])  # no key, or the token itself
    if causal:
        hidden |= pairs[1] > pairs[0]
    if deduplicate:  # m_ij: in how many rounds j lies in i's window, one round at a time
        chunk_x = F.pad(chunk_of, (0, 1))  # (B, H, n + 1): the dummy token n in chunk 0
        rounds = torch.zeros_like(hidden, dtype=torch.int32)
        for r in range(hashes):
            of = chunk_x[:, r].unsqueeze(1)  # (B, 1, n + 1): each token's chunk in round r
            lag = (of.expand(-1, hashes, -1).gather(-1, query_pos.flatten(2))
                   .view(query_pos.shape).unsqueeze(-1)
                   - of.expand(-1, hashes, -1).gather(-1, key_pos.flatten(2))
                   .view(key_pos.shape).unsqueeze(-2))
            rounds += (lag == 0) | (lag == 1)
        scores = scores - torch.log(rounds.clamp_(min=1).to(scores.dtype))
    scores = scores.masked_fill(hidden, float("-inf"))
    top = scores.detach().amax(dim=-1, keepdim=True)
    shift = torch.where(top == float("-inf"), 0.0, top)
    weights = torch.exp(scores - shift)
    total = weights.sum(-1)  # (B, H, nc, C)
    seen = total > 0
    out = (weights @ values) / torch.where(seen, total, 1.0).unsqueeze(-1)
    lse = torch.where(seen, shift.squeeze(-1) + torch.log(torch.where(seen, total, 1.0)),
                      float("-inf"))
    # Back to token order: slot_of gives each token its place in the sorted order.
    out = _gather_rows(out.reshape(batch * hashes, padded, -1),
                       slot_of.reshape(batch * hashes, 1, n)).view(batch, hashes, n, -1)
    lse = lse.reshape(batch, hashes, padded).gather(-1, slot_of)  # (B, H, n)
    # Exact merge of the rounds by their log-sum-exps; no other key at all: itself.
    top = lse.detach().amax(dim=1, keepdim=True)
    shift = torch.where(top == float("-inf"), 0.0, top)
    shares = torch.exp(lse - shift)  # 0 for a round without key
    norm = shares.sum(1)  # (B, n)
    some = norm > 0
    merged = (shares.unsqueeze(-1) * out).sum(1) / torch.where(some, norm, 1.0).unsqueeze(-1)
    return torch.where(some.unsqueeze(-1), merged, v)


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    num_hashes: int,
    num_buckets: int,
    chunk_size: int,
    causal: bool = False,
    generator: torch.Generator | None = None,
    deduplicate: bool = True,
) -> torch.Tensor:
    r"""Reformer's LSH attention with shared queries and keys (see the module docstring).

    .. math::
        \mathrm{out}_i = \frac{\sum_j \mathrm{visible}_{ij}\, m_{ij}^{\delta}\,
        e^{s_{ij}} v_j}{\sum_j \mathrm{visible}_{ij}\, m_{ij}^{\delta}\, e^{s_{ij}}},
        \quad s_{ij} = \frac{x_i^\top x_j}{|x_j| \sqrt{d}},

    with ``visible`` the union over the hash rounds of the sorted-chunk windows (no
    self unless nothing else is visible; ``j <= i`` when causal), ``m_ij`` the number of
    rounds in which ``j`` is in ``i``'s window, and ``delta = 0`` when ``deduplicate``
    (exact masked attention over the union), ``1`` otherwise. The hashes are those of
    :func:`lsh_buckets` with the same generator state; a test can rebuild ``visible``
    from them and compare with masked ``softmax_attention(qk, qk / |qk|, v)``.

    Args:
        qk: shared queries-keys ``(..., n, d)``; keys are ``qk / |qk|`` (a zero vector
            stays zero).
        v: values ``(..., n, d_v)``. Batch dimensions broadcast.
        num_hashes: hash rounds ``H`` (more rounds: fewer missed neighbours).
        num_buckets: buckets per round, even (Reformer: about ``n / C``).
        chunk_size: ``C``, tokens per chunk of the sorted order; each chunk attends to
            itself and the previous one.
        causal: query ``i`` sees only tokens ``j <= i`` (within its windows).
        generator: source of the random rotations.
        deduplicate: count a key found in several rounds once (exact union) instead of
            once per round (the plain merge).

    Returns:
        ``(..., n, d_v)`` in the dtype of ``qk``. Differentiable in ``qk`` and ``v`` (not
        through the hashes, a discrete choice).

    Cost: per round a sort ``O(n log n)``, the hashes ``O(n d nbuckets)`` and ``2 C``
    keys per query, ``O(n C (d + d_v))``; memory ``O(H n C)`` for the scores (``O(H^2 n
    C)`` for the round counts when ``deduplicate``). Never ``n x n``.

    Reference: Kitaev et al., "Reformer: the efficient transformer", ICLR 2020.
    """
    qk, v = check_shared_qk(qk, v)
    num_hashes = check_positive_int(num_hashes, "num_hashes")
    num_buckets = check_even_positive_int(num_buckets, "num_buckets")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    causal = check_bool(causal, "causal")
    generator = check_generator(generator)
    deduplicate = check_bool(deduplicate, "deduplicate")
    batch = broadcast_shapes(qk.shape[:-2], v.shape[:-2])
    n, d, d_v = qk.shape[-2], qk.shape[-1], v.shape[-1]
    dtype = compute_dtype(qk)
    rotations = _rotations(d, num_hashes, num_buckets, generator, dtype, qk.device)
    size = math.prod(batch)
    if size == 0 or n == 0 or d_v == 0:
        return zeros_like_result((*batch, n, d_v), qk, v)
    flat_qk = qk.to(dtype).expand(*batch, n, d).reshape(size, n, d)
    flat_v = v.to(dtype).expand(*batch, n, d_v).reshape(size, n, d_v)
    with torch.no_grad():
        buckets = _hash(flat_qk, rotations)
    out = _lsh_forward(flat_qk, flat_v, buckets, chunk_size, causal, deduplicate)
    return out.reshape(*batch, n, d_v).to(qk.dtype)
