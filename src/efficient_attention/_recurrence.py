"""Input checks and batch handling shared by the gated and the delta-rule recurrences.

Both recurrences take queries, keys and values ``(..., n, d)`` plus per-token gates: a
log decay ``(..., n)`` (one per token) or ``(..., n, d_k)`` (one per key channel), and,
for the delta rule, a write strength ``beta`` ``(..., n)``. Which of the two shapes a
gate has is decided by its rank, never guessed from sizes: one dimension fewer than
``k`` means one value per token, as many dimensions as ``k`` one per key channel. The
leading dimensions of every input broadcast together; the functions flatten them to one
batch dimension ``B`` and compute on ``(B, n, x)`` tensors.

The step functions (one token) take the same inputs without the ``n`` axis.

The chunkwise forms share the sums of log decays (:func:`pair_exponents`,
:func:`suffix_sums`: every exponent a sum of its own terms, ``<= 0``) and the split of a
sequence into blocks of rows (:func:`row_blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import (
    broadcast_shapes,
    check_bool,
    check_module_input,
    check_positive_int,
    check_qkv,
    check_representable,
    check_tensor,
    compute_dtype,
)

BLOCK_ROWS = 1024  # rows computed at a time: the chunk tensors of a block stay in cache


def check_form(form: object, allowed: tuple[str, ...]) -> str:
    """Return ``form`` if it is one of ``allowed``."""
    if not isinstance(form, str) or form not in allowed:
        raise ValueError(f"form must be one of {allowed}, got {form!r}")
    return form


def check_chunk_size(chunk_size: object, default: int | None) -> int | None:
    """``chunk_size`` is ``None`` (``default``) or a positive int."""
    return default if chunk_size is None else check_positive_int(chunk_size, "chunk_size")


def check_gate(
    x: object,
    name: str,
    k: torch.Tensor,
    *,
    per_channel_ok: bool,
    nonpositive: bool,
    sequence: bool = True,
) -> tuple[torch.Tensor, bool]:
    """Validate a gate against the keys ``k``; return it and whether it is per channel.

    With ``sequence`` (``k`` is ``(..., n, d_k)``): a tensor of ``k.dim() - 1``
    dimensions ``(..., n)`` holds one value per token; when ``per_channel_ok``, one of
    ``k.dim()`` dimensions ``(..., n, d_k)`` one per key channel. Without ``sequence``
    (``k_t`` is one token ``(..., d_k)``) the same shapes lack the ``n``, and the messages
    speak of ``k_t``. The dtype and device must be those of ``k``; values must be finite,
    and ``<= 0`` when ``nonpositive`` (a log decay: ``exp(x)`` in ``(0, 1]``).
    """
    keys, sizes = ("k", "n and d_k those") if sequence else ("k_t", "d_k that")
    single, channel = ("(..., n)", "(..., n, d_k)") if sequence else ("(...)", "(..., d_k)")
    shapes = single + (f" or {channel}" if per_channel_ok else "")
    x = check_tensor(x, name, min_dim=0, shape=shapes)
    wanted = f"{single} (one value per token: one dimension fewer than {keys})"
    if per_channel_ok:
        wanted += f" or {channel} (one per key channel: as many dimensions as {keys})"
    per_channel = per_channel_ok and x.dim() == k.dim()
    token = tuple(k.shape[-2:-1]) if sequence else ()  # (n,) or ()
    expected = token + ((k.shape[-1],) if per_channel else ())
    if not (per_channel or x.dim() == k.dim() - 1) or tuple(
        x.shape[x.dim() - len(expected):]
    ) != expected:
        raise ValueError(
            f"{name} must have shape {wanted}, with {sizes} of {keys}.shape="
            f"{tuple(k.shape)} and size-1 leading dimensions to broadcast; got shape "
            f"{tuple(x.shape)}"
        )
    if x.dtype != k.dtype:
        inputs = "q, k and v" if sequence else "q_t, k_t and v_t"
        raise TypeError(f"{name} must have the dtype of {inputs} ({k.dtype}), got {x.dtype}")
    if x.device != k.device:
        raise ValueError(f"{name} must be on the device of {keys} ({k.device}), got {x.device}")
    values = x.detach()
    if values.numel():
        low, high = torch.aminmax(values)  # one pass; NaN makes both NaN
        if not (low > -math.inf and (high <= 0 if nonpositive else high < math.inf)):
            bad = ~torch.isfinite(values) | (values > 0 if nonpositive else False)
            wanted = (f"finite and <= 0 (a decay exp({name}) in (0, 1])" if nonpositive
                      else "finite")
            raise ValueError(f"{name} must be {wanted}, got {values[bad][0].item()}")
    return x, per_channel


def check_state(
    state: object, name: str, d_k: int, d_v: int, like: torch.Tensor, keys: str = "k"
) -> torch.Tensor | None:
    """A state ``(..., d_k, d_v)`` in the dtype of ``like`` (the keys, called ``keys`` in
    messages) or its compute dtype, or None."""
    if state is None:
        return None
    state = check_tensor(state, name, min_dim=2)
    if tuple(state.shape[-2:]) != (d_k, d_v):
        raise ValueError(
            f"{name} must have shape (..., d_k, d_v) = (..., {d_k}, {d_v}), got "
            f"{tuple(state.shape)}"
        )
    allowed = {like.dtype, compute_dtype(like)}
    if state.dtype not in allowed:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, allowed))}, got "
                        f"{state.dtype}")
    if state.device != like.device:
        raise ValueError(f"{name} must be on the device of {keys} ({like.device}), got "
                         f"{state.device}")
    return state


def broadcast_batch(**batch_shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast of the leading (batch) dimensions, or a ValueError naming them all."""
    try:
        return tuple(broadcast_shapes(*batch_shapes.values()))
    except RuntimeError as err:
        got = ", ".join(f"{name}: {shape}" for name, shape in batch_shapes.items())
        raise ValueError(
            f"the batch dimensions (...) of the inputs must broadcast together, got {got}"
        ) from err


