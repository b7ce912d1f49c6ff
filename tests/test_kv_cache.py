"""Tests for efficient_attention.kv_cache: incremental decoding equals the full forward pass.

The reference is ``MultiHeadAttention.forward`` on the whole sequence (``causal=True``; with
a sliding window, the causal band of ``banded_attention``). Decoding computes the same sums
over the same keys, in another order: float64 agrees to ~1e-15 (asserted 1e-12), float32 to
a few units of 2^-24 on outputs of size ~1 (asserted 1e-6).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

F64 = torch.float64
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
CHUNKINGS = [[12], [1] * 12, [5, 1, 1, 3, 2], [0, 4, 0, 8], [2, 10]]


def make_module(num_kv_heads, dtype=F64, seed=0):
    torch.manual_seed(seed)
    return ea.MultiHeadAttention(24, 6, num_kv_heads=num_kv_heads).to(dtype)


def banded_module(module, window):
    """The same weights, with the causal band of width ``window`` as the attention."""
    def band(q, k, v, *, causal=False, key_padding_mask=None):
        return ea.banded_attention(q, k, v, window, causal=causal,
                                   key_padding_mask=key_padding_mask)

    twin = ea.MultiHeadAttention(module.d_model, module.num_heads, attention=band,
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
    assert start == x.shape[1] and cache.length == start
    return torch.cat(outputs, dim=1)


def max_error(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("num_kv_heads", [6, 3, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_cached_decode_equals_full_causal_forward(dtype, num_kv_heads, chunks):
    module = make_module(num_kv_heads, dtype)
    x = torch.randn(3, 12, 24, dtype=dtype)
    with torch.inference_mode():
        expected = module(x, causal=True)
    decoded = decode_in_chunks(module, x, ea.KVCache(16), chunks)
    assert decoded.dtype == dtype and decoded.shape == expected.shape
    assert max_error(decoded, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("num_kv_heads", [6, 2, 1])
@pytest.mark.parametrize("window", [0, 1, 3, 11, 30])
@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_sliding_window_decode_equals_causal_band(dtype, num_kv_heads, window, chunks):
    module = make_module(num_kv_heads, dtype)
    x = torch.randn(2, 12, 24, dtype=dtype)
    with torch.inference_mode():
        expected = banded_module(module, window)(x, causal=True)
    cache = ea.SlidingWindowKVCache(window)
    decoded = decode_in_chunks(module, x, cache, chunks)
    assert max_error(decoded, expected) < TOLERANCE[dtype]
    if window >= 12:  # the window covers the whole sequence: full causal attention
        assert max_error(decoded, module(x, causal=True).detach()) < TOLERANCE[dtype]


def test_sliding_window_wraps_around_many_times():
    module = make_module(2)
    x = torch.randn(1, 50, 24, dtype=F64)
    expected = banded_module(module, 3)(x, causal=True).detach()
    cache = ea.SlidingWindowKVCache(3)
    decoded = decode_in_chunks(module, x, cache, [1] * 20 + [7, 1, 2, 1, 5] + [1] * 14)
    assert max_error(decoded, expected) < 1e-12
    assert cache.nbytes == 2 * 1 * 2 * 4 * 4 * 8  # (w + 1) positions, whatever the length
    assert not torch.allclose(decoded, module(x, causal=True).detach())  # it does forget


def left_padding(lengths, n):
    """``True`` on the first ``n - length`` positions of each row (left-padded prompts)."""
    return torch.arange(n)[None, :] < (n - torch.tensor(lengths))[:, None]


@pytest.mark.parametrize("num_kv_heads", [6, 2, 1])
@pytest.mark.parametrize("chunks", [[12], [5, 1, 1, 1, 4], [1] * 12])
def test_decode_with_padding_equals_masked_forward(num_kv_heads, chunks):
    module = make_module(num_kv_heads)
    x = torch.randn(3, 12, 24, dtype=F64)
    pad = left_padding([12, 9, 4], 12)
    pad[0, 7] = True  # and one pad token in the middle of a sequence
    x[pad] = float("nan")  # padding never reaches another position, NaN included
    expected = module(x, causal=True, key_padding_mask=pad).detach()
    decoded = decode_in_chunks(module, x, ea.KVCache(12), chunks, key_padding_mask=pad)
    keep = ~pad
    assert torch.isfinite(decoded[keep]).all()
    assert max_error(decoded[keep], expected[keep]) < 1e-12
    window = 4
    banded = banded_module(module, window)(x, causal=True, key_padding_mask=pad).detach()
    cache = ea.SlidingWindowKVCache(window)
    windowed = decode_in_chunks(module, x, cache, chunks, key_padding_mask=pad)
    assert max_error(windowed[keep], banded[keep]) < 1e-12


def test_padding_mask_may_start_late():
    """A mask given only for later blocks: the earlier tokens count as not padded."""
    module = make_module(3)
    x = torch.randn(2, 6, 24, dtype=F64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4] = True
    expected = module(x, causal=True, key_padding_mask=pad).detach()
    for cache in (ea.KVCache(6), ea.SlidingWindowKVCache(10)):
        with torch.inference_mode():
            first = module.decode(x[:, :3], cache)
            rest = [module.decode(x[:, t:t + 1], cache, key_padding_mask=pad[:, t:t + 1])
                    for t in range(3, 6)]
        decoded = torch.cat([first, *rest], dim=1)
        assert max_error(decoded[~pad], expected[~pad]) < 1e-12


def test_query_whose_keys_are_all_padding_gets_the_zero_attention_output():
    module = make_module(2)
    x = torch.randn(1, 3, 24, dtype=F64)
    pad = torch.tensor([[True, False, False]])
    for cache in (ea.KVCache(3), ea.SlidingWindowKVCache(2)):
        with torch.inference_mode():
            out = module.decode(x, cache, key_padding_mask=pad)
        # the padded first token sees only itself: zero attention output, out_proj's bias
        torch.testing.assert_close(out[0, 0], module.out_proj.bias.detach(), rtol=0, atol=0)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.sampled_from([1, 2, 4]),
       st.one_of(st.none(), st.integers(0, 6)), st.integers(1, 3))
def test_any_chunking_gives_the_full_forward(chunks, num_kv_heads, window, batch):
    torch.manual_seed(len(chunks))
    module = ea.MultiHeadAttention(8, 4, num_kv_heads=num_kv_heads).double()
    n = sum(chunks)
    x = torch.randn(batch, n, 8, dtype=F64)
    if window is None:
        cache, reference = ea.KVCache(max(n, 1)), module
    else:
        cache, reference = ea.SlidingWindowKVCache(window), banded_module(module, window)
    expected = reference(x, causal=True).detach()
    decoded = decode_in_chunks(module, x, cache, chunks)
    assert decoded.shape == expected.shape == (batch, n, 8)
    if n > 0:
        assert max_error(decoded, expected) < 1e-12


def test_cached_attention_matches_softmax_attention_on_repeated_heads():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 4, 5, generator=g, dtype=F64)
    k = torch.randn(2, 2, 9, 5, generator=g, dtype=F64)
    v = torch.randn(2, 2, 9, 3, generator=g, dtype=F64)
    blocked = torch.rand(2, 1, 4, 9, generator=g) < 0.3
    blocked[0, 0, 1] = True  # a query with no key at all
    expected = ea.softmax_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                    scale=0.7)
    out = ea.cached_attention(q, ea.CachedKeys(k, v, None), scale=0.7)
    assert max_error(out, expected) < 1e-12
    scores = 0.7 * q @ k.repeat_interleave(3, 1).transpose(-2, -1)
    weights = torch.softmax(scores.masked_fill(blocked, -math.inf), -1).nan_to_num(0.0)
    out = ea.cached_attention(q, ea.CachedKeys(k, v, blocked), scale=0.7)
    assert max_error(out, weights @ v.repeat_interleave(3, 1)) < 1e-12
    assert out[0, :, 1].abs().max() == 0


def test_append_returns_views_of_the_buffers():
    cache = ea.KVCache(8)
    k, v = torch.randn(2, 1, 2, 3, 4).unbind(0)
    first = cache.append(k, v)
    assert first.blocked.shape == (3, 3) and first.blocked.tolist() == [
        [False, True, True], [False, False, True], [False, False, False]]
    second = cache.append(k[:, :, :1], v[:, :, :1])
    assert second.blocked is None and second.keys.shape == (1, 2, 4, 4)
    assert second.keys.data_ptr() == first.keys.data_ptr() == cache.keys.data_ptr()
    torch.testing.assert_close(cache.keys, torch.cat([k, k[:, :, :1]], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(cache.values[:, :, 3], v[:, :, 0], rtol=0, atol=0)


def test_overflow_raises_and_keeps_the_cache():
    cache = ea.KVCache(4)
    k = torch.randn(1, 2, 3, 8)
    cache.append(k, k)
    with pytest.raises(ValueError, match=r"max_len=4.*holds 3 tokens.*2 more"):
        cache.append(k[:, :, :2], k[:, :, :2])
    assert cache.length == 3
    cache.append(k[:, :, :1], k[:, :, :1])  # the last free position is still usable
    assert cache.length == 4
    with pytest.raises(ValueError, match="max_len=4"):
        cache.append(k[:, :, :1], k[:, :, :1])


def test_reset_starts_a_new_sequence_of_any_shape():
    module = make_module(3)
    x = torch.randn(2, 5, 24, dtype=F64)
    cache = ea.KVCache(8)
    decode_in_chunks(module, x, cache, [5])
    cache.reset()
    assert cache.length == 0
    y = torch.randn(4, 3, 24, dtype=F64)  # another batch size
    assert max_error(decode_in_chunks(module, y, cache, [1, 2]),
                     module(y, causal=True).detach()) < 1e-12
    with pytest.raises(ValueError, match="do not continue the cached sequence.*reset"):
        cache.append(torch.randn(2, 3, 1, 4, dtype=F64), torch.randn(2, 3, 1, 4, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_buffers_follow_the_dtype_of_the_keys(dtype):
    module = make_module(2, dtype)
    x = torch.randn(1, 4, 24).to(dtype)
    with torch.inference_mode():
        out = module.decode(x, ea.KVCache(4))
    assert out.dtype == dtype
    if dtype != torch.bfloat16:
        assert max_error(out, module(x, causal=True).detach()) < TOLERANCE[dtype]
    k = torch.randn(1, 2, 3, 4).to(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    for cache, positions in ((ea.KVCache(5), 5), (ea.SlidingWindowKVCache(1), 2)):
        visible = cache.append(k, k)
        assert visible.keys.dtype == visible.values.dtype == dtype
        assert cache.nbytes == 2 * 2 * positions * 4 * size


def test_bytes_are_counted_exactly():
    cache = ea.KVCache(10)
    assert cache.nbytes == cache.used_nbytes == 0
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 7)  # d = 5, d_v = 7, float32
    cache.append(k, v)
    assert cache.nbytes == 2 * 3 * 10 * (5 + 7) * 4
    assert cache.used_nbytes == 2 * 3 * 4 * (5 + 7) * 4
    cache.append(k[:, :, :1], v[:, :, :1], torch.zeros(2, 1, dtype=torch.bool))
    assert cache.nbytes == 2 * 3 * 10 * (5 + 7) * 4 + 2 * 10  # plus one bool per position
    assert cache.used_nbytes == 2 * 3 * 5 * (5 + 7) * 4
    window = ea.SlidingWindowKVCache(2)
    for _ in range(3):
        window.append(k, v)
    assert window.length == 12 and window.used_nbytes == 2 * 3 * 3 * (5 + 7) * 4
    assert window.nbytes == window.used_nbytes


def test_bytes_per_token_of_a_model():
    assert ea.cache_bytes_per_token(32, 32, 128) == 512 * 2**10  # fp16 MHA: 512 KiB
    assert ea.cache_bytes_per_token(32, 8, 128) == 128 * 2**10  # GQA, 8 groups
    assert ea.cache_bytes_per_token(32, 1, 128, torch.float32) == 32 * 2**10  # MQA, fp32
    cache = ea.KVCache(5)  # one layer of 8 kv heads of 128, fp16, one sequence
    k = torch.zeros(1, 8, 5, 128, dtype=torch.float16)
    cache.append(k, k)
    assert cache.used_nbytes * 32 == 5 * ea.cache_bytes_per_token(32, 8, 128)


def test_empty_block_changes_nothing():
    module = make_module(3)
    cache = ea.KVCache(4)
    with torch.inference_mode():
        out = module.decode(torch.randn(2, 0, 24, dtype=F64), cache)
    assert out.shape == (2, 0, 24) and cache.length == 0


@pytest.mark.parametrize(
    "make, error, words",
    [(lambda: ea.KVCache(0), ValueError, ["max_len", "positive", "0"]),
     (lambda: ea.KVCache(4.0), TypeError, ["max_len", "int", "float"]),
     (lambda: ea.SlidingWindowKVCache(-1), ValueError, ["window", "non-negative", "-1"]),
     (lambda: ea.SlidingWindowKVCache(None), TypeError, ["window", "NoneType"]),
     (lambda: ea.KVCache(4).append(torch.randn(2, 3, 4), torch.randn(2, 3, 4)), ValueError,
      ["k", "(batch, kv_heads, t, d)", "(2, 3, 4)"]),
     (lambda: ea.KVCache(4).append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 2, 4)),
      ValueError, ["k.shape=(1, 2, 3, 4)", "v.shape=(1, 2, 2, 4)"]),
     (lambda: ea.KVCache(4).append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4).double()),
      TypeError, ["k and v", "float32", "float64"]),
     (lambda: ea.KVCache(4).append(torch.randn(1, 2, 3, 0), torch.randn(1, 2, 3, 4)),
      ValueError, ["d >= 1"]),
     (lambda: ea.KVCache(4).append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                                   torch.zeros(1, 3)), TypeError, ["key_padding_mask", "bool"]),
     (lambda: ea.KVCache(4).append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                                   torch.zeros(1, 4, dtype=torch.bool)),
      ValueError, ["key_padding_mask", "(batch, t)=(1, 3)", "(1, 4)"]),
     (lambda: ea.KVCache(4).append(torch.ones(1, 1, 1, 2, dtype=torch.long),
                                   torch.ones(1, 1, 1, 2)), TypeError, ["k", "floating"]),
     (lambda: ea.cache_bytes_per_token(32, 0, 128), ValueError, ["num_kv_heads"]),
     (lambda: ea.cache_bytes_per_token(32, 8, 128, "fp16"), TypeError, ["dtype", "str"])],
)
def test_bad_cache_input(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_bad_decode_input():
    module = make_module(3)
    cache = ea.KVCache(8)
    x = torch.randn(2, 3, 24, dtype=F64)
    with pytest.raises(TypeError, match="cache must be a KVCache.*dict"):
        module.decode(x, {})
    with pytest.raises(ValueError, match=r"shape \(batch, t, d_model\).*\(1, 2, 3, 24\)"):
        module.decode(x[None], cache)
    with pytest.raises(ValueError, match="x must have at least 3 dimension"):
        module.decode(x[0], cache)
    with pytest.raises(ValueError, match="d_model=24"):
        module.decode(torch.randn(2, 3, 8, dtype=F64), cache)
    linear = ea.MultiHeadAttention(24, 6, attention=ea.linear_attention)
    with pytest.raises(TypeError, match="exact softmax.*attention=linear_attention"):
        linear.decode(x.float(), cache)
    with pytest.raises(ValueError, match="h_q a multiple of their 4 heads"):
        ea.cached_attention(torch.randn(1, 6, 1, 5), ea.CachedKeys(
            torch.randn(1, 4, 3, 5), torch.randn(1, 4, 3, 5), None))
    with pytest.raises(TypeError, match="cached must be the CachedKeys"):
        ea.cached_attention(torch.randn(1, 4, 1, 5), (torch.randn(1, 4, 3, 5),) * 2 + (None,))
    assert cache.length == 0  # nothing was appended by a call that failed


@pytest.mark.cuda
def test_decode_on_cuda_matches_cpu():
    module = make_module(2, torch.float32)
    x = torch.randn(2, 7, 24)
    cpu = decode_in_chunks(module, x, ea.KVCache(7), [4, 1, 2])
    cuda_module = make_module(2, torch.float32).cuda()
    cache = ea.SlidingWindowKVCache(10)
    gpu = decode_in_chunks(cuda_module, x.cuda(), cache, [4, 1, 2])
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-4)
    visible = cache.append(torch.randn(2, 2, 1, 4, device="cuda"),
                           torch.randn(2, 2, 1, 4, device="cuda"))
    assert visible.keys.device.type == "cuda" and visible.keys.shape == (2, 2, 8, 4)


def test_truncate_forgets_the_latest_tokens():
    module = make_module(2)
    x = torch.randn(2, 6, 24, dtype=F64)
    draft = torch.randn(2, 3, 24, dtype=F64)  # tokens that will be rejected
    cache = ea.KVCache(9)
    with torch.inference_mode():
        module.decode(x[:, :4], cache, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
        module.decode(draft, cache)
        cache.truncate(4)
        rest = module.decode(x[:, 4:], cache)
    assert cache.length == 6
    assert max_error(rest, module(x, causal=True).detach()[:, 4:]) < 1e-12
    cache.truncate(0)  # a new sequence of another batch size, with padding
    pad = torch.tensor([[True, False], [False, False], [False, False]])
    y = torch.randn(3, 2, 24, dtype=F64)
    with torch.inference_mode():
        out = module.decode(y, cache, key_padding_mask=pad)
        cache.append(torch.randn(3, 2, 4, 4, dtype=F64), torch.randn(3, 2, 4, 4, dtype=F64))
    expected = module(y, causal=True, key_padding_mask=pad).detach()
    assert max_error(out[~pad], expected[~pad]) < 1e-12
    with pytest.raises(ValueError, match="at most the 6 cached tokens, got 7"):
        cache.truncate(7)
    with pytest.raises(TypeError, match="length must be a non-negative int"):
        cache.truncate(2.0)


# --- issue 27: defects of the caches -------------------------------------------------------

@pytest.mark.parametrize("window", [0, 1, 2, 5])
@pytest.mark.parametrize("num_kv_heads", [6, 2])
def test_long_unmasked_block_after_a_masked_append(window, num_kv_heads):
    """A block of t > w + 1 tokens without a mask, after an append with one: its tokens
    count as not padded (the zeros standing for its mask were cut to the ring's w + 1
    slots, a raw RuntimeError for every window)."""
    module = make_module(num_kv_heads)
    x = torch.randn(2, window + 6, 24, dtype=F64)
    pad = torch.zeros(2, window + 6, dtype=torch.bool)
    pad[1, 0] = True
    expected = banded_module(module, window)(x, causal=True, key_padding_mask=pad).detach()
    cache = ea.SlidingWindowKVCache(window)
    with torch.inference_mode():
        first = module.decode(x[:, :1], cache, key_padding_mask=pad[:, :1])
        rest = module.decode(x[:, 1:], cache)  # t = w + 5 > w + 1, no mask
        last = module.decode(x[:, -1:], cache)  # the ring still knows what is padding
    decoded = torch.cat([first, rest], dim=1)
    assert cache.length == window + 7
    assert max_error(decoded[~pad], expected[~pad]) < 1e-12
    again = torch.cat([x, x[:, -1:]], dim=1)
    pad_again = torch.cat([pad, pad[:, -1:]], dim=1)
    band = banded_module(module, window)(again, causal=True, key_padding_mask=pad_again)
    assert max_error(last[:, 0], band.detach()[:, -1]) < 1e-12


@pytest.mark.parametrize("make", [lambda: ea.KVCache(8), lambda: ea.SlidingWindowKVCache(2)])
def test_a_cache_filled_under_inference_mode_works_outside_it(make):
    """Buffers allocated under torch.inference_mode() are inference tensors, which cannot be
    written outside it: reset() and a new sequence raised "Inplace update to inference
    tensor". The cache now takes ordinary buffers when it leaves inference mode."""
    module = make_module(2)
    x = torch.randn(2, 5, 24, dtype=F64)
    cache = make()
    window = getattr(cache, "window", None)
    reference = module if window is None else banded_module(module, window)
    expected = reference(x, causal=True).detach()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    with torch.inference_mode():
        module.decode(x[:, :3], cache, key_padding_mask=pad[:, :3])
    cache.reset()
    with torch.no_grad():  # a new sequence, outside inference mode
        out = torch.cat([module.decode(x[:, :3], cache, key_padding_mask=pad[:, :3]),
                         module.decode(x[:, 3:4], cache), module.decode(x[:, 4:], cache)], 1)
    assert max_error(out, expected) < 1e-12
    cache.reset()
    with torch.inference_mode():  # back under inference mode: the buffers still serve
        module.decode(x[:, :2], cache)
    with torch.no_grad():  # and a sequence started there may continue outside it
        rest = module.decode(x[:, 2:], cache)
    assert max_error(rest, expected[:, 2:]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make, masked", [(lambda: ea.KVCache(512), False),
                                          (lambda: ea.KVCache(512), True),
                                          (lambda: ea.SlidingWindowKVCache(511), True)])
