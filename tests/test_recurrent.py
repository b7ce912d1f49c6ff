"""Tests for efficient_attention.recurrent (gated linear attention) and .delta_rule.

References are written out here: a Python loop over the tokens with explicit matrices
(``S = a S + k v^T``; ``S = a (I - beta k k^T) S + beta k v^T``), and closed forms (the
masked product of plain causal linear attention, RetNet's ``gamma^(i - j)`` mask).

Tolerances: in float64 every form is a reordering of the same sums of O(10)-sized terms
over at most a few hundred tokens, so they agree to ~1e-14; the brief's 1e-12 (gated) and
1e-10 (delta rule, which also goes through a triangular solve) leave a wide margin while
still failing any wrong term (a missing decay factor changes outputs by O(1)).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea
import efficient_attention._recurrence as recurrence
import efficient_attention.delta_rule as delta_module
import efficient_attention.recurrent as recurrent_module

F64 = torch.float64
GATED_TOL = dict(rtol=0.0, atol=1e-12)
DELTA_TOL = dict(rtol=0.0, atol=1e-10)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def gated_loop(q, k, v, log_decay, state=None):
    """S_t = diag(a_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, one token at a time."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    per_channel = log_decay.dim() == k.dim()
    gate_batch = log_decay.shape[:-2] if per_channel else log_decay.shape[:-1]
    batch = torch.broadcast_shapes(batch, gate_batch)
    if state is not None:
        batch = torch.broadcast_shapes(batch, state.shape[:-2])
    s = torch.zeros(*batch, k.shape[-1], v.shape[-1], dtype=F64)
    if state is not None:
        s = s + state
    outputs = []
    for t in range(q.shape[-2]):
        a = log_decay[..., t, :].exp().unsqueeze(-1) if per_channel else (
            log_decay[..., t].exp()[..., None, None])
        s = a * s + k[..., t, :, None] * v[..., t, None, :]
        outputs.append((q[..., t, None, :] @ s).squeeze(-2))
    out = torch.stack(outputs, -2) if outputs else torch.zeros(*batch, 0, v.shape[-1], dtype=F64)
    return out, s


def delta_loop(q, k, v, beta, log_decay=None, state=None):
    """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with explicit matrices."""
    d_k = k.shape[-1]
    s = torch.zeros(*q.shape[:-2], d_k, v.shape[-1], dtype=F64) if state is None else state
    eye = torch.eye(d_k, dtype=F64)
    outputs = []
    for t in range(q.shape[-2]):
        k_t, b_t = k[..., t, :], beta[..., t, None, None]
        a = 1.0 if log_decay is None else log_decay[..., t, None, None].exp()
        s = a * ((eye - b_t * k_t[..., :, None] * k_t[..., None, :]) @ s) + (
            b_t * k_t[..., :, None] * v[..., t, None, :])
        outputs.append((q[..., t, None, :] @ s).squeeze(-2))
    return torch.stack(outputs, -2), s


def make_inputs(n=50, d_k=6, d_v=5, batch=(2, 3), seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, n, d_k, generator=g, dtype=dtype)
    k = torch.randn(*batch, n, d_k, generator=g, dtype=dtype)
    v = torch.randn(*batch, n, d_v, generator=g, dtype=dtype)
    state = torch.randn(*batch, d_k, d_v, generator=g, dtype=dtype)
    return q, k, v, state, g


def log_decays(shape, regime, g, dtype=F64):
    """mild: in (-0.1, 0]; strong: near -50; mixed: -50 or (-0.01, 0], half each."""
    if regime == "mild":
        return -0.1 * torch.rand(shape, generator=g, dtype=dtype)
    if regime == "strong":
        return -50.0 + torch.rand(shape, generator=g, dtype=dtype)
    strong = torch.rand(shape, generator=g) < 0.5
    mild = -0.01 * torch.rand(shape, generator=g, dtype=dtype)
    return torch.where(strong, torch.tensor(-50.0, dtype=dtype), mild)


# --- gated linear attention: the three forms -------------------------------------------------

@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("regime", ["mild", "strong", "mixed"])
@pytest.mark.parametrize("chunk_size", [7, 16, 64])
def test_gated_forms_agree_with_the_loop(per_channel, regime, chunk_size):
    q, k, v, state, g = make_inputs()
    log_decay = log_decays((2, 3, 50, 6) if per_channel else (2, 3, 50), regime, g)
    expected, expected_state = gated_loop(q, k, v, log_decay, state)
    for form in ("recurrent", "parallel", "chunkwise"):
        out, final = ea.gated_linear_attention(q, k, v, log_decay, chunk_size=chunk_size,
                                               initial_state=state, return_state=True,
                                               form=form)
        torch.testing.assert_close(out, expected, **GATED_TOL)
        torch.testing.assert_close(final, expected_state, **GATED_TOL)


def test_gated_chunkwise_spans_several_blocks_of_rows():
    # n > BLOCK_ROWS: the state is carried from one block of rows to the next
    n = recurrence.BLOCK_ROWS + 77
    q, k, v, state, g = make_inputs(n=n, batch=(1,))
    for shape in ((1, n), (1, n, 6)):
        log_decay = log_decays(shape, "mixed", g)
        expected, expected_state = gated_loop(q, k, v, log_decay, state)
        out, final = ea.gated_linear_attention(q, k, v, log_decay, initial_state=state,
                                               return_state=True)
        torch.testing.assert_close(out, expected, **GATED_TOL)
        torch.testing.assert_close(final, expected_state, **GATED_TOL)


def test_no_decay_is_causal_linear_attention_without_normaliser():
    q, k, v, _, _ = make_inputs(n=40)
    masked = (q @ k.transpose(-2, -1)).tril()  # (..., n, n): q_i . k_j for j <= i
    for form in ("recurrent", "parallel", "chunkwise"):
        out = ea.gated_linear_attention(q, k, v, torch.zeros(2, 3, 40, dtype=F64), form=form,
                                        chunk_size=16)
        torch.testing.assert_close(out, masked @ v, **GATED_TOL)


def test_constant_decay_is_retnet_retention():
    # RetNet: out = (Q K^T o D) V with D_ij = gamma^(i - j) for j <= i, one gamma per head
    q, k, v, _, _ = make_inputs(n=40)
    gamma = torch.tensor([0.9, 0.5, 0.99], dtype=F64).view(1, 3, 1, 1)
    i = torch.arange(40, dtype=F64)
    decay_mask = (gamma ** (i.view(-1, 1) - i).clamp_min(0)).tril()  # (1, 3, n, n)
    expected = ((q @ k.transpose(-2, -1)) * decay_mask) @ v
    log_decay = gamma.log().view(1, 3, 1).expand(2, 3, 40)
    for form in ("recurrent", "parallel", "chunkwise"):
        out = ea.gated_linear_attention(q, k, v, log_decay, form=form, chunk_size=16)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
def test_float32_with_strong_and_mild_decays_matches_float64(per_channel):
    # Exponents are sums of their own terms, never differences of long cumulative sums:
    # float32 keeps its ~1e-7 relative precision even after many decays of -50.
    q, k, v, state, g = make_inputs(n=200, batch=(2,))
    log_decay = log_decays((2, 200, 6) if per_channel else (2, 200), "mixed", g)
    expected = gated_loop(q, k, v, log_decay, state)[0]
    out = ea.gated_linear_attention(q.float(), k.float(), v.float(), log_decay.float(),
                                    initial_state=state.float())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_huge_log_decays_stay_finite():
    # exp of a large positive number never happens: log decays of -1e4 give a state that
    # is forgotten at once, not inf or NaN
    q, k, v, state, g = make_inputs(n=30)
    log_decay = torch.full((2, 3, 30, 6), -1e4, dtype=F64)
    log_decay[..., ::3, :] = -1e-3
    expected = gated_loop(q, k, v, log_decay, state)[0]
    for form in ("recurrent", "parallel", "chunkwise"):
        out = ea.gated_linear_attention(q, k, v, log_decay, form=form, initial_state=state)
        torch.testing.assert_close(out, expected, **GATED_TOL)


def test_per_channel_sub_chunks_divide_the_chunk():
    """Issue 27: the sub-chunk was the largest divisor of C up to 4, so C = 31, 37 or 25
    (or n = 31 tokens with the default C = 32) fell to sub-chunks of one token: 9x the
    time and 5x the memory. The chunk is now rounded up to a multiple of c = 4."""
    sizes = [recurrent_module.channel_chunk_sizes(c) for c in (1, 3, 4, 5, 7, 16, 25, 31, 37)]
    assert sizes == [(1, 1), (3, 3), (4, 4), (8, 4), (8, 4), (16, 4), (28, 4), (32, 4), (40, 4)]
    assert [recurrent_module.sub_chunk_size(c) for c in (1, 3, 7, 16, 31, 32, 37)] == [
        1, 3, 4, 4, 4, 4, 4]


@pytest.mark.parametrize("chunk_size, n", [(31, 70), (37, 80), (25, 60), (5, 13), (32, 31)])
def test_per_channel_chunk_without_a_small_divisor_is_exact_and_cheap(chunk_size, n):
    longer = -(-n // 4) * 4  # n rounded up to a multiple of 4
    q, k, v, state, g = make_inputs(n=longer)
    log_decay = log_decays((2, 3, longer, 6), "mixed", g)
    inputs = [x[..., :n, :].contiguous() for x in (q, k, v, log_decay)]
    expected, expected_state = gated_loop(*inputs, state)
    out, final = ea.gated_linear_attention(*inputs, chunk_size=chunk_size,
                                           initial_state=state, return_state=True)
    torch.testing.assert_close(out, expected, **GATED_TOL)
    torch.testing.assert_close(final, expected_state, **GATED_TOL)
    # memory: that of a longer sequence with a chunk that 4 divides, plus one padded copy
    # of the inputs (before: 1.9x to 7x that bound, from 3 x 3 x d_k weights per token)
    peak = ea.peak_tensor_memory(ea.gated_linear_attention, *inputs, chunk_size=chunk_size)
    bound = ea.peak_tensor_memory(ea.gated_linear_attention, q, k, v, log_decay,
                                  chunk_size=-(-chunk_size // 4) * 4)
    padded_copy = sum(x.numel() * x.element_size() for x in (q, k, v, log_decay))
    assert peak <= 1.1 * bound + padded_copy


@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_chunkwise_gradients(per_channel):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 7, 3, generator=g, dtype=F64, requires_grad=True) for _ in "qk")
    v = torch.randn(2, 7, 2, generator=g, dtype=F64, requires_grad=True)
    state = torch.randn(2, 3, 2, generator=g, dtype=F64, requires_grad=True)
    shape = (2, 7, 3) if per_channel else (2, 7)
    log_decay = (-0.2 - torch.rand(shape, generator=g, dtype=F64)).requires_grad_()

    def fn(q, k, v, log_decay, state):
        return ea.gated_linear_attention(q, k, v, log_decay, chunk_size=4,
                                         initial_state=state, return_state=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, log_decay, state))


# --- the delta rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunk_size", [7, 16, 64])
def test_delta_rule_forms_agree_with_the_loop(gated, chunk_size):
    q, k, v, state, g = make_inputs(n=70)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(2, 3, 70, generator=g, dtype=F64)
    log_decay = log_decays((2, 3, 70), "mixed", g) if gated else None
    expected, expected_state = delta_loop(q, k, v, beta, log_decay, state)
    for form in ("recurrent", "chunkwise"):
        out, final = ea.delta_rule_attention(q, k, v, beta, log_decay=log_decay,
                                             chunk_size=chunk_size, initial_state=state,
                                             return_state=True, form=form)
        torch.testing.assert_close(out, expected, **DELTA_TOL)
        torch.testing.assert_close(final, expected_state, **DELTA_TOL)


def test_delta_rule_beta_one_overwrites_the_value_of_a_key():
    # beta = 1 and a unit key: the state's read-out at k is the last value written there
    g = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(6, generator=g, dtype=F64), dim=0)
    keys = k.expand(4, 6)
    values = torch.randn(4, 3, generator=g, dtype=F64)
    out = ea.delta_rule_attention(keys, keys, values, torch.ones(4, dtype=F64))
    torch.testing.assert_close(out, values, rtol=1e-12, atol=1e-12)  # o_t = S_t^T k = v_t
    # linear attention would have summed them: S^T k = v_1 + ... + v_t
    summed = ea.gated_linear_attention(keys, keys, values, torch.zeros(4, dtype=F64))
    torch.testing.assert_close(summed, values.cumsum(0), rtol=1e-12, atol=1e-12)


