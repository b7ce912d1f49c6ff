"""Tests for efficient_attention.attention_sinks: the first tokens plus a sliding window.

The reference is exact softmax attention under ``sink_window_mask`` (scores, the mask as
-inf, softmax, in float64), computed on the whole sequence; decoding through
``SinkKVCache`` in any chunks sums the same terms, so it agrees to ~1e-15 (asserted 1e-12).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

F64 = torch.float64


def masked_attention(q, k, v, blocked):
    """softmax(q k^T / sqrt(d), -inf where blocked) v; a row with no key gets zeros."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(blocked, -math.inf), dim=-1).nan_to_num(0.0)
    return weights @ v


def sink_module(module, num_sinks, window):
    """The same weights, with exact attention under the sink-and-window mask."""
    def attention(q, k, v, *, causal=False, key_padding_mask=None):
        assert causal
        blocked = ea.sink_window_mask(q.shape[-2], num_sinks, window)
        if key_padding_mask is not None:  # padded keys and values: masked, and zeros
            blocked = blocked | key_padding_mask.unsqueeze(-2)
            k = k.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
            v = v.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
        return masked_attention(q, k, v, blocked)

    twin = ea.MultiHeadAttention(module.d_model, module.num_heads, attention=attention,
                                 num_kv_heads=module.num_kv_heads)
    twin.load_state_dict(module.state_dict())
    return twin.to(module.q_proj.weight.dtype)


def decode_in_chunks(module, x, cache, chunks, key_padding_mask=None):
    outputs, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            mask = None if key_padding_mask is None else key_padding_mask[:, start:start + size]
            outputs.append(module.decode(x[:, start:start + size], cache, key_padding_mask=mask))
            start += size
    assert cache.length == start == x.shape[1]
    return torch.cat(outputs, dim=1)


def test_the_mask():
    expected = ["1000000", "1100000", "1110000", "1111000", "1101100", "1100110", "1100011"]
    allowed = ~ea.sink_window_mask(7, 2, 1)
    assert ["".join(str(int(a)) for a in row) for row in allowed.tolist()] == expected
    assert torch.equal(ea.sink_window_mask(6, 0, 2), ~torch.ones(6, 6, dtype=torch.bool).tril(0)
                       | ~torch.ones(6, 6, dtype=torch.bool).triu(-2))  # the causal band
    assert torch.equal(ea.sink_window_mask(6, 3, 2), ea.causal_mask(6))  # S + w >= n - 1
    assert ea.sink_window_mask(0, 1, 1).shape == (0, 0)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.integers(0, 4),
       st.integers(0, 4), st.sampled_from([1, 2]), st.integers(1, 2))
def test_any_chunking_equals_attention_under_the_mask(chunks, num_sinks, window, group, batch):
    n = sum(chunks)
    g = torch.Generator().manual_seed(n + 7 * num_sinks + window)
    q = torch.randn(batch, 2 * group, n, 4, generator=g, dtype=F64)
    k = torch.randn(batch, 2, n, 4, generator=g, dtype=F64)
    v = torch.randn(batch, 2, n, 3, generator=g, dtype=F64)
    expected = masked_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                ea.sink_window_mask(n, num_sinks, window))
    cache = ea.SinkKVCache(num_sinks, window)
    outputs, start = [], 0
    with torch.inference_mode():
        for t in chunks:
            visible = cache.append(k[:, :, start:start + t], v[:, :, start:start + t])
            assert visible.keys.shape[-2] <= min(start + t, num_sinks) + window + 1 + t
            outputs.append(ea.cached_attention(q[:, :, start:start + t], visible))
            start += t
    out = torch.cat(outputs, dim=2)
    assert out.shape == expected.shape
    if n:
        assert (out - expected).abs().max() < 1e-12
    positions = min(n, num_sinks) + min(n, window + 1)
    assert cache.used_nbytes == batch * 2 * positions * (4 + 3) * 8


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("num_sinks, window", [(1, 2), (4, 3), (2, 0), (0, 3), (3, 30)])
@pytest.mark.parametrize("chunks", [[20], [1] * 20, [6, 1, 1, 5, 7], [3, 0, 17]])
def test_module_decode_equals_the_masked_forward(num_kv_heads, num_sinks, window, chunks):
    torch.manual_seed(0)
    module = ea.MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads).double()
    x = torch.randn(2, 20, 16, dtype=F64)
    expected = sink_module(module, num_sinks, window)(x, causal=True).detach()
    decoded = decode_in_chunks(module, x, ea.SinkKVCache(num_sinks, window), chunks)
    assert (decoded - expected).abs().max() < 1e-12
    if num_sinks + window >= 19:  # everything is kept: full causal attention
        assert (decoded - module(x, causal=True).detach()).abs().max() < 1e-12
    if num_sinks == 0:  # no sinks: the sliding window
        window_cache = ea.SlidingWindowKVCache(window)
        assert torch.equal(decoded, decode_in_chunks(module, x, window_cache, chunks))


