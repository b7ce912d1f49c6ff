r"""Attention with exponential features, stabilised so that nothing overflows or underflows.

FAVOR+ features are exponentials: the weight of key ``j`` for query ``i`` is

.. math:: W_{ij} = \sum_l s_{il}\, t_{jl}\, \exp(a_{il} + b_{jl})

with log-magnitudes ``a (n_q, m)``, ``b (n_k, m)`` (or ``(n_k, 1)``: one per key) and
signs (or cosines) ``s, t`` (``s = t = 1`` for positive features). ``exp(a)`` and
``exp(b)`` alone over- or underflow for large inputs, and the output
``sum_j W_ij v_j / sum_j W_ij`` only needs ``W_ij`` up to a factor common to row ``i``.
The stabilisation, exact in exact arithmetic:

* **Per-feature key constants** ``c_l``: key features are ``t_jl exp(b_jl - c_l)``.
* **Per-query factors**: query features are ``softmax_l(a_il + c_l)`` (positive
  features), i.e. ``exp(a_il + c_l - M_i)`` with ``M_i`` the log-sum-exp of the row, in
  ``[0, 1]``; signed (trig) query features need no factor.

Their product is ``exp(-M_i) W_ij``: one factor per row, which cancels between the
numerator and the denominator, *whatever the constants*. The constants only decide what
is representable. Two rules keep every query safe:

1. ``c_l`` is **at most the largest log-feature of a key the query sees** (an unpadded
   key; when causal, one at or before it), feature by feature. Then at the feature
   ``l*`` that maximises ``a_il + c_l`` the query's visible keys sum to at least
   ``exp(a_il* + c_l* - M_i) >= 1 / m``: a query with an unmasked key never gets a zero
   row, whatever the norms.
2. No sum overflows: the column sums of the key features (the state's last column,
   which bounds every feature) stay below ``~e^60``.

Keys arrive in blocks of rows. The constant is folded into the product that makes the
log-features (an extra column: no pass of its own), so a block costs its products, one
``exp`` pass over its key features and one softmax over its query features. With
bidirectional positive features the normaliser ``D`` comes out of that softmax too:
with ``S_l = sum_j exp(b_jl - c_l) v_j`` and ``s_l = sum_j exp(b_jl - c_l)`` (at least 1
by rule 1), ``out_i = sum_l softmax_l(a_il + c_l + log s_l) S_l / s_l``: attention over
the ``m`` features, with no division pass. The first
block takes the first key's log-features as ``c`` (every query sees the first key),
and later blocks keep ``c`` (no rescaling) as long as rule 2 holds. A block that breaks
it is redone: bidirectional, relative to its own maximum per feature (the state is then
re-expressed, ``S_l <- exp(c_l^old - c_l^new) S_l``, as in online softmax); causal, with
``c`` raised to the block's first key where that is larger (seen by all the block's
queries), and if that is not enough, split in two halves, recursively, down to single
rows (where the key is at most its own constant). Batch rows whose first keys are padded
take the first unpadded key the same way. Within a block all features share one
constant, so the causal sums are the plain chunked prefix products of
:func:`._blockwise.causal_prefix_products` carried from block to block. Every step is an
identity, so the output does not depend on ``block_size`` or ``chunk_size`` beyond
rounding.

**Base 2 for keys.** The key log-features (and so the constants ``c``) are in base 2:
the key map returns ``log2 e * (b - c)`` and key features are ``exp2`` of it, which costs
about half of ``exp`` on the CPU (``log2 e`` is folded into the key map's product, so
this costs nothing). The query map receives the constants in these units and converts them
(``c ln 2``) into its own product; its softmax stays in base e. Bounds such as
``SAFE_EXPONENT`` are stated in base e below.

**Buffers.** Without autograd, the rows the maps take (made once per call), each block's
log-features and ``[v, 1]`` are written into buffers reused from block to block
(:class:`._workspace.Scratch`), on the CPU kept from call to call (per thread, at most
``_workspace.WORKSPACE_BYTES``): fresh multi-MiB tensors would each cost page faults on
first touch, as much as the arithmetic. The queries are taken in blocks that are
contiguous pieces of the output (whole batch rows, or rows of one batch row), so that
their product with the values writes the result in place.

Shapes are flattened to ``(B, n, x)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._blockwise import causal_prefix_products, default_chunk_size, divide, values_with_ones
from ._padding import zeros_like_result
from ._workspace import Scratch

# (log-magnitude (B, b, w) or (B, b, 1), or None for 0; signed part (B, b, m) or None for 1)
LogFeatures = tuple[torch.Tensor | None, torch.Tensor | None]
# (rows (B, b, e), constant (B, 1, w) or None) -> log-features; the key map returns
# ``log2 e * (b - c)`` (base 2, with ``constant = log2 e * c``), the query map ``a + c`` in
# base e (``constant * ln 2`` folded into its product), and either a log part or a signed
# part, not both.
LogFeatureMap = Callable[[torch.Tensor, torch.Tensor | None], LogFeatures]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
SAFE_EXPONENT = 30.0  # the most a key feature may exceed its constant by, in base e
_SAFE_LOG2 = SAFE_EXPONENT * LOG2E  # the same, in the base-2 units of the key logs
_LARGEST_SUM = math.exp(SAFE_EXPONENT)  # bound on a column sum of key features (a state)


def _key_features_(log: torch.Tensor, signed: torch.Tensor | None) -> torch.Tensor:
    """``signed * 2^log``; ``log`` must be fresh: it is overwritten (one buffer per block)."""
    return log.exp2_() if signed is None else signed * log.exp2_()


def query_features(log: torch.Tensor | None, signed: torch.Tensor | None) -> torch.Tensor:
    """Query features up to a positive factor per row, from a log part (positive
    features: ``softmax(log)``, largest feature of a row at least ``1 / width``) or a
    signed part (trig features, taken as they are). A fresh ``log`` is overwritten
    when no gradient is recorded (one buffer per block)."""
    if log is None:
        return signed
    if log.requires_grad or log.device.type != "cpu":  # in place: checked on the CPU only
        return torch.softmax(log, dim=-1)
    return torch._softmax(log, -1, False, out=log)


def _masked_logs(key_logs: LogFeatureMap, k: torch.Tensor, constant, mask) -> LogFeatures:
    """Key log-features relative to ``constant``, padded keys at ``-inf`` (feature 0)."""
    log, signed = key_logs(k, constant)
    if mask is not None:
        log = log.masked_fill_(mask.unsqueeze(-1), float("-inf"))
    return log, signed


def _largest(x: torch.Tensor) -> float:
    """The largest entry of ``x``, NaN ignored (a NaN input gives NaN outputs anyway)."""
    return float(x.detach().nan_to_num(nan=float("-inf")).amax()) if x.numel() else -math.inf


def _rows_with_keys(mask: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """``(B, 1, 1)``: the rows ``mask (B, b)`` (``None``: no padding) hold an unpadded key."""
    if mask is None:
        return torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
    return (~mask).any(dim=-1).view(-1, 1, 1)


class _BlockValues:
    """``[v, 1]`` ``(B, b, d_v + 1)`` for rows ``[start, stop)``, padded rows zero (made
    block by block, into one reused buffer when no gradient is recorded)."""

    def __init__(self, v: torch.Tensor, mask: torch.Tensor | None,
                 scratch: Scratch | None) -> None:
        self.v, self.mask, self.scratch = v, mask, scratch

    def rows(self, start: int, stop: int) -> torch.Tensor:
        v = self.v[:, start:stop]
        mask = None if self.mask is None else self.mask[:, start:stop]
        if self.scratch is None:  # autograd records: a fresh tensor per block
            return values_with_ones(v, mask)
        out = self.scratch.get("values", (v.shape[0], v.shape[1], v.shape[2] + 1), v)
        return values_with_ones(v, mask, out=out)


class _Output:
    """The ``(B, n_q, d_v)`` result, block by block: written in place when no gradient is
    needed, gathered and concatenated for autograd."""

    def __init__(self, shape: tuple[int, int, int], recording: bool) -> None:
        self.shape, self.recording = shape, recording
        self.pieces: list[torch.Tensor] = []
        self.out: torch.Tensor | None = None

    def add(self, start: int, both: torch.Tensor) -> None:
        """Rows ``start:start + b`` from ``both (B, b, d_v + 1)`` (numerators, denominator)."""
        if both.requires_grad:
            self.pieces.append(divide(both[..., :-1], both[..., -1:], 0.0))
            return
        if self.out is None:
            self.out = both.new_empty(self.shape)
        divide(both[..., :-1], both[..., -1:], 0.0,
               out=self.out[:, start : start + both.shape[1]])

    def put(self, heads: slice, rows: slice, q: torch.Tensor, values: torch.Tensor) -> None:
        """Output ``[heads, rows]`` (all heads when a gradient is recorded, else a
        contiguous piece, see :func:`_query_blocks`): ``q (P, b, m) @ values (P, m,
        d_v)``, already normalised (``P`` batch rows, or pieces of one batch row)."""
        if q.requires_grad or values.requires_grad:
            self.pieces.append(torch.bmm(q, values))
            return
        if self.out is None:
            self.out = q.new_empty(self.shape)
        torch.bmm(q, values, out=self.out[heads, rows].view(q.shape[0], q.shape[1], -1))

    def result(self) -> torch.Tensor:
        return self.out if not self.pieces else torch.cat(self.pieces, dim=1)


class _Block:
    """One block of key rows ``[start, stop)`` and its constant.

    ``carried = (constant (B, 1, w), seen (B, 1, 1), state)`` come from the earlier rows
    (the state transposed, ``(B, d_v + 1, m)``: ``[V, 1]^T phi(K)``, the faster product):
    ``seen`` marks the batch rows that had an unpadded key, and then ``constant`` is at
    most the largest earlier log-feature, per feature (rule 1 for every later query).
    When every batch row has one, the block keeps it (``kept``: no pass, no rescaling);
    otherwise, or with ``refresh``, the block's constant is the largest of it, the
    block's first key and, with ``refresh``, the log of the mean key feature so far
    (``c_l + log(S_l / N)``, at most the largest earlier log-feature), and the state is
    re-expressed relative to it (its column sums then at most ``N``).
    """

    def __init__(self, key_logs, k, mask, rows, carried, refresh: bool = False) -> None:
        self.key_logs, self.k, self.rows = key_logs, k, rows
        start, stop = rows
        self.mask = None if mask is None else mask[:, start:stop]
        constant, seen, self.state = carried
        self.kept = constant is not None and not refresh and bool(seen.all())
        if self.kept:  # (every batch row has seen a key: nothing below changes)
            self.constant, self.seen, self.unseen = constant, seen, torch.zeros_like(seen)
            return
        self.has_key = _rows_with_keys(self.mask, k.shape[0], k.device)
        first, _ = _masked_logs(key_logs, k[:, start : start + 1], None,
                                None if mask is None else mask[:, start : start + 1])
        first = first.detach()  # (B, 1, w)
        if constant is None:  # nothing seen yet: any finite constant, a zero state
            constant = torch.zeros_like(first)
            seen = torch.zeros(first.shape[0], 1, 1, dtype=torch.bool, device=first.device)
        block = torch.maximum(torch.where(seen, constant, -math.inf), first)
        if refresh and self.state is not None and self.state.shape[-1] == block.shape[-1]:
            mean = self.state[:, -1:].detach() / start  # (B, 1, w)
            block = torch.maximum(block, torch.where(seen, constant + mean.log2(), -math.inf))
        self.constant = torch.where(block > -math.inf, block, constant)  # (B, 1, w)
        # a batch row whose first key here is padded and that saw none before has no
        # constant seen by all its queries
        self.unseen = self.has_key & ~seen & (first.amax(dim=-1, keepdim=True) == -math.inf)
        if self.state is not None:  # relative to the block's constant: exp(c_old - c) <= 1
            self.state = self.state * torch.where(seen, torch.exp2(constant - self.constant), 0.0)
        self.seen = seen | self.has_key

    def logs(self) -> LogFeatures:
        start, stop = self.rows
        return _masked_logs(self.key_logs, self.k[:, start:stop], self.constant, self.mask)


def _bidirectional_keys(block: _Block, values: _BlockValues):
    """Add a block of keys to the state ``sum_j [v_j, 1]^T exp(b_j - c)`` ``(B, d_v + 1,
    m)``; returns the new ``(constant, seen, state)``."""
    v_t = values.rows(*block.rows).transpose(-2, -1)  # (B, d_v + 1, b)
    state = block.state
    log, signed = block.logs()
    if signed is None and not bool(block.unseen.any()):
        # positive features: the state's column sums bound every feature
        phi_k = _key_features_(log, signed)  # (B, b, m)
        new = torch.bmm(v_t, phi_k) if state is None else torch.baddbmm(state, v_t, phi_k)
        if _largest(new[:, -1]) <= _LARGEST_SUM:
            return block.constant, block.seen, new
        log, signed = block.logs()
    # Slow path: subtract the block's own maximum where it exceeds the constant (and
    # take it as the constant of a batch row that had no constant yet).
    top = log.detach().amax(dim=-2, keepdim=True)  # (B, 1, w): max of b - c
    rise = torch.where(block.unseen, top, top.clamp_min(0.0))
    rise = torch.where(rise > -math.inf, rise, 0.0)  # no key: nothing to shift
    contribution = torch.bmm(v_t, _key_features_(log.sub_(rise), signed))
    if state is not None:  # (rows with no earlier key have a zero state)
        state = state * torch.exp2(-rise).masked_fill(block.unseen, 0.0) + contribution
    return block.constant + rise, block.seen, contribution if state is None else state


def _query_blocks(batch: int, n: int, block_size: int, all_heads: bool):
    """``(heads, rows, pieces)``: slices of the queries, and into how many equal pieces
    of rows (a batch for the products) the block is cut.

    ``all_heads`` (autograd records): every batch row, ``block_size`` rows at a time,
    gathered in order by ``_Output``. Otherwise each block is a contiguous piece of the
    ``(B, n_q, d_v)`` output of about ``batch * block_size`` rows, written in place:
    whole batch rows when one fits, else ``block_size``-row pieces of one batch row
    taken as a batch. (A slice of rows across batch rows is not contiguous: its product
    would need a copy, or, written in place, one product per batch row; and one large
    2-D product costs two parallel regions where a batched one costs one, each a
    thread wake-up when idle OpenMP threads sleep.)
    """
    if all_heads:
        return [(slice(None), slice(start, start + block_size), 1)
                for start in range(0, n, block_size)]
    numbers = batch * block_size  # query rows per block
    if n < 2 * block_size or n * 2 <= numbers:  # (pieces of one batch row: no gain)
        per = max(1, numbers // max(n, 1))
        return [(slice(h, h + per), slice(None), 1) for h in range(0, batch, per)]
    blocks = []
    for h in range(batch):
        for start in range(0, n, numbers):
            rows = min(numbers, n - start)
            pieces = rows // block_size if rows % block_size == 0 else 1
            blocks.append((slice(h, h + 1), slice(start, start + rows), pieces))
    return blocks


def _bidirectional(q, k, values, query_logs, key_logs, mask, block_size, output):
    carried = (None, None, None)  # constant (B, 1, w), seen (B, 1, 1), state (B, d_v + 1, m)
    for start in range(0, k.shape[1], block_size):
        rows = (start, min(start + block_size, k.shape[1]))
        carried = _bidirectional_keys(_Block(key_logs, k, mask, rows, carried), values)
    constant, seen, state = carried
    sums = state[:, -1:]  # (B, 1, m): sum_j phi(k_j), at least 1 where a key was seen
    if sums.shape[-1] != constant.shape[-1]:  # signed (trig) features: divide at the end
        for start in range(0, q.shape[1], block_size):
            phi_q = query_features(*query_logs(q[:, start : start + block_size], constant))
            output.add(start, torch.bmm(phi_q, state.transpose(-2, -1)))  # (B, b, d_v + 1)
        return
    # Positive features: out_i = sum_l p_il S_l / s_l with p_i = softmax_l(a_il + c_l +
    # log s_l) -- the normaliser D is the softmax's own, so no division pass, and the
    # product with the values has d_v columns, not d_v + 1. Rows with no key give 0.
    sums = torch.where(seen, sums, 1.0)  # (no NaN, not even in a gradient, for those rows)
    shift = torch.where(seen, constant + sums.log2(), 0.0)  # (B, 1, m), base 2
    values_t = torch.where(seen, state[:, :-1] / sums, 0.0).transpose(-2, -1).contiguous()
    for heads, rows, pieces in _query_blocks(q.shape[0], q.shape[1], block_size,
                                             output.recording):
        block = q[heads, rows]  # (B', b, e), or one batch row cut into pieces:
        block = block.reshape(pieces, -1, block.shape[-1]) if pieces > 1 else block
        p = query_features(*query_logs(block, shift[heads].expand(block.shape[0], -1, -1)))
        output.put(heads, rows, p, values_t[heads].expand(block.shape[0], -1, -1))


def _causal_rows(q, k, values, query_logs, key_logs, mask, rows, carried, chunk_size, output,
                 refresh=False):
    """Causal attention for rows ``rows = (start, stop)``; ``carried = (constant, seen,
    state)`` from the earlier rows, returned updated. A block whose sums would pass
    ``e^30`` with the kept constant is redone with a raised one (``_Block``,
    ``refresh``); if they still would, or when some batch row has no constant seen by
    all its queries, it is split in two."""
    start, stop = rows
    block = _Block(key_logs, k, mask, rows, carried, refresh)
    splittable = stop - start > 1
    retry = splittable or block.kept  # a kept constant can be raised, a block split
    if not (splittable and bool(block.unseen.any())):
        log, signed = block.logs()
        # Signed (trig) features: bounded by their log part, one number per key.
        if not (retry and signed is not None and _largest(log) > _SAFE_LOG2):
            phi_k = _key_features_(log, signed)  # (B, b, m)
            phi_q = query_features(*query_logs(q[:, start:stop], block.constant))
            v = values.rows(start, stop)  # (B, b, d_v + 1)
            chunk = chunk_size or default_chunk_size(phi_k.shape[-1], v.shape[-1])
            initial = None if block.state is None else block.state.transpose(-2, -1)
            both, state = causal_prefix_products(phi_q, phi_k, v, chunk, initial)
            if not retry or signed is not None or _largest(state[..., -1]) <= _LARGEST_SUM:
                output.add(start, both)
                return block.constant, block.seen, state.transpose(-2, -1)
    if block.kept:
        return _causal_rows(q, k, values, query_logs, key_logs, mask, rows, carried,
                            chunk_size, output, refresh=True)
    middle = (start + stop) // 2
    carried = _causal_rows(q, k, values, query_logs, key_logs, mask, (start, middle),
                           carried, chunk_size, output)
    return _causal_rows(q, k, values, query_logs, key_logs, mask, (middle, stop), carried,
                        chunk_size, output)


def stabilised_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_logs: LogFeatureMap,
    key_logs: LogFeatureMap,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    block_size: int,
    chunk_size: int | None,
    recording: bool,
) -> torch.Tensor:
    """``D^-1 phi(Q) (phi(K)^T V)`` for exponential features given by their logs.

    q ``(B, n_q, e)``, k ``(B, n_k, e')`` (the rows the maps take), v ``(B, n_k, d_v)``
    (compute dtype, padded rows already zero), mask ``(B, n_k)`` or None -> ``(B, n_q,
    d_v)``. The feature maps return ``(log, signed)`` with the feature ``signed *
    2^log`` (keys) or ``signed * exp(log)`` (queries), any constant per query row
    dropped, and take the per-feature constant to fold into their product (see
    :data:`LogFeatureMap`). A query with no unmasked key gets zeros. ``recording``:
    autograd records the call (the inputs or the maps' parameters require gradients);
    otherwise blocks reuse buffers.

    Cost: the feature products, ``O(n m d)``, one ``exp`` pass over the key features,
    one softmax over the query features, and the products with the values (``O(n m
    d_v)``; causal ``+ O(n C (m + d_v))``); a block that must be redone (a new maximum
    far above the constant) costs its products again, plus an ``amax`` pass. Memory:
    one block of features at a time in the forward pass; autograd keeps the features
    ``O(n m)`` and, when causal, one ``m x (d_v + 1)`` state per chunk.
    """
    n_q, n_k, d_v = q.shape[1], k.shape[1], v.shape[2]
    if n_q == 0 or n_k == 0 or q.shape[0] == 0:  # empty, or zeros for queries with no key
        return zeros_like_result((q.shape[0], n_q, d_v), q, k, v)
    scratch = None if recording else Scratch()
    output = _Output((q.shape[0], n_q, d_v), recording)
    values = _BlockValues(v, mask, scratch)  # [v, 1] block by block, padded rows zero
    if not causal:
        _bidirectional(q, k, values, query_logs, key_logs, mask, block_size, output)
        return output.result()
    carried = (None, None, None)  # constant (B, 1, w), seen (B, 1, 1), state (B, d_v + 1, m)
    for start in range(0, n_k, block_size):
        stop = min(start + block_size, n_k)
        carried = _causal_rows(q, k, values, query_logs, key_logs, mask, (start, stop),
                               carried, chunk_size, output)
    return output.result()