def test_delta_rule_spans_several_blocks_and_large_beta():
    n = recurrence.BLOCK_ROWS + 30
    q, k, v, state, g = make_inputs(n=n, batch=(1,))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = 2.0 * torch.rand(1, n, generator=g, dtype=F64)  # [0, 2]: still contractions
    expected, expected_state = delta_loop(q, k, v, beta, None, state)
    out, final = ea.delta_rule_attention(q, k, v, beta, initial_state=state, return_state=True)
    torch.testing.assert_close(out, expected, **DELTA_TOL)
    torch.testing.assert_close(final, expected_state, **DELTA_TOL)


@pytest.mark.parametrize("gated", [False, True])
def test_delta_rule_chunkwise_gradients(gated):
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 7, 3, generator=g, dtype=F64) for _ in "qk")
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(2, 7, 2, generator=g, dtype=F64)
    beta = torch.rand(2, 7, generator=g, dtype=F64)
    state = torch.randn(2, 3, 2, generator=g, dtype=F64)
    log_decay = -0.2 - torch.rand(2, 7, generator=g, dtype=F64)
    inputs = [x.requires_grad_() for x in (q, k, v, beta, state, log_decay)]

    def fn(q, k, v, beta, state, log_decay):
        return ea.delta_rule_attention(q, k, v, beta, log_decay=log_decay if gated else None,
                                       chunk_size=3, initial_state=state, return_state=True)

    assert torch.autograd.gradcheck(fn, inputs)


