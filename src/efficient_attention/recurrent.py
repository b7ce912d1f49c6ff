r"""Gated linear attention: a linear recurrence with a decaying matrix state.

Causal linear attention without a normaliser keeps the state ``S_t = S_{t-1} + k_t v_t^T``
(``d_k x d_v``) and reads it with the query. Gating lets the state forget:

.. math:: S_t = \mathrm{diag}(a_t) S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top q_t,
          \qquad a_t = \exp(\text{log\_decay}_t) \in (0, 1],

with one decay per token (``log_decay`` ``(..., n)``: RetNet when it is constant, Mamba-2 /
SSD when it depends on the data) or one per key channel (``(..., n, d_k)``: GLA).
Unrolled, ``o_i = sum_{j <= i} q_i^T diag(exp(c_i - c_j)) k_j v_j`` with the cumulative log
decays ``c_i = sum_{s <= i} log_decay_s``: attention with the weights ``q_i^T k_j`` times a
decay mask, the semiseparable matrix ``(Q K^T o L) V`` with ``L_ij = exp(c_i - c_j)``
(``j <= i``). The inputs are used as they are: no feature map, no ``1/sqrt(d)`` scaling,
no normaliser (as in RetNet, GLA and Mamba-2).

Three forms compute the same output (to rounding): ``"recurrent"`` (the loop above,
``O(n d_k d_v)`` time, one state in memory), ``"parallel"`` (the masked ``n x n`` matrix,
``O(n^2 d)``, for reference and teaching) and ``"chunkwise"`` (the default): split the
sequence into chunks of ``C`` tokens, compute inside each chunk the masked ``C x C``
product and carry one state from chunk to chunk. Time ``O(n C d + n d_k d_v)``, memory
``O(n d + n C)`` plus one state per chunk ``O(n d_k d_v / C)``: never ``n x n``, never one
state per token.

Stability: every exponential has an argument ``<= 0``, and every argument is a sum of its
own log decays, never the difference ``c_i - c_j`` of two long cumulative sums (which would
carry an error of ``eps |c_j|``: in float32, 1e-4 after a few hundred decays of -50).
Inside a chunk ``E_ji = sum_{j < s <= i} log_decay_s`` is a masked cumulative sum, set to
``-inf`` for ``j > i`` *before* the exponential; a key's decay to the chunk's end is a
suffix sum, a query's decay from the chunk's start a prefix sum. With one decay per
channel the chunk's scores ``sum_m q_im k_jm exp(E_jim)`` do not factor into a bounded
query part times a bounded key part (``q_i exp(c_i)`` and ``k_j exp(-c_j)`` overflow for
strong decays), so each chunk is split into sub-chunks of ``c`` tokens (GLA's secondary
chunking): between sub-chunks the exponent splits at ``e``, the start of the query's
sub-chunk, into ``sum_{e <= s <= i}`` (query side) and ``sum_{j < s < e}`` (key side),
both ``<= 0``; inside a sub-chunk the ``c x c x d_k`` weights are formed explicitly. This
costs ``O(n d_k (C / c + c))`` extra memory and elementwise work, with ``c = 4``
(measured fastest; ``C`` is rounded up to a multiple of ``c``, and a shorter sequence
padded to one, with tokens that change nothing: zero key, value and log decay).
Per-channel decay is several times slower than one decay per token
(``benchmarks/recurrent_speed.py``). The relative error of a weight is then about
``eps |E|``, the conditioning of ``exp`` itself: working precision even across decays of
``-1e4`` (a reset of the state).

Shapes follow ``(..., n, d)``. Half-precision inputs are computed in float32; the output
has the input dtype and a returned state the compute dtype (float32 for half inputs), so
that a continued run loses nothing.

References: Katharopoulos et al., "Transformers are RNNs", ICML 2020; Sun et al.,
"Retentive Network", 2023; Yang et al., "Gated Linear Attention Transformers with
Hardware-Efficient Training", ICML 2024; Dao and Gu, "Transformers are SSMs" (Mamba-2),
ICML 2024.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    check_bool,
    check_fraction,
    check_key_padding_mask,
    check_positive_float,
    check_positive_int,
    compute_dtype,
)
from ._padding import zero_padded_rows
from ._recurrence import (
    check_causal_inputs,
    check_chunk_size,
    check_form,
    check_gate,
    empty_result,
    init_decay_gate,
    pad_tokens,
    pair_exponents,
    prepare_sequence,
    prepare_step,
    row_blocks,
    step_batch,
    suffix_sums,
)

__all__ = ["gated_linear_attention", "gated_linear_attention_step", "GatedLinearAttention"]

# Chunk lengths measured with benchmarks/recurrent_speed.py (n = 8192, (1, 8, n, 64), float32)
DEFAULT_CHUNK_SIZE = 64  # one decay per token: 32 and 64 within noise, 128 slower
DEFAULT_CHANNEL_CHUNK_SIZE = 32  # one decay per channel: 16 and 32 close, 64 slower
SUB_CHUNK_SIZE = 4  # per-channel sub-chunks: 4 was faster than 8 at every chunk length
FORMS = ("recurrent", "parallel", "chunkwise")


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
    form: str = "chunkwise",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Causal gated linear attention ``S_t = diag(a_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``.

    Args:
        q, k: queries and keys ``(..., n, d_k)``, used as given (no scaling, no feature
            map, no normaliser).
        v: values ``(..., n, d_v)``.
        log_decay: ``log a_t <= 0``, finite: ``(..., n)`` (one dimension fewer than
            ``k``) for one decay per token, or ``(..., n, d_k)`` (as many dimensions as
            ``k``) for one per key channel. Same dtype as ``q``.
        chunk_size: tokens per chunk of the chunkwise form (default 64 with one decay
            per token, 32 per channel); per channel it is rounded up to a multiple of the
            sub-chunk ``c = 4`` (31 -> 32; padded tokens change nothing). The other forms
            ignore it.
        initial_state: ``S_0`` ``(..., d_k, d_v)`` or None (zeros).
        return_state: also return the final state ``S_n`` ``(..., d_k, d_v)``.
        form: ``"chunkwise"``, ``"recurrent"`` or ``"parallel"`` (see the module).

    Returns:
        ``o`` ``(..., n, d_v)`` in the dtype of ``q``, and ``S_n`` when ``return_state``
        (for ``n = 0``: an empty output and ``S_0``).

    Cost (chunkwise): time ``O(n C (d_k + d_v) + n d_k d_v)``, memory ``O(n (d + C))`` plus
    ``O(n d_k d_v / C)`` of chunk states (and, per channel, ``O(n d_k (C/c + c))``);
    recurrent: ``O(n d_k d_v)`` time, ``n`` sequential steps; parallel: ``O(n^2 d)``
    time, ``n x n`` (per channel ``n x n x d_k``) memory.
    """
    form = check_form(form, FORMS)
    chunk_size = check_chunk_size(chunk_size, None)
    return_state = check_bool(return_state, "return_state")
    seq = prepare_sequence(q, k, v, log_decay, initial_state)
    default = DEFAULT_CHANNEL_CHUNK_SIZE if seq.per_channel else DEFAULT_CHUNK_SIZE
    n = seq.q.shape[1]
    if n == 0 or seq.q.shape[0] == 0:
        out, state = empty_result(seq, q, n)
        return (out, state) if return_state else out
    log_decay = seq.log_decay if seq.per_channel else seq.log_decay.unsqueeze(-1)  # (B, n, g)
    if form == "chunkwise":
        out, state = _chunkwise(seq.q, seq.k, seq.v, log_decay, seq.state,
                                chunk_size or default)
    else:
        compute = _recurrent if form == "recurrent" else _parallel
        out, state = compute(seq.q, seq.k, seq.v, log_decay, seq.state)
    out = out.reshape(*seq.batch, n, seq.v.shape[-1]).to(q.dtype)
    if return_state:
        return out, state.reshape(*seq.batch, *state.shape[-2:])
    return out