def test_a_half_precision_step_does_not_copy_the_cache(dtype, make, masked):
    """The docstring promises no copy of the cache; half precision converted the whole
    cache to float32 on every step (2.1 MB allocated per step for this 1 MB cache). The
    fused kernel reads the half-precision cache and accumulates in float32: what a step
    allocates is independent of the cache size, well under 5% of it here."""
    g = torch.Generator().manual_seed(0)
    b, h_kv, group, d = 1, 8, 2, 64
    cache = make()
    keys = torch.randn(b, h_kv, 511, d, generator=g).to(dtype)
    values = torch.randn(b, h_kv, 511, d, generator=g).to(dtype)
    mask = torch.rand(b, 511, generator=g) < 0.2 if masked else None
    cache.append(keys, values, mask)
    k, v = (torch.randn(b, h_kv, 1, d, generator=g).to(dtype) for _ in "kv")
    q = torch.randn(b, h_kv * group, 1, d, generator=g).to(dtype)
    step_mask = torch.zeros(b, 1, dtype=torch.bool) if masked else None
    with ea.TensorMemoryTracker() as tracker:
        out = ea.cached_attention(q, cache.append(k, v, step_mask))
    assert cache.nbytes >= 2**20
    assert tracker.allocated < 0.05 * cache.nbytes
    # the result is still float32 arithmetic rounded once: compare with float64
    all_k, all_v = torch.cat([keys, k], 2).double(), torch.cat([values, v], 2).double()
    blocked = None if mask is None else torch.cat([mask, step_mask], 1)[:, None]
    expected = ea.softmax_attention(q.double(), all_k.repeat_interleave(group, 1),
                                    all_v.repeat_interleave(group, 1), key_padding_mask=blocked)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), expected, rtol=2 * eps, atol=2 * eps)