# --- steps and state --------------------------------------------------------------------------

@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_steps_reproduce_the_sequence(per_channel):
    q, k, v, state, g = make_inputs(n=20)
    log_decay = log_decays((2, 3, 20, 6) if per_channel else (2, 3, 20), "mixed", g)
    expected, expected_state = ea.gated_linear_attention(q, k, v, log_decay, chunk_size=8,
                                                         initial_state=state, return_state=True)
    s = state
    for t in range(20):
        gate = log_decay[..., t, :] if per_channel else log_decay[..., t]
        o_t, s = ea.gated_linear_attention_step(q[..., t, :], k[..., t, :], v[..., t, :], gate, s)
        torch.testing.assert_close(o_t, expected[..., t, :], **GATED_TOL)
    torch.testing.assert_close(s, expected_state, **GATED_TOL)
    o_0, s_0 = ea.gated_linear_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :],
                                              log_decay[..., 0, :] if per_channel
                                              else log_decay[..., 0])
    zero_start = ea.gated_linear_attention(q[..., :1, :], k[..., :1, :], v[..., :1, :],
                                           log_decay[..., :1, :] if per_channel
                                           else log_decay[..., :1], return_state=True)
    torch.testing.assert_close(o_0, zero_start[0][..., 0, :], **GATED_TOL)
    torch.testing.assert_close(s_0, zero_start[1], **GATED_TOL)