def flatten(x: torch.Tensor | None, batch: tuple[int, ...], tail: int, dtype: torch.dtype):
    """``(..., *last tail dims)`` -> ``(B, *last tail dims)`` in ``dtype``; None stays None."""
    if x is None:
        return None
    shape = tuple(x.shape[x.dim() - tail:])
    return x.expand(*batch, *shape).reshape(math.prod(batch), *shape).to(dtype)


@dataclass
class Sequence:
    """Validated inputs of a recurrence, flattened to ``(B, n, x)`` in the compute dtype."""

    batch: tuple[int, ...]
    dtype: torch.dtype  # the compute dtype (float32 for half inputs)
    q: torch.Tensor  # (B, n, d_k)
    k: torch.Tensor  # (B, n, d_k)
    v: torch.Tensor  # (B, n, d_v)
    log_decay: torch.Tensor | None  # (B, n) or (B, n, d_k)
    per_channel: bool
    beta: torch.Tensor | None  # (B, n)
    state: torch.Tensor | None  # (B, d_k, d_v)


def prepare_sequence(
    q: object,
    k: object,
    v: object,
    log_decay: object,
    initial_state: object,
    *,
    beta: object = None,
    with_beta: bool = False,
    per_channel_ok: bool = True,
) -> Sequence:
    """Validate and flatten the inputs of a recurrence over ``n`` tokens.

    ``with_beta`` (the delta rule): ``beta`` is required, and ``log_decay`` may be None
    (no decay).
    """
    q, k, v = check_qkv(q, k, v)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            "q and k must have the same length n (output t reads the state after token t), "
            f"got q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)}"
        )
    per_channel = False
    shapes = {"q": q.shape[:-2], "k": k.shape[:-2], "v": v.shape[:-2]}
    if log_decay is not None or not with_beta:
        log_decay, per_channel = check_gate(
            log_decay, "log_decay", k, per_channel_ok=per_channel_ok, nonpositive=True
        )
        shapes["log_decay"] = log_decay.shape[: log_decay.dim() - 1 - per_channel]
    if with_beta:
        beta, _ = check_gate(beta, "beta", k, per_channel_ok=False, nonpositive=False)
        shapes["beta"] = beta.shape[:-1]
    d_k, d_v = k.shape[-1], v.shape[-1]
    state = check_state(initial_state, "initial_state", d_k, d_v, k)
    if state is not None:
        shapes["initial_state"] = state.shape[:-2]
    batch = broadcast_batch(**{name: tuple(shape) for name, shape in shapes.items()})
    dtype = compute_dtype(q)
    return Sequence(
        batch=batch,
        dtype=dtype,
        q=flatten(q, batch, 2, dtype),
        k=flatten(k, batch, 2, dtype),
        v=flatten(v, batch, 2, dtype),
        log_decay=flatten(log_decay, batch, 1 + per_channel, dtype),
        per_channel=per_channel,
        beta=flatten(beta, batch, 1, dtype),
        state=flatten(state, batch, 2, dtype),
    )


