"""Tests for efficient_attention.quantized_cache: int8 keys and values with per-group scales.

Three references: (1) each dequantised number is within ``scale / 2`` of the original (plus
the rounding of float arithmetic, ``254 eps scale``: ``|x / s| <= 127``); (2) what the cache
returns, appended in any chunks, is bit for bit ``int8_round_trip`` of all the keys and
values so far, and its attention is exact attention over those (1e-12 in float64); (3) the
attention output's error against unquantised attention stays within the bound that (1)
implies (derived in ``output_error_bound``).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

F64 = torch.float64
GRANULARITY_PAIRS = [("token", "token"), ("channel", "token"), ("channel", "channel"),
                     ("token", "channel")]


def element_scales(x, scale):
    """The scale of each number of ``x (..., n, d)``: token or channel scales expanded."""
    rows = x.shape[-2] // scale.shape[-2]
    return scale.repeat_interleave(rows, dim=-2).expand(x.shape)


def assert_within_half_a_step(x, rounded, scale):
    step = element_scales(x, scale)
    eps = torch.finfo(x.dtype).eps
    assert ((x - rounded).abs() <= step * (0.5 + 254 * eps)).all()


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 9),
       st.sampled_from([F64, torch.float32]), st.floats(1e-3, 1e3))
def test_every_number_is_within_half_a_step(batch, groups, group_size, d, dtype, size):
    g = torch.Generator().manual_seed(batch * 100 + d)
    x = size * torch.randn(batch, 2, groups * group_size, d, generator=g, dtype=dtype)
    x[..., 0, 0] = 0.0
    for granularity, kwargs in (("token", {}), ("channel", {"group_size": group_size})):
        q, scale = ea.quantize_int8(x, granularity=granularity, **kwargs)
        assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == dtype
        if x.abs().max() > 0:  # the largest |x| of a group maps to +-127 exactly
            assert q.abs().max() == 127
        rows = groups * group_size if granularity == "token" else groups
        assert scale.shape == (batch, 2, rows, 1 if granularity == "token" else d)
        rounded = ea.dequantize_int8(q, scale)
        assert_within_half_a_step(x, rounded, scale)
        assert torch.equal(rounded, ea.int8_round_trip(x, granularity=granularity, **kwargs))


def test_zero_groups_and_the_whole_sequence_as_one_channel_group():
    x = torch.zeros(1, 1, 4, 3, dtype=F64)
    x[0, 0, 2] = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    q, scale = ea.quantize_int8(x)
    assert scale[0, 0, :, 0].tolist() == [0.0, 0.0, 2 / 127, 0.0]
    assert q[0, 0, 2].tolist() == [64, -127, 32] and torch.equal(ea.dequantize_int8(q, scale)[
        0, 0, [0, 1, 3]], torch.zeros(3, 3, dtype=F64))
    q, scale = ea.quantize_int8(x, granularity="channel")  # group_size None: all n tokens
    assert scale.shape == (1, 1, 1, 3) and scale.flatten().tolist() == [1 / 127, 2 / 127,
                                                                        0.5 / 127]
    rest = ea.int8_round_trip(x[..., :3, :], granularity="channel", group_size=2)
    assert torch.equal(rest[..., 2:, :], x[..., 2:3, :])  # the incomplete group as it is


def decode(cache, q, k, v, chunks, key_padding_mask=None):
    start = 0
    with torch.inference_mode():
        for t in chunks:
            mask = None if key_padding_mask is None else key_padding_mask[:, start:start + t]
            visible = cache.append(k[:, :, start:start + t], v[:, :, start:start + t], mask)
            yield start + t, visible, ea.cached_attention(q[:, :, start:start + t], visible)
            start += t


def exact(q, k, v, key_padding_mask=None):
    group = q.shape[1] // k.shape[1]
    mask = None if key_padding_mask is None else key_padding_mask[:, None]
    return ea.softmax_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                causal=True, key_padding_mask=mask)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.sampled_from(GRANULARITY_PAIRS),
       st.integers(1, 4), st.sampled_from([1, 2]))
def test_decode_equals_the_round_trip_reference_exactly(chunks, granularities, group_size,
                                                        group):
    key_granularity, value_granularity = granularities
    n = sum(chunks)
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, 2 * group, n, 4, generator=g, dtype=F64)
    k = torch.randn(2, 2, n, 4, generator=g, dtype=F64)
    v = torch.randn(2, 2, n, 3, generator=g, dtype=F64)
    cache = ea.QuantizedKVCache(max(n, 1), key_granularity=key_granularity,
                                value_granularity=value_granularity, group_size=group_size)

    def round_trip(x, granularity):
        size = {"group_size": group_size} if granularity == "channel" else {}
        return ea.int8_round_trip(x, granularity=granularity, **size)

    start = 0
    for stop, visible, out in decode(cache, q, k, v, chunks):
        keys = round_trip(k[:, :, :stop], key_granularity)
        values = round_trip(v[:, :, :stop], value_granularity)
        assert torch.equal(visible.keys, keys) and torch.equal(visible.values, values)
        expected = exact(q[:, :, :stop], keys, values)[:, :, start:]
        assert out.shape == expected.shape
        if stop > start:
            assert (out - expected).abs().max() < 1e-12
        start = stop
    assert cache.length == n


def output_error_bound(q, v, k_step, v_step):
    """Per query row and value channel, causal rows: how far quantised attention may be.

    Score errors: ``|q_i . (k_j - k^_j)| / sqrt(d) <= sum_c |q_ic| s_jc / 2 / sqrt(d)
    <= e_i`` (the largest over the visible ``j``). Weights ``p'_j / p_j`` then lie in
    ``[e^{-2 e_i}, e^{2 e_i}]``, so ``|p' - p|_1 <= e^{2 e_i} - 1``, and with
    ``sum (p' - p) = 0`` the output moves by at most ``|p' - p|_1 / 2`` times the range
    of the values seen (rounded or, in a residual, not: within ``v_j +- s^v_j / 2``),
    plus ``max_j s^v_j / 2`` from the values' own rounding."""
    n, d = q.shape[-2], q.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    score = (q.abs() @ (k_step / 2).transpose(-2, -1)) / math.sqrt(d)  # (b, h, n, n)
    e = score.masked_fill(~causal, 0).amax(-1, keepdim=True)  # (b, h, n, 1)
    inf = torch.tensor(math.inf, dtype=q.dtype)
    vmax = torch.where(causal[..., None], (v + v_step / 2)[..., None, :, :], -inf).amax(-2)
    vmin = torch.where(causal[..., None], (v - v_step / 2)[..., None, :, :], inf).amin(-2)
    half_step = torch.where(causal[..., None], v_step[..., None, :, :] / 2, 0).amax(-2)
    return torch.expm1(2 * e) / 2 * (vmax - vmin) + half_step  # (b, h, n, d_v)


@pytest.mark.parametrize("key_granularity, value_granularity", GRANULARITY_PAIRS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_attention_error_within_the_bound_of_the_rounding(key_granularity, value_granularity,
                                                          dtype):
    g = torch.Generator().manual_seed(1)
    b, h, n, d = 2, 2, 24, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=F64) for _ in range(3))
    k[..., 3] *= 8  # an outlier channel in the keys, which channel scales isolate
    cache = ea.QuantizedKVCache(n, key_granularity=key_granularity,
                                value_granularity=value_granularity, group_size=4)
    steps = list(decode(cache, q.to(dtype), k.to(dtype), v.to(dtype), [5, 1, 7, 11]))
    outputs = torch.cat([out for *_, out in steps], dim=2)
    rounding = []  # the rounding step of each key and value number
    for x, granularity in ((k, key_granularity), (v, value_granularity)):
        size = {"group_size": 4} if granularity == "channel" else {}
        rounding.append(element_scales(x, ea.quantize_int8(x.to(dtype), granularity=granularity,
                                                        **size)[1]).double())
    bound = output_error_bound(q, v, *rounding)
    error = (outputs.double() - exact(q, k, v)).abs()
    float_error = 1e-5 if dtype == torch.float32 else 1e-12
    assert (error <= bound + float_error).all()
    assert error.max() > 1e-4  # the cache does round
    # Random data: errors of a few hundredths on values of size ~1, a few times under the
    # worst case; channel scales for keys spare the other channels the outlier's step.
    assert error.max() < (0.03 if key_granularity == "channel" else 0.1)