@pytest.mark.parametrize("gated", [False, True])
def test_delta_steps_reproduce_the_sequence(gated):
    q, k, v, state, g = make_inputs(n=20)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(2, 3, 20, generator=g, dtype=F64)
    log_decay = log_decays((2, 3, 20), "mixed", g) if gated else None
    expected, expected_state = ea.delta_rule_attention(
        q, k, v, beta, log_decay=log_decay, chunk_size=8, initial_state=state, return_state=True)
    s = state
    for t in range(20):
        o_t, s = ea.delta_rule_step(q[..., t, :], k[..., t, :], v[..., t, :], beta[..., t], s,
                                    log_decay_t=None if log_decay is None else log_decay[..., t])
        torch.testing.assert_close(o_t, expected[..., t, :], **DELTA_TOL)
    torch.testing.assert_close(s, expected_state, **DELTA_TOL)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_run_continued_from_its_state_equals_one_run(per_channel):
    q, k, v, _, g = make_inputs(n=90)
    log_decay = log_decays((2, 3, 90, 6) if per_channel else (2, 3, 90), "mild", g)
    whole, whole_state = ea.gated_linear_attention(q, k, v, log_decay, return_state=True,
                                                   chunk_size=16)
    first, state = ea.gated_linear_attention(q[..., :37, :], k[..., :37, :], v[..., :37, :],
                                             log_decay[:, :, :37], return_state=True,
                                             chunk_size=16)
    rest, final = ea.gated_linear_attention(q[..., 37:, :], k[..., 37:, :], v[..., 37:, :],
                                            log_decay[:, :, 37:], initial_state=state,
                                            return_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([first, rest], dim=-2), whole, **GATED_TOL)
    torch.testing.assert_close(final, whole_state, **GATED_TOL)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(2, 3, 90, generator=g, dtype=F64)
    decay = log_decay if not per_channel else None
    whole, whole_state = ea.delta_rule_attention(q, k, v, beta, log_decay=decay,
                                                 return_state=True, chunk_size=16)
    parts = [(slice(0, 37)), slice(37, 90)]
    state, outputs = None, []
    for part in parts:
        out, state = ea.delta_rule_attention(
            q[..., part, :], k[..., part, :], v[..., part, :], beta[..., part],
            log_decay=None if decay is None else decay[..., part], initial_state=state,
            return_state=True, chunk_size=16)
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, dim=-2), whole, **DELTA_TOL)
    torch.testing.assert_close(state, whole_state, **DELTA_TOL)


# --- shapes, broadcasting, empty sizes, dtypes ------------------------------------------------