@pytest.mark.parametrize("chunks", [[12], [5, 1, 1, 1, 4], [1] * 12])
def test_padding_is_never_seen(chunks):
    torch.manual_seed(1)
    module = ea.MultiHeadAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(3, 12, 16, dtype=F64)
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, :2], pad[1, 1], pad[2, 7] = True, True, True  # padded sinks and window tokens
    x[pad] = float("nan")
    expected = sink_module(module, 3, 2)(x, causal=True, key_padding_mask=pad).detach()
    decoded = decode_in_chunks(module, x, ea.SinkKVCache(3, 2), chunks, pad)
    assert torch.isfinite(decoded[~pad]).all()
    assert (decoded[~pad] - expected[~pad]).abs().max() < 1e-12


def test_a_mask_given_late_and_a_reset():
    torch.manual_seed(2)
    module = ea.MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6] = True
    cache = ea.SinkKVCache(2, 1)
    with torch.inference_mode():
        first = module.decode(x[:, :5], cache)  # no mask: these tokens are not padding
        rest = [module.decode(x[:, t:t + 1], cache, key_padding_mask=pad[:, t:t + 1])
                for t in range(5, 9)]
    decoded = torch.cat([first, *rest], dim=1)
    expected = sink_module(module, 2, 1)(x, causal=True, key_padding_mask=pad).detach()
    assert (decoded[~pad] - expected[~pad]).abs().max() < 1e-12
    cache.reset()
    y = torch.randn(1, 6, 16, dtype=F64)  # another batch size, outside inference mode
    with torch.no_grad():
        again = torch.cat([module.decode(y[:, :4], cache), module.decode(y[:, 4:], cache)], 1)
    assert (again - sink_module(module, 2, 1)(y, causal=True).detach()).abs().max() < 1e-12


def test_memory_stays_constant_however_long_the_stream():
    cache = ea.SinkKVCache(4, 8)
    k = torch.randn(1, 2, 1, 16, dtype=torch.float16)
    sizes = set()
    for _ in range(100):
        visible = cache.append(k, k)
        sizes.add(cache.nbytes)
    assert sizes == {2 * (4 + 9) * 2 * 16 * 2}  # S + w + 1 positions of keys and values
    assert cache.used_nbytes == cache.nbytes and visible.keys.shape[-2] == 4 + 9
    assert visible.blocked.tolist() == [[False] * 13]  # t = 1: every sink and window slot


@pytest.mark.parametrize(
    "make, error, words",
    [(lambda: ea.SinkKVCache(-1, 2), ValueError, ["num_sinks", "non-negative", "-1"]),
     (lambda: ea.SinkKVCache(2, 1.5), TypeError, ["window", "int", "float"]),
     (lambda: ea.sink_window_mask(4, None, 1), TypeError, ["num_sinks", "NoneType"]),
     (lambda: ea.SinkKVCache(2, 2).append(torch.randn(2, 3, 4), torch.randn(2, 3, 4)),
      ValueError, ["(batch, kv_heads, t, d)"])],
)
def test_bad_input(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_a_sequence_of_another_shape_needs_reset():
    cache = ea.SinkKVCache(2, 2)
    cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="do not continue the cached sequence.*reset"):
        cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert cache.length == 3