def gated_linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    log_decay_t: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`gated_linear_attention`: ``(o_t, S_t)`` from ``S_{t-1}``.

    Shapes: ``q_t, k_t`` ``(..., d_k)``, ``v_t`` ``(..., d_v)``, ``log_decay_t`` ``(...)``
    (one decay) or ``(..., d_k)`` (per channel; as many dimensions as ``k_t``), ``state``
    ``(..., d_k, d_v)`` or None (zeros) -> ``o_t`` ``(..., d_v)`` in the dtype of
    ``q_t``, ``S_t`` ``(..., d_k, d_v)`` in the compute dtype. Cost ``O(d_k d_v)``.
    """
    q_t, k_t, v_t, state = prepare_step(q_t, k_t, v_t, state)
    log_decay_t, per_channel = check_gate(
        log_decay_t, "log_decay_t", k_t, per_channel_ok=True, nonpositive=True, sequence=False
    )
    batch = step_batch(q_t=(q_t, 1), k_t=(k_t, 1), v_t=(v_t, 1), state=(state, 2),
                       log_decay_t=(log_decay_t, int(per_channel)))
    dtype = compute_dtype(q_t)
    decay = log_decay_t.to(dtype).exp()
    decay = decay if per_channel else decay.unsqueeze(-1)  # (..., d_k) or (..., 1)
    state = None if state is None else state.to(dtype)
    o_t, new_state = _update(q_t.to(dtype), k_t.to(dtype), v_t.to(dtype), decay, state)
    d_k, d_v = k_t.shape[-1], v_t.shape[-1]
    return o_t.expand(*batch, d_v).to(q_t.dtype), new_state.expand(*batch, d_k, d_v)


def _update(q, k, v, decay, state):
    """``S = decay[:, None] * S + k v^T``, ``o = S^T q``; decay ``(..., 1)`` or ``(..., d_k)``."""
    new_state = k.unsqueeze(-1) * v.unsqueeze(-2)  # (..., d_k, d_v)
    if state is not None:
        new_state = new_state + decay.unsqueeze(-1) * state
    return (q.unsqueeze(-2) @ new_state).squeeze(-2), new_state


def _recurrent(q, k, v, log_decay, state):
    """The recurrence, token by token: ``(B, n, .)`` -> ``(B, n, d_v)``, ``(B, d_k, d_v)``.

    log_decay ``(B, n, g)`` with ``g = 1`` (one decay per token) or ``d_k``.
    """
    outputs = []
    for q_t, k_t, v_t, decay_t in zip(*(x.unbind(1) for x in (q, k, v, log_decay.exp())),
                                      strict=True):
        o_t, state = _update(q_t, k_t, v_t, decay_t, state)  # unbind: one stack backward
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), state


def channel_scores(q: torch.Tensor, k: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``T[j, i] = sum_m k_jm q_im exp(E[j, i, m])``: the transposed scores, per channel.

    q, k ``(..., L, d_k)``, exponents ``(..., L_j, L_i, d_k)`` -> ``(..., L_j, L_i)``.
    Explicit ``L x L x d_k`` weights: cost ``O(L^2 d_k)`` time and memory.
    """
    weighted = exponents.exp() * q.unsqueeze(-3)  # (..., L_j, L_i, d_k)
    return (weighted @ k.unsqueeze(-1)).squeeze(-1)  # sum over m, one product per key j