@st.composite
def recurrent_problems(draw):
    """Batch dims broadcast across q, k, v, the gates and the state; n from 0 to 9."""
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    n, d_k, d_v = draw(st.integers(0, 9)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def shape():
        return [b if draw(st.booleans()) else 1 for b in batch]

    q = torch.randn(*shape(), n, d_k, generator=g, dtype=F64)
    k = torch.randn(*batch, n, d_k, generator=g, dtype=F64)  # full rank: gates follow k
    v = torch.randn(*shape(), n, d_v, generator=g, dtype=F64)
    per_channel = draw(st.booleans())
    gate_shape = [*shape(), n] + ([d_k] if per_channel else [])
    log_decay = -torch.rand(gate_shape, generator=g, dtype=F64) * draw(st.sampled_from([0.1, 5]))
    beta = torch.rand(*shape(), n, generator=g, dtype=F64)
    state = torch.randn(*shape(), d_k, d_v, generator=g, dtype=F64) if draw(
        st.booleans()) else None
    chunk = draw(st.sampled_from([None, 1, 2, 5]))
    return q, k, v, log_decay, beta, state, chunk


@SETTINGS
@given(recurrent_problems())
def test_gated_shapes_and_broadcasting(problem):
    q, k, v, log_decay, _, state, chunk = problem
    expected, expected_state = gated_loop(q, k, v, log_decay, state)
    for form in ("chunkwise", "parallel"):
        out, final = ea.gated_linear_attention(q, k, v, log_decay, chunk_size=chunk,
                                               initial_state=state, return_state=True, form=form)
        assert out.shape == expected.shape and final.shape == expected_state.shape
        torch.testing.assert_close(out, expected, **GATED_TOL)
        torch.testing.assert_close(final, expected_state, **GATED_TOL)


@SETTINGS
@given(recurrent_problems())
def test_delta_shapes_and_broadcasting(problem):
    q, k, v, log_decay, beta, state, chunk = problem
    log_decay = log_decay[..., 0] if log_decay.dim() == k.dim() else log_decay
    k = torch.nn.functional.normalize(k, dim=-1)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], beta.shape[:-1],
                                   log_decay.shape[:-1],
                                   *(() if state is None else (state.shape[:-2],)))
    n = k.shape[-2]
    expected, expected_state = delta_loop(
        q.expand(*batch, n, -1), k.expand(*batch, n, -1), v.expand(*batch, n, -1),
        beta.expand(*batch, n), log_decay.expand(*batch, n),
        None if state is None else state.expand(*batch, -1, -1)) if n else (None, None)
    out, final = ea.delta_rule_attention(q, k, v, beta, log_decay=log_decay, chunk_size=chunk,
                                         initial_state=state, return_state=True)
    assert out.shape == (*batch, n, v.shape[-1]) and final.shape == (*batch, *k.shape[-1:],
                                                                     v.shape[-1])
    if n:
        torch.testing.assert_close(out, expected, **DELTA_TOL)
        torch.testing.assert_close(final, expected_state, **DELTA_TOL)
    else:
        assert (out == 0).all()
        start = torch.zeros(()) if state is None else state
        torch.testing.assert_close(final, torch.broadcast_to(start.to(F64), final.shape))


def test_empty_sequence_returns_the_initial_state():
    q, k, v, state, _ = make_inputs(n=0)
    out, final = ea.gated_linear_attention(q, k, v, torch.zeros(2, 3, 0, dtype=F64),
                                           initial_state=state, return_state=True)
    assert out.shape == (2, 3, 0, 5) and torch.equal(final, state)
    out, final = ea.delta_rule_attention(q, k, v, torch.zeros(2, 3, 0, dtype=F64),
                                         return_state=True)
    assert out.shape == (2, 3, 0, 5) and torch.equal(final, torch.zeros(2, 3, 6, 5, dtype=F64))
    empty_batch = [torch.randn(0, 4, 2) for _ in range(3)]
    assert ea.gated_linear_attention(*empty_batch, torch.zeros(0, 4)).shape == (0, 4, 2)
    with pytest.raises(ValueError, match="d >= 1"):
        ea.gated_linear_attention(*[torch.randn(3, 0)] * 3, torch.zeros(3))


