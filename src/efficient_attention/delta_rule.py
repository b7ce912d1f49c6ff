r"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet): a state that overwrites.

Linear attention only adds to its state, so old associations pile up. The delta rule
first reads what the state stores for the key, and writes the difference:

.. math:: S_t = a_t (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top
              = a_t S_{t-1} + k_t \big(\beta_t (v_t - a_t S_{t-1}^\top k_t)\big)^\top,
          \qquad o_t = S_t^\top q_t,

one step of gradient descent on ``|S^T k_t - v_t|^2 / 2`` with learning rate ``beta_t``
(Widrow and Hoff 1960; Schlag et al. 2021). ``a_t = exp(log_decay_t)`` (one decay per
token) adds forgetting (Gated DeltaNet); without ``log_decay``, ``a_t = 1`` (DeltaNet).
The inputs are used as given: no feature map, no scaling, no normaliser. The keys should
be unit vectors (the caller L2-normalises them; :class:`DeltaRuleAttention` does): then
``I - beta k k^T`` has norm ``max(1, |1 - beta|)``, so for ``beta`` in ``[0, 2]`` every step
is a contraction and the state stays bounded (``beta = 1`` replaces the value stored under
``k``). For ``beta`` outside ``[0, 2]``, or keys longer than 1, the state can grow
exponentially with ``n``; the result is still the recurrence above, rounding errors and all.

Forms: ``"recurrent"`` (token by token, ``O(n d_k d_v)``) and ``"chunkwise"`` (the default;
Yang et al. 2024). Inside a chunk of ``C`` tokens the corrections ``r_t = beta_t (v_t -
a_t S_{t-1}^T k_t)`` solve one unit lower-triangular system (the WY / UT representation):
with the state ``S_0`` entering the chunk, ``g_t = exp(sum_{s <= t} log_decay_s)`` and
``G_tj = exp(sum_{j < s <= t} log_decay_s)``,

.. math:: (I + \mathrm{diag}(\beta) (K K^\top \circ G)_{\text{strictly lower}}) R
          = \mathrm{diag}(\beta) (V - \mathrm{diag}(g) K S_0),

so ``R = U - W S_0`` with ``U, W`` from one triangular solve that does not depend on
``S_0``. Then ``O = (diag(g) Q - M W) S_0 + M U`` with ``M = (Q K^T o G)`` (lower,
diagonal included), and the next state is ``S_C = (g_C I - K_end^T W) S_0 + K_end^T U``
with ``K_end`` the keys decayed to the chunk's end: one ``d_k x d_k`` matrix product per
chunk is all that runs in sequence. Every exponent is a sum of log decays ``<= 0``.

Cost (chunkwise): time ``O(n C (d_k + d_v) + n d_k (d_k + d_v))``, memory ``O(n (d + C))``
plus ``O(n d_k (d_k + d_v) / C)`` for the chunk matrices. Half-precision inputs are
computed in float32; the output has the input dtype, a returned state the compute dtype.

References: Schlag, Irie and Schmidhuber, "Linear Transformers Are Secretly Fast Weight
Programmers", ICML 2021; Yang et al., "Parallelizing Linear Transformers with the Delta
Rule over Sequence Length", NeurIPS 2024; Yang, Kautz and Hatamizadeh, "Gated Delta
Networks: Improving Mamba2 with Delta Rule", ICLR 2025.
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

__all__ = ["delta_rule_attention", "delta_rule_step", "DeltaRuleAttention"]

DEFAULT_CHUNK_SIZE = 64
FORMS = ("recurrent", "chunkwise")


def delta_rule_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
    form: str = "chunkwise",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Causal delta-rule attention ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``.

    Args:
        q, k: queries and keys ``(..., n, d_k)``, used as given; the keys should have
            unit length (normalise them first).
        v: values ``(..., n, d_v)``.
        beta: write strengths ``(..., n)`` (one dimension fewer than ``k``), finite;
            ``[0, 1]`` is the usual range, ``[0, 2]`` keeps the state bounded.
        log_decay: ``(..., n)``, finite and ``<= 0`` (Gated DeltaNet), or None (``a = 1``).
        chunk_size: tokens per chunk of the chunkwise form (default 64).
        initial_state: ``S_0`` ``(..., d_k, d_v)`` or None (zeros).
        return_state: also return the final state ``S_n``.
        form: ``"chunkwise"`` or ``"recurrent"``.

    Returns:
        ``o`` ``(..., n, d_v)`` (``o_t = S_t^T q_t``) in the dtype of ``q``, and ``S_n``
        ``(..., d_k, d_v)`` when ``return_state``.

    Cost: see the module (chunkwise ``O(n C d + n d^2)``; recurrent ``O(n d_k d_v)`` in
    ``n`` sequential steps).
    """
    form = check_form(form, FORMS)
    chunk = check_chunk_size(chunk_size, DEFAULT_CHUNK_SIZE)
    return_state = check_bool(return_state, "return_state")
    seq = prepare_sequence(q, k, v, log_decay, initial_state, beta=beta, with_beta=True,
                           per_channel_ok=False)
    n = seq.q.shape[1]
    if n == 0 or seq.q.shape[0] == 0:
        out, state = empty_result(seq, q, n)
        return (out, state) if return_state else out
    log_decay = seq.log_decay if seq.log_decay is not None else torch.zeros_like(seq.beta)
    compute = _chunkwise if form == "chunkwise" else _recurrent
    out, state = compute(seq.q, seq.k, seq.v, seq.beta, log_decay, seq.state, chunk)
    out = out.reshape(*seq.batch, n, seq.v.shape[-1]).to(q.dtype)
    if return_state:
        return out, state.reshape(*seq.batch, *state.shape[-2:])
    return out


def delta_rule_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    beta_t: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    log_decay_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`delta_rule_attention`: ``(o_t, S_t)`` from ``S_{t-1}``.

    Shapes: ``q_t, k_t`` ``(..., d_k)``, ``v_t`` ``(..., d_v)``, ``beta_t`` and
    ``log_decay_t`` ``(...)``, ``state`` ``(..., d_k, d_v)`` or None (zeros) -> ``o_t``
    ``(..., d_v)`` in the dtype of ``q_t``, ``S_t`` in the compute dtype. Cost ``O(d_k d_v)``.
    """
    q_t, k_t, v_t, state = prepare_step(q_t, k_t, v_t, state)
    gates = {"beta_t": beta_t, "log_decay_t": log_decay_t}
    for name, gate in gates.items():
        if gate is not None or name == "beta_t":  # beta_t is required
            gates[name], _ = check_gate(gate, name, k_t, per_channel_ok=False,
                                        nonpositive=name == "log_decay_t", sequence=False)
    batch = step_batch(q_t=(q_t, 1), k_t=(k_t, 1), v_t=(v_t, 1), state=(state, 2),
                       beta_t=(gates["beta_t"], 0), log_decay_t=(gates["log_decay_t"], 0))
    dtype = compute_dtype(q_t)
    decay = None if log_decay_t is None else gates["log_decay_t"].to(dtype).exp()
    state = None if state is None else state.to(dtype)
    o_t, new_state = _update(q_t.to(dtype), k_t.to(dtype), v_t.to(dtype),
                             gates["beta_t"].to(dtype), decay, state)
    d_k, d_v = k_t.shape[-1], v_t.shape[-1]
    return o_t.expand(*batch, d_v).to(q_t.dtype), new_state.expand(*batch, d_k, d_v)


def _update(q, k, v, beta, decay, state):
    """``S = a S + k (beta (v - a S^T k))^T``, ``o = S^T q``; beta, decay ``(...)`` or None."""
    beta = beta.unsqueeze(-1)  # (..., 1)
    if state is None:  # S_0 = 0: nothing to read, nothing to decay
        new_state = k.unsqueeze(-1) * (beta * v).unsqueeze(-2)
    else:
        if decay is not None:
            state = decay.unsqueeze(-1).unsqueeze(-1) * state
        stored = (k.unsqueeze(-2) @ state).squeeze(-2)  # (..., d_v): a S^T k
        new_state = state + k.unsqueeze(-1) * (beta * (v - stored)).unsqueeze(-2)
    return (q.unsqueeze(-2) @ new_state).squeeze(-2), new_state


def _recurrent(q, k, v, beta, log_decay, state, chunk):
    """Token by token: ``(B, n, .)`` -> ``(B, n, d_v)`` and ``(B, d_k, d_v)``."""
    outputs = []
    for q_t, k_t, v_t, beta_t, decay_t in zip(
            *(x.unbind(1) for x in (q, k, v, beta, log_decay.exp())), strict=True):
        o_t, state = _update(q_t, k_t, v_t, beta_t, decay_t, state)
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), state