def test_bytes_saved_are_counted_exactly():
    b, h, n, d, d_v, size = 2, 3, 40, 8, 6, 16
    k = torch.randn(b, h, n, d, dtype=torch.float16)
    v = torch.randn(b, h, n, d_v, dtype=torch.float16)
    full = ea.KVCache(64)
    full.append(k, v)
    assert full.nbytes == b * h * 64 * (d + d_v) * 2
    token = ea.QuantizedKVCache(64, key_granularity="token")
    token.append(k, v)
    assert token.nbytes == b * h * 64 * (d + 2) + b * h * 64 * (d_v + 2)  # int8 + one scale
    assert token.used_nbytes == b * h * n * (d + d_v + 4)
    kivi = ea.QuantizedKVCache(64, group_size=size)  # channel keys, token values
    kivi.append(k, v)
    key_bytes = b * h * (64 * d + (64 // size) * d * 2 + size * d * 2)  # int8, scales, residual
    assert kivi.nbytes == key_bytes + b * h * 64 * (d_v + 2)
    held = b * h * (32 * d + 2 * d * 2 + 8 * d * 2)  # 2 groups quantised, 8 tokens in residual
    assert kivi.used_nbytes == held + b * h * n * (d_v + 2)
    assert full.nbytes - kivi.nbytes == b * h * (64 * (d + d_v) * 2 - 64 * (d + d_v + 2)
                                                 - 4 * d * 2 - size * d * 2)
    kivi.append(k[:, :, :1], v[:, :, :1], torch.zeros(b, 1, dtype=torch.bool))
    assert kivi.nbytes == key_bytes + b * h * 64 * (d_v + 2) + b * 64  # and the padding


def test_padding_is_never_seen_and_never_rounds_others():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 9, 4, generator=g, dtype=F64)
    k = torch.randn(2, 2, 9, 4, generator=g, dtype=F64)
    v = torch.randn(2, 2, 9, 4, generator=g, dtype=F64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, :2], pad[1, 5] = True, True
    k[pad[:, None].expand(2, 2, 9)] = float("nan")  # padding never reaches another token
    clean = k.masked_fill(pad[:, None, :, None], 0.0)
    start = 0
    for stop, visible, out in decode(ea.QuantizedKVCache(9, group_size=3), q, k, v,
                                     [4, 1, 4, 0], pad):
        keys = ea.int8_round_trip(clean[:, :, :stop], granularity="channel", group_size=3)
        assert torch.equal(visible.keys, keys)  # the padded keys count as zeros
        expected = exact(q[:, :, :stop], keys, ea.int8_round_trip(v[:, :, :stop]),
                         pad[:, :stop])[:, :, start:]
        keep = ~pad[:, None, start:stop].expand(2, 4, stop - start)
        assert torch.isfinite(out[keep]).all()
        if keep.any():
            assert (out - expected)[keep].abs().max() < 1e-12
        start = stop


def test_reset_and_module_decode():
    torch.manual_seed(0)
    module = ea.MultiHeadAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(2, 10, 16, dtype=F64)
    cache = ea.QuantizedKVCache(10, group_size=4)
    with torch.inference_mode():
        out = torch.cat([module.decode(x[:, :6], cache), module.decode(x[:, 6:], cache)], 1)
    assert (out - module(x, causal=True).detach()).abs().max() < 0.05
    cache.reset()
    with torch.no_grad():  # a new sequence of another batch size, outside inference mode
        again = torch.cat([module.decode(x[:1, :6], cache), module.decode(x[:1, 6:], cache)],
                          1)
    assert cache.length == 10 and (again - out[:1]).abs().max() < 1e-12


@pytest.mark.parametrize(
    "make, error, words",
    [(lambda: ea.QuantizedKVCache(0), ValueError, ["max_len", "positive"]),
     (lambda: ea.QuantizedKVCache(4, key_granularity="row"), ValueError,
      ["key_granularity", "('token', 'channel')", "'row'"]),
     (lambda: ea.QuantizedKVCache(4, value_granularity=1), TypeError,
      ["value_granularity", "str", "int"]),
     (lambda: ea.QuantizedKVCache(4, group_size=0), ValueError, ["group_size", "positive"]),
     (lambda: ea.QuantizedKVCache(2).append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)),
      ValueError, ["max_len=2", "holds 0 tokens", "3 more"]),
     (lambda: ea.quantize_int8(torch.randn(1, 5, 2), granularity="channel", group_size=2),
      ValueError, ["multiple of group_size=2", "(1, 5, 2)"]),
     (lambda: ea.quantize_int8(torch.randn(5, 2), group_size=2), ValueError,
      ["group_size", "granularity='channel' only"]),
     (lambda: ea.quantize_int8(torch.ones(5, 2, dtype=torch.long)), TypeError,
      ["x", "floating"]),
     (lambda: ea.dequantize_int8(torch.ones(4, 2), torch.ones(4, 1)), TypeError,
      ["q", "int8", "float32"]),
     (lambda: ea.dequantize_int8(torch.ones(4, 2, dtype=torch.int8), torch.ones(3, 1)),
      ValueError, ["scale", "(4, 2)", "(3, 1)"])],
)
def test_bad_input(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_a_sequence_of_another_shape_needs_reset():
    cache = ea.QuantizedKVCache(8)
    cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="do not continue the cached sequence.*reset"):
        cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert cache.length == 3