@pytest.mark.parametrize("dtype, bits", [(torch.float16, 11), (torch.bfloat16, 8)])
def test_half_precision_is_computed_in_float32(dtype, bits):
    q, k, v, _, g = make_inputs(n=40, dtype=torch.float32)
    log_decay = log_decays((2, 3, 40), "mild", g, torch.float32)
    halves = [x.to(dtype) for x in (q, k, v, log_decay)]
    expected = ea.gated_linear_attention(*[x.float() for x in halves])  # same rounded inputs
    out, state = ea.gated_linear_attention(*halves, return_state=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    # computed in float32, then rounded once to `bits` significant bits: 2^-bits relative
    torch.testing.assert_close(out.float(), expected, rtol=2.0**-bits, atol=1e-5)
    _, step_state = ea.gated_linear_attention_step(q[..., 0, :].to(dtype), k[..., 0, :].to(dtype),
                                                   v[..., 0, :].to(dtype), log_decay[..., 0].to(
                                                       dtype), state)
    assert step_state.dtype == torch.float32


# --- bad input ---------------------------------------------------------------------------------

def test_bad_inputs_are_clear_errors():
    q, k, v, state, _ = make_inputs(n=5)
    log_decay = torch.zeros(2, 3, 5, dtype=F64)
    gla = ea.gated_linear_attention
    with pytest.raises(ValueError, match="at least 2 dimension"):
        gla(q[0, 0, 0], k, v, log_decay)
    with pytest.raises(ValueError, match="q and k must have the same length n"):
        gla(q[..., :4, :], k, v, log_decay)
    with pytest.raises(ValueError, match="same sequence length"):
        gla(q, k, v[..., :4, :], log_decay)
    with pytest.raises(ValueError, match=r"log_decay must be finite and <= 0.*got 0\.5"):
        gla(q, k, v, log_decay + 0.5)
    with pytest.raises(ValueError, match="log_decay must be finite.*got nan"):
        gla(q, k, v, torch.full_like(log_decay, math.nan))
    with pytest.raises(ValueError, match=r"log_decay must have shape \(\.\.\., n\)"):
        gla(q, k, v, log_decay[..., :4])
    with pytest.raises(ValueError, match=r"log_decay must have shape"):
        gla(q, k, v, log_decay[0, 0])  # (n,) for 4-D keys: the rank decides, so it is wrong
    with pytest.raises(TypeError, match="log_decay must have the dtype"):
        gla(q, k, v, log_decay.float())
    with pytest.raises(ValueError, match="initial_state must have shape"):
        gla(q, k, v, log_decay, initial_state=state[..., :4])
    with pytest.raises(ValueError, match="batch dimensions"):
        gla(q, k, v, torch.zeros(4, 3, 5, dtype=F64))
    for chunk, error in ((0, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="chunk_size must be a positive int"):
            gla(q, k, v, log_decay, chunk_size=chunk)
    with pytest.raises(ValueError, match="form must be one of"):
        gla(q, k, v, log_decay, form="fast")
    with pytest.raises(TypeError, match="return_state must be a bool"):
        gla(q, k, v, log_decay, return_state=1)
    beta = torch.rand(2, 3, 5, dtype=F64)
    with pytest.raises(ValueError, match="form must be one of"):
        ea.delta_rule_attention(q, k, v, beta, form="parallel")
    with pytest.raises(ValueError, match="beta must be finite"):
        ea.delta_rule_attention(q, k, v, beta * math.inf)
    with pytest.raises(ValueError, match=r"beta must have shape \(\.\.\., n\)"):
        ea.delta_rule_attention(q, k, v, beta.unsqueeze(-1).expand(2, 3, 5, 6))
    with pytest.raises(ValueError, match="log_decay must have shape"):  # no per-channel decay
        ea.delta_rule_attention(q, k, v, beta, log_decay=torch.zeros(2, 3, 5, 6, dtype=F64))
    with pytest.raises(ValueError, match="log_decay_t must be finite and <= 0"):
        ea.gated_linear_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :],
                                       torch.ones(2, 3, dtype=F64))
    with pytest.raises(ValueError, match="q_t and k_t must share"):
        ea.delta_rule_step(q[..., 0, :2], k[..., 0, :], v[..., 0, :], beta[..., 0])
    with pytest.raises(ValueError, match="state must have shape"):
        ea.delta_rule_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], beta[..., 0], state.mT)


# --- memory ------------------------------------------------------------------------------------

def test_chunkwise_memory_is_linear_and_far_below_one_n_by_n_matrix():
    d, peaks = 16, {}
    for n in (2048, 4096):
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, n, d, generator=g) for _ in range(3))
        scalar, per_channel = -torch.rand(1, n, generator=g), -torch.rand(1, n, d, generator=g)
        beta = torch.rand(1, n, generator=g)
        k_unit = torch.nn.functional.normalize(k, dim=-1)
        peaks[n] = [ea.peak_tensor_memory(ea.gated_linear_attention, q, k, v, scalar),
                    ea.peak_tensor_memory(ea.gated_linear_attention, q, k, v, per_channel),
                    ea.peak_tensor_memory(ea.delta_rule_attention, q, k_unit, v, beta)]
    one_matrix = 4 * 4096 * 4096  # one n x n float32 matrix: 64 MiB
    for small, large in zip(peaks[2048], peaks[4096], strict=True):
        assert large < one_matrix / 16
        assert large / small < 2.2  # O(n d + n C): doubling n doubles the peak, not 4x