def _chunkwise(q, k, v, beta, log_decay, state, chunk):
    """Chunks of ``C`` tokens, a block of rows at a time, the state carried along."""
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
    outputs = []
    for block in row_blocks((q, k, v, beta, log_decay), chunk):
        out, state = _chunk_block(*block, state, chunk)
        outputs.append(out)
    return torch.cat(outputs, dim=1), state


def _chunk_block(q, k, v, beta, log_decay, state, chunk):
    """``(B, n, .)`` -> ``(B, n, d_v)`` and the final state, starting from ``state``."""
    batch, n, d_k = q.shape
    d_v, size = v.shape[-1], min(chunk, n)
    pad = (-n) % size  # padded tokens: k = v = 0, beta = 0, no decay -- the identity step
    q, k, v, beta, log_decay = (pad_tokens(x, pad) for x in (q, k, v, beta, log_decay))
    chunks = (n + pad) // size
    q_c = q.reshape(batch, chunks, size, d_k)
    k_c = k.reshape(batch, chunks, size, d_k)
    v_c = v.reshape(batch, chunks, size, d_v)
    beta_c = beta.reshape(batch, chunks, size, 1)
    x = log_decay.reshape(batch, chunks, size, 1)
    decay_t = pair_exponents(x).squeeze(-1).exp()  # (B, N, C_j, C_t): G^T, zero for j > t
    pos = torch.arange(size, device=q.device)
    not_strictly_lower = pos.unsqueeze(-1) <= pos  # (C_t, C_j): j >= t
    strict = ((k_c @ k_c.transpose(-2, -1)) * decay_t.transpose(-2, -1)).masked_fill_(
        not_strictly_lower, 0.0)  # (B, N, C, C): G_tj k_t.k_j for j < t
    gain = x.cumsum(dim=2).exp()  # (B, N, C, 1): g_t, decay from the chunk's start
    solved = torch.linalg.solve_triangular(  # (I + diag(beta) strict)^-1 diag(beta) [V, gK]
        beta_c * strict, beta_c * torch.cat([v_c, gain * k_c], dim=-1),
        upper=False, unitriangular=True)  # [U, W]: R = U - W S_0
    mixing = (q_c @ k_c.transpose(-2, -1)) * decay_t.transpose(-2, -1)  # M, lower
    mixed = mixing @ solved  # [M U, M W]
    reads = gain * q_c - mixed[..., d_v:]  # (B, N, C, d_k): O = reads S_0 + M U
    k_end = k_c * suffix_sums(x).exp()  # keys decayed to the chunk's end
    ends = k_end.transpose(-2, -1) @ solved  # [K_end^T U, K_end^T W]: (B, N, d_k, d_v + d_k)
    eye = torch.eye(d_k, dtype=q.dtype, device=q.device)
    transition = gain[:, :, -1:] * eye - ends[..., d_v:]  # (B, N, d_k, d_k)
    written = ends[..., :d_v]  # (B, N, d_k, d_v)
    before = []  # the state entering each chunk
    for write, transit in zip(written.unbind(1), transition.unbind(1), strict=True):
        before.append(state)
        state = torch.baddbmm(write, transit, state)
    flat = batch * chunks
    out = torch.baddbmm(mixed[..., :d_v].reshape(flat, size, d_v), reads.reshape(flat, size, d_k),
                        torch.stack(before, dim=1).reshape(flat, d_k, d_v))  # (B N, C, d_v)
    return out.reshape(batch, chunks * size, d_v)[:, :n], state