def prepare_step(
    q_t: object, k_t: object, v_t: object, state: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate one token ``q_t, k_t (..., d_k)``, ``v_t (..., d_v)`` and a state or None."""
    q_t = check_tensor(q_t, "q_t", min_dim=1)
    k_t = check_tensor(k_t, "k_t", min_dim=1)
    v_t = check_tensor(v_t, "v_t", min_dim=1)
    if q_t.shape[-1] != k_t.shape[-1] or k_t.shape[-1] == 0:
        raise ValueError(
            f"q_t and k_t must share their last dimension d_k >= 1, got q_t.shape="
            f"{tuple(q_t.shape)} and k_t.shape={tuple(k_t.shape)}"
        )
    if not (q_t.dtype == k_t.dtype == v_t.dtype):
        raise TypeError(f"q_t, k_t and v_t must share one dtype, got {q_t.dtype}, "
                        f"{k_t.dtype} and {v_t.dtype}")
    if not (q_t.device == k_t.device == v_t.device):
        raise ValueError(f"q_t, k_t and v_t must be on one device, got {q_t.device}, "
                         f"{k_t.device} and {v_t.device}")
    state = check_state(state, "state", k_t.shape[-1], v_t.shape[-1], k_t, keys="k_t")
    return q_t, k_t, v_t, state


def step_batch(**tensors_and_tails: tuple[torch.Tensor | None, int]) -> tuple[int, ...]:
    """Broadcast batch of one-token inputs, each given with its number of trailing dims."""
    return broadcast_batch(**{
        name: tuple(t.shape[: t.dim() - tail])
        for name, (t, tail) in tensors_and_tails.items() if t is not None
    })


def empty_result(seq: Sequence, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(..., n, d_v)`` of zeros and the initial (or zero) state, for empty inputs.

    Used when ``n = 0`` or a batch dimension is 0: no token changes the state. The
    zeros stay in the autograd graph of the inputs (gradients zero).
    """
    d_k, d_v = seq.k.shape[-1], seq.v.shape[-1]
    out = torch.zeros(*seq.batch, n, d_v, dtype=like.dtype, device=like.device)
    for x in (seq.q, seq.k, seq.v, seq.log_decay, seq.beta):
        if x is not None and x.requires_grad:
            out = out + x.reshape(-1)[:0].sum().to(out.dtype)
    if seq.state is None:
        state = torch.zeros(*seq.batch, d_k, d_v, dtype=seq.dtype, device=like.device)
    else:
        state = seq.state.reshape(*seq.batch, d_k, d_v).clone()
    return out, state


def pad_tokens(x: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    """Append ``pad`` zero tokens to ``(B, n)`` or ``(B, n, x)``: steps that change nothing.

    A zero key and value add nothing to the state, a zero log decay keeps it, a zero
    ``beta`` erases nothing; the outputs of the padded positions are dropped.
    """
    if x is None or pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def init_decay_gate(decay: torch.nn.Linear, initial_decay: float, temperature: float) -> None:
    """Start a gate ``log a = logsigmoid(x W^T + b) / tau`` at ``a = initial_decay`` for every
    input: ``W = 0`` and ``sigmoid(b) = initial_decay^tau``.

    In log space, ``b = L - log(-expm1(L))`` with ``L = tau log(initial_decay) < 0``:
    ``initial_decay^tau`` itself underflows to 0 (``0.99^1e5``, ``1e-30^16``) or rounds
    to 1, where ``log(g / (1 - g))`` fails or loses every digit. ``ValueError`` when ``b``
    is beyond the range of the bias's dtype.
    """
    torch.nn.init.zeros_(decay.weight)
    log_gate = temperature * math.log(initial_decay)  # log(initial_decay^tau), < 0
    bias = log_gate - math.log(-math.expm1(log_gate)) if log_gate > -math.inf else log_gate
    name = (f"the decay gate's bias logit(initial_decay ** temperature) for "
            f"initial_decay={initial_decay!r} and temperature={temperature!r}")
    torch.nn.init.constant_(decay.bias, check_representable(bias, name, decay.bias.dtype))


def check_causal_inputs(q: object, k: object, v: object, causal: object,
                        module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a recurrent attention module: causal only, feature size
    ``module.dim_head``, the dtype and device of the module's parameters."""
    dim_head, name = module.dim_head, type(module).__name__
    if not check_bool(causal, "causal"):
        raise ValueError(
            f"{name} is a causal recurrence (each output reads a state built from the past): "
            "call it with causal=True (make_attention(..., causal=True), "
            "TinyTransformer(..., causal=True))"
        )
    q, k, v = check_qkv(q, k, v)
    if k.shape[-1] != dim_head:
        raise ValueError(f"q and k must have d = dim_head = {dim_head}, got k.shape="
                         f"{tuple(k.shape)}")
    check_module_input(k, "q, k and v", module)
    return q, k, v


def pair_exponents(x: torch.Tensor) -> torch.Tensor:
    """``E[j, i] = sum_{j < s <= i} x_s`` for ``j <= i``, ``-inf`` for ``j > i``.

    ``x`` ``(..., L, g)`` (tokens, then channels) -> ``(..., L_j, L_i, g)``. Each entry
    sums its own terms (a masked cumulative sum, no difference of two cumulative sums, so
    no cancellation); ``exp(E)`` is the transposed decay mask ``L^T``, zero where
    ``j > i``. Cost ``O(L^2 g)``.
    """
    pos = torch.arange(x.shape[-2], device=x.device)
    later = pos.unsqueeze(-1) < pos  # (L_j, L_s): s > j
    earlier = pos.unsqueeze(-1) > pos  # (L_j, L_i): i < j
    if x.shape[-1] == 1:  # one decay per token: sum along the last (contiguous) axis
        terms = torch.where(later, x.transpose(-2, -1), 0.0)  # (..., L_j, L_s)
        return terms.cumsum(dim=-1).masked_fill_(earlier, -math.inf).unsqueeze(-1)
    terms = torch.where(later.unsqueeze(-1), x.unsqueeze(-3), 0.0)  # (..., L_j, L_s, g)
    return terms.cumsum(dim=-2).masked_fill_(earlier.unsqueeze(-1), -math.inf)


def suffix_sums(x: torch.Tensor) -> torch.Tensor:
    """``sum_{s > j} x_s`` along the token axis of ``x`` ``(..., L, g)`` (no cancellation)."""
    inclusive = x.flip(-2).cumsum(dim=-2).flip(-2)  # sum_{s >= j}
    return F.pad(inclusive[..., 1:, :], (0, 0, 0, 1))


def row_blocks(tensors, chunk: int):
    """Blocks of about ``BLOCK_ROWS`` tokens (a multiple of ``chunk``) of ``(B, n, ...)``
    tensors, contiguous, so that ``(B, N, C, d)`` chunks flatten to ``(B N, C, d)``
    without copies. One ``split`` per tensor: the backward pass joins the gradients of
    the blocks with one concatenation (slicing would add a zero-padded ``(B, n, ...)``
    gradient per block)."""
    rows = max(chunk, BLOCK_ROWS // chunk * chunk)
    for block in zip(*(x.split(rows, dim=1) for x in tensors), strict=True):
        yield [x.contiguous() for x in block]