# --- modules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("module", [
    ea.GatedLinearAttention(4), ea.GatedLinearAttention(4, per_channel=True),
    ea.DeltaRuleAttention(4), ea.DeltaRuleAttention(4, gated=True)])
def test_modules_ignore_padded_keys(module):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 12, 4, generator=g, dtype=F64) for _ in range(3))
    module = module.double()
    mask = torch.zeros(2, 1, 12, dtype=torch.bool)
    mask[0, 0, [2, 5, 6, 11]] = True
    k[0, :, [2, 5]] = math.nan  # garbage in padded rows must not leak
    v[0, :, 6] = math.inf
    out = module(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    kept = (~mask[0, 0]).nonzero().squeeze(-1)
    compact = module(q[0:1, :, kept], k[0:1, :, kept], v[0:1, :, kept], causal=True)
    torch.testing.assert_close(out[0:1, :, kept], compact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1:], module(q[1:], k[1:], v[1:], causal=True),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="causal recurrence"):
        module(q, k, v)


def test_gated_module_starts_with_the_initial_decay():
    module = ea.GatedLinearAttention(8, per_channel=True, initial_decay=0.95, temperature=16.0)
    log_decay = module.log_decay(torch.randn(3, 5, 8))
    torch.testing.assert_close(log_decay, torch.full((3, 5, 8), math.log(0.95)))
    with pytest.raises(ValueError, match="initial_decay must lie strictly between 0 and 1"):
        ea.GatedLinearAttention(8, initial_decay=1.0)


@pytest.fixture
def one_thread():
    # Small models: threads only add overhead. Restored after the test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind, options", [("gated", {}), ("gated", {"per_channel": True}),
                                           ("delta", {}), ("delta", {"gated": True})])
def test_recurrent_models_learn_to_copy(kind, options, one_thread):
    task = ea.CopyTask(length=4, num_symbols=4)
    torch.manual_seed(0)
    model = ea.TinyTransformer(task.vocab_size, d_model=32, num_heads=2, num_layers=2,
                               attention=kind, causal=True, attention_options=options)
    assert isinstance(model.blocks[0].attention.attention,
                      ea.GatedLinearAttention if kind == "gated" else ea.DeltaRuleAttention)
    history = ea.train_model(model, task, 60, batch_size=32, lr=3e-3, progress=False)
    start, end = sum(history["loss"][:10]) / 10, sum(history["loss"][-10:]) / 10
    assert end < 0.8 * start  # chance loss is log 4 = 1.39
    with pytest.raises(ValueError, match=f"{kind} attention is a causal recurrence"):
        ea.make_attention(kind, 16)


def test_modules_are_exported_from_their_modules():
    assert recurrent_module.GatedLinearAttention is ea.GatedLinearAttention
    assert delta_module.delta_rule_attention is ea.delta_rule_attention
    assert {"gated", "delta"} <= set(ea.ATTENTION_KINDS)


@pytest.mark.cuda
def test_forms_run_on_cuda_and_match_the_cpu():
    q, k, v, state, g = make_inputs(n=70)
    log_decay = log_decays((2, 3, 70, 6), "mixed", g)
    beta = torch.rand(2, 3, 70, generator=g, dtype=F64)
    k_unit = torch.nn.functional.normalize(k, dim=-1)
    cuda = [x.cuda() for x in (q, k, v, state, log_decay, beta, k_unit)]
    for form in ("recurrent", "parallel", "chunkwise"):
        out = ea.gated_linear_attention(*cuda[:3], cuda[4], initial_state=cuda[3], form=form)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), gated_loop(q, k, v, log_decay, state)[0],
                                   **GATED_TOL)
    out = ea.delta_rule_attention(cuda[0], cuda[6], cuda[2], cuda[5], initial_state=cuda[3])
    torch.testing.assert_close(out.cpu(), delta_loop(q, k_unit, v, beta, None, state)[0],
                               **DELTA_TOL)


# --- issue 27: clear errors --------------------------------------------------------------------