def _parallel(q, k, v, log_decay, state):
    """``(Q K^T o L) V`` with the ``n x n`` decay mask ``L`` (per channel inside the sum)."""
    exponents = pair_exponents(log_decay)  # (B, n_j, n_i, g)
    if log_decay.shape[-1] == 1:
        scores_t = (k @ q.transpose(-2, -1)) * exponents.squeeze(-1).exp()  # (B, n_j, n_i)
    else:
        scores_t = channel_scores(q, k, exponents)
    out = scores_t.transpose(-2, -1) @ v  # (B, n, d_v)
    to_end = exponents[:, :, -1].exp()  # (B, n, g): decay from key j to the last token
    final = (k * to_end).transpose(-2, -1) @ v  # (B, d_k, d_v)
    if state is not None:
        cumulative = log_decay.cumsum(dim=1)  # (B, n, g), <= 0
        out = out + (q * cumulative.exp()) @ state
        final = final + cumulative[:, -1].exp().unsqueeze(-1) * state
    return out, final


def channel_chunk_sizes(chunk: int) -> tuple[int, int]:
    """Chunk and sub-chunk ``(C', c)`` of the per-channel form asked for chunks of ``C``.

    ``c = min(C, SUB_CHUNK_SIZE)`` and ``C' = c ceil(C / c)``: ``C`` rounded up to a
    multiple of ``c`` (31 -> 32, 37 -> 40), so that no chunk length falls back to
    sub-chunks of one token (9x the time and 5x the memory for ``C = 31``).
    """
    sub = min(chunk, SUB_CHUNK_SIZE)
    return -(-chunk // sub) * sub, sub


def sub_chunk_size(chunk: int) -> int:
    """Sub-chunk ``c`` of the per-channel form for chunks of ``C``: ``min(C, 4)``."""
    return channel_chunk_sizes(chunk)[1]


def _chunkwise(q, k, v, log_decay, state, chunk):
    """Chunks of ``C`` tokens, a block of rows at a time, the state carried along."""
    if log_decay.shape[-1] > 1:  # per channel: a multiple of the sub-chunk
        chunk = channel_chunk_sizes(chunk)[0]
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
    outputs = []
    for block in row_blocks((q, k, v, log_decay), chunk):
        out, state = _chunk_block(*block, state, chunk)
        outputs.append(out)
    return torch.cat(outputs, dim=1), state


def _chunk_block(q, k, v, log_decay, state, chunk):
    """``(B, n, .)`` -> ``(B, n, d_v)`` and the final state, starting from ``state``."""
    batch, n, d_k = q.shape
    d_v, size, per_channel = v.shape[-1], min(chunk, n), log_decay.shape[-1] > 1
    if per_channel:  # a short sequence too: padded to a multiple of the sub-chunk
        size, sub = channel_chunk_sizes(size)
    pad = (-n) % size
    q, k, v, log_decay = (pad_tokens(x, pad) for x in (q, k, v, log_decay))
    chunks = (n + pad) // size
    q_c = q.reshape(batch, chunks, size, d_k)
    k_c = k.reshape(batch, chunks, size, d_k)
    v_c = v.reshape(batch, chunks, size, d_v)
    x = log_decay.reshape(batch, chunks, size, -1)  # (B, N, C, g)
    if per_channel:
        out = _per_channel_in_chunk(q_c, k_c, v_c, x, sub)
    else:
        out = _scalar_in_chunk(q_c, k_c, v_c, x)
    # Between chunks: S_c = exp(sum_chunk x) S_{c-1} + sum_j exp(sum_{s > j} x_s) k_j v_j^T.
    updates = (k_c * suffix_sums(x).exp()).transpose(-2, -1) @ v_c  # (B, N, d_k, d_v)
    cumulative = x.cumsum(dim=2)  # (B, N, C, g): from the chunk's start to i, inclusive
    chunk_decay = cumulative[:, :, -1:].exp().transpose(-2, -1)  # (B, N, g, 1)
    before = []  # the state entering each chunk
    for update, decay in zip(updates.unbind(1), chunk_decay.unbind(1), strict=True):
        before.append(state)
        state = torch.addcmul(update, decay, state)
    flat = batch * chunks
    reads = (q_c * cumulative.exp()).reshape(flat, size, d_k)  # q_i decayed from chunk start
    out = torch.baddbmm(out.reshape(flat, size, d_v), reads,
                        torch.stack(before, dim=1).reshape(flat, d_k, d_v))  # (B N, C, d_v)
    return out.reshape(batch, chunks * size, d_v)[:, :n], state


def _scalar_in_chunk(q_c, k_c, v_c, x):
    """``((Q K^T) o L) V`` inside each chunk, ``L_ij = exp(sum_{j < s <= i} x_s)``.

    q_c, k_c ``(B, N, C, d_k)``, v_c ``(B, N, C, d_v)``, x ``(B, N, C, 1)``.
    """
    decay_mask_t = pair_exponents(x).squeeze(-1).exp()  # (B, N, C_j, C_i), masked before exp
    scores_t = (k_c @ q_c.transpose(-2, -1)) * decay_mask_t
    return scores_t.transpose(-2, -1) @ v_c


def _per_channel_in_chunk(q_c, k_c, v_c, x, sub):
    """``sum_{j <= i} (sum_m q_im k_jm exp(sum_{j < s <= i} x_sm)) v_j`` inside each chunk.

    x ``(B, N, C, d_k)``; ``sub`` (``c``) divides ``C``. Inside a sub-chunk the weights are
    explicit (``c x c x d_k``). Between a key in sub-chunk ``r`` and a query in a later
    sub-chunk ``p`` the exponent splits at ``e``, the start of sub-chunk ``p``: the query
    part ``sum_{e <= s <= i}`` and the key part ``sum_{j < s < e}`` (itself the rest of
    sub-chunk ``r`` plus the whole sub-chunks between), both ``<= 0``.
    """
    batch, chunks, size, d_k = q_c.shape
    parts = size // sub
    shape = (batch, chunks, parts, sub)
    q_s, k_s, x_s = q_c.reshape(*shape, d_k), k_c.reshape(*shape, d_k), x.reshape(*shape, d_k)
    scores_t = channel_scores(q_s, k_s, pair_exponents(x_s))  # (B, N, P, c_j, c_i)
    out = (scores_t.transpose(-2, -1) @ v_c.reshape(*shape, -1)).reshape(batch, chunks, size, -1)
    if parts == 1:
        return out
    within = x_s.cumsum(dim=-2)  # (B, N, P, c, d_k): from the sub-chunk's start to i
    q_ref = q_s[:, :, 1:] * within[:, :, 1:].exp()  # queries of the sub-chunks p >= 1
    k_rest = k_s * suffix_sums(x_s).exp()  # key j to the end of its sub-chunk
    # gaps[r, p - 1] = sum of the whole sub-chunks strictly between r and p (-inf: p <= r)
    gaps = pair_exponents(within[:, :, :, -1])[:, :, :, :-1]  # (B, N, P_r, P - 1, d_k)
    gaps = gaps.exp().transpose(2, 3).contiguous()  # (B, N, P - 1, P_r, d_k), small
    k_ref = k_rest.unsqueeze(2) * gaps.unsqueeze(-2)  # (B, N, P - 1, P_r, c, d_k)
    k_ref = k_ref.reshape(batch, chunks, parts - 1, size, d_k)  # (B, N, P - 1, C, d_k)
    between = (q_ref @ k_ref.transpose(-2, -1)).reshape(batch, chunks, size - sub, size)
    return out + F.pad(between @ v_c, (0, 0, sub, 0))  # sub-chunk 0 has no earlier one


class GatedLinearAttention(nn.Module):
    r"""Gated linear attention with a decay computed from the keys (GLA-style), causal only.

    ``log_decay = logsigmoid(k W^T + b) / temperature`` (one value per token, or one per
    key channel with ``per_channel``), then :func:`gated_linear_attention` on
    ``(q / sqrt(d_head), k, v)`` (GLA scales the queries so). ``W`` starts at zero and
    ``b`` so that every decay starts at ``initial_decay``: the model starts with a
    memory of about ``1 / (1 - initial_decay)`` tokens and learns data-dependent decays.

    Args:
        dim_head: feature size ``d`` of q, k and v.
        per_channel: one decay per key channel (GLA) instead of one per token.
        temperature: ``tau > 0``; larger keeps the decays closer to 1 (GLA uses 16).
        initial_decay: the decay at initialisation, in ``(0, 1)``.
        chunk_size: passed to :func:`gated_linear_attention`.

    ``forward(q, k, v, *, causal=False, key_padding_mask=None)`` on ``(..., n, d)``:
    ``causal=False`` raises ``ValueError`` (a recurrence only sees the past). A padded
    key (``key_padding_mask`` ``True``, broadcastable to ``k.shape[:-1]``) adds nothing
    to the state and does not decay it (zero key and value, log decay 0).
    """

    def __init__(
        self,
        dim_head: int,
        *,
        per_channel: bool = False,
        temperature: float = 16.0,
        initial_decay: float = 0.99,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.dim_head = check_positive_int(dim_head, "dim_head")
        self.per_channel = check_bool(per_channel, "per_channel")
        self.temperature = check_positive_float(temperature, "temperature")
        initial_decay = check_fraction(initial_decay, "initial_decay")
        self.chunk_size = check_chunk_size(chunk_size, None)
        self.decay = nn.Linear(dim_head, dim_head if per_channel else 1)
        init_decay_gate(self.decay, initial_decay, self.temperature)

    def log_decay(self, k: torch.Tensor) -> torch.Tensor:
        """``logsigmoid(k W^T + b) / tau``: ``(..., n, d)`` -> ``(..., n)`` or ``(..., n, d)``."""
        log_decay = F.logsigmoid(self.decay(k)) / self.temperature
        return log_decay if self.per_channel else log_decay.squeeze(-1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = check_causal_inputs(q, k, v, causal, self)
        mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
        k, v = zero_padded_rows(k, mask), zero_padded_rows(v, mask)
        log_decay = self.log_decay(k)
        if mask is not None:  # a padded token keeps the state as it is
            log_decay = log_decay.masked_fill(mask.unsqueeze(-1) if self.per_channel else mask,
                                              0.0)
        scale = self.dim_head**-0.5
        return gated_linear_attention(q * scale, k, v, log_decay, chunk_size=self.chunk_size)