class DeltaRuleAttention(nn.Module):
    r"""DeltaNet (or, with ``gated``, Gated DeltaNet) attention, causal only.

    ``beta = sigmoid(k W_b^T + b_b)`` per token, computed from the raw keys; then the
    queries and keys are L2-normalised (as in DeltaNet) and :func:`delta_rule_attention`
    runs on them. With ``gated``, ``log_decay = logsigmoid(k W_a^T + b_a) / temperature``,
    ``W_a`` zero and ``b_a`` set so that every decay starts at ``initial_decay``.

    Args:
        dim_head: feature size ``d`` of q, k and v.
        gated: add the decay ``a_t`` (Gated DeltaNet).
        temperature, initial_decay: of the decay, as in
            :class:`~efficient_attention.GatedLinearAttention`.
        chunk_size: passed to :func:`delta_rule_attention`.

    ``forward(q, k, v, *, causal=False, key_padding_mask=None)`` on ``(..., n, d)``:
    ``causal=False`` raises ``ValueError``. A padded key (``True`` in
    ``key_padding_mask``, broadcastable to ``k.shape[:-1]``) changes nothing in the state:
    zero key and value, ``beta = 0``, no decay.
    """

    def __init__(
        self,
        dim_head: int,
        *,
        gated: bool = False,
        temperature: float = 16.0,
        initial_decay: float = 0.99,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.dim_head = check_positive_int(dim_head, "dim_head")
        self.gated = check_bool(gated, "gated")
        self.temperature = check_positive_float(temperature, "temperature")
        initial_decay = check_fraction(initial_decay, "initial_decay")
        self.chunk_size = check_chunk_size(chunk_size, None)
        self.beta = nn.Linear(dim_head, 1)
        self.decay = nn.Linear(dim_head, 1) if gated else None
        if self.decay is not None:
            init_decay_gate(self.decay, initial_decay, self.temperature)

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
        beta = torch.sigmoid(self.beta(k)).squeeze(-1)  # (..., n)
        log_decay = None
        if self.decay is not None:
            log_decay = F.logsigmoid(self.decay(k)).squeeze(-1) / self.temperature
        if mask is not None:  # a padded token leaves the state as it is
            beta = beta.masked_fill(mask, 0.0)
            log_decay = None if log_decay is None else log_decay.masked_fill(mask, 0.0)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return delta_rule_attention(q, k, v, beta, log_decay=log_decay,
                                    chunk_size=self.chunk_size)