def test_a_missing_beta_is_a_clear_error():
    """delta_rule_attention(q, k, v, None) failed in zeros_like, delta_rule_step with
    beta_t=None with "'NoneType' object has no attribute 'to'"."""
    q, k, v, state, _ = make_inputs(n=5)
    with pytest.raises(TypeError, match=r"beta must be a torch.Tensor of shape \(\.\.\., n\).*"
                                        r"got NoneType"):
        ea.delta_rule_attention(q, k, v, None)
    with pytest.raises(TypeError, match=r"beta_t must be a torch.Tensor of shape \(\.\.\.\).*"
                                        r"got NoneType"):
        ea.delta_rule_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], None, state)
    with pytest.raises(TypeError, match=r"log_decay must be a torch.Tensor of shape"):
        ea.gated_linear_attention(q, k, v, None)
    with pytest.raises(TypeError, match=r"log_decay_t must be a torch.Tensor.*got list"):
        ea.gated_linear_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], [0.0])


def test_step_errors_speak_of_one_token():
    """A step has no n: its errors named "n" and "k.shape", not the k_t it was given."""
    q, k, v, state, _ = make_inputs(n=5)
    q_t, k_t, v_t = q[..., 0, :], k[..., 0, :], v[..., 0, :]
    calls = {
        "log_decay_t": lambda: ea.gated_linear_attention_step(
            q_t, k_t, v_t, torch.zeros(2, 3, 4, dtype=F64)),
        "beta_t": lambda: ea.delta_rule_step(q_t, k_t, v_t, torch.zeros(2, 3, 4, dtype=F64)),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{name} must have shape (...)")
        assert "k_t.shape=(2, 3, 6)" in message and "got shape (2, 3, 4)" in message
        assert " n " not in message and "(..., n" not in message and "k.shape" not in message
    with pytest.raises(TypeError, match=r"log_decay_t must have the dtype of q_t, k_t and v_t"):
        ea.gated_linear_attention_step(q_t, k_t, v_t, torch.zeros(2, 3))


@pytest.mark.parametrize("module", [ea.GatedLinearAttention(4),
                                    ea.GatedLinearAttention(4, per_channel=True),
                                    ea.DeltaRuleAttention(4, gated=True)])
def test_inputs_in_another_dtype_than_the_module_are_a_clear_error(module):
    """float64 inputs to a float32 module failed in the gate's matmul ("mat1 and mat2 must
    have the same dtype")."""
    q, k, v = (torch.randn(2, 5, 4, dtype=F64) for _ in "qkv")
    with pytest.raises(TypeError, match=r"q, k and v must have the dtype of the module's "
                                        r"parameters \(torch.float32\), got torch.float64"):
        module(q, k, v, causal=True)
    out = module.double()(q, k, v, causal=True)  # what the message proposes
    assert out.dtype == F64
    with pytest.raises(TypeError, match="key_padding_mask must be a bool torch.Tensor, got list"):
        module(q, k, v, causal=True, key_padding_mask=[[False] * 5] * 2)


@pytest.mark.parametrize("initial_decay, temperature", [(1e-30, 16.0), (0.5, 2000.0),
                                                        (0.99, 1e5), (1 - 1e-12, 1e-3)])
def test_initial_decay_gates_that_underflow_are_computed_in_log_space(initial_decay,
                                                                      temperature):
    """initial_decay ** temperature underflowed to 0 and the gate's logit raised "math
    domain error" (or, near 1, lost its digits: 8e-4 relative error for 1 - 1e-12); the
    logit is now computed from log(initial_decay)."""
    expected = torch.full((3, 1), math.log(initial_decay), dtype=F64)
    gate = torch.nn.Linear(4, 1, dtype=F64)  # a float64 bias: the formula to 1e-12
    recurrence.init_decay_gate(gate, initial_decay, temperature)
    log_decay = torch.nn.functional.logsigmoid(gate(torch.randn(3, 4, dtype=F64)))
    torch.testing.assert_close(log_decay / temperature, expected, rtol=1e-12, atol=0.0)
    for module in (ea.GatedLinearAttention(4, initial_decay=initial_decay,
                                           temperature=temperature),
                   ea.DeltaRuleAttention(4, gated=True, initial_decay=initial_decay,
                                         temperature=temperature)):
        # the modules' float32 bias b is rounded: relative error max(1, |b|) 2^-24 <= 2e-6
        log_decay = torch.nn.functional.logsigmoid(module.decay.double()(torch.randn(3, 4,
                                                                                  dtype=F64)))
        torch.testing.assert_close(log_decay / temperature, expected, rtol=4e-6, atol=0.0)


def test_an_initial_decay_gate_beyond_float32_is_a_clear_error():
    with pytest.raises(ValueError, match=r"initial_decay=1e-300 and temperature=1e\+300.*"
                                         r"float32"):
        ea.GatedLinearAttention(4, initial_decay=1e-300, temperature=1e300)
