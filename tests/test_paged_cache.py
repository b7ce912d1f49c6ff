"""Tests for efficient_attention.paged_cache: a block pool shared by sequences of any length.

The reference is exact causal attention, ``softmax_attention(q, k, v, causal=True)``, over
each sequence's own tokens. Decoding through the pool sums the same terms (the gathered
positions beyond a sequence's length get weight zero), so float64 agrees to ~1e-15
(asserted 1e-12).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

F64 = torch.float64
H_KV, D, D_V = 2, 4, 3


def exact(q, k, v):
    """Causal attention, query heads grouped over the key-value heads."""
    group = q.shape[1] // k.shape[1]
    return ea.softmax_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                causal=True)


def make_sequences(lengths, group=2, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(1, heads, n, size, generator=g, dtype=dtype)
                  for heads, size in ((H_KV * group, D), (H_KV, D), (H_KV, D_V)))
            for n in lengths]


def decode(cache, sequences, schedule, ids=None):
    """Append the tokens of ``sequences`` by ``schedule``: rounds of (which, t), the same
    ``t`` tokens for each sequence named, in one batch; returns each sequence's outputs."""
    ids = list(range(len(sequences))) if ids is None else ids
    done = [0] * len(sequences)
    outputs = [[] for _ in sequences]
    with torch.inference_mode():
        for which, t in schedule:
            q, k, v = (torch.cat([sequences[s][i][:, :, done[s]:done[s] + t] for s in which])
                       for i in range(3))
            out = ea.cached_attention(q, cache.append([ids[s] for s in which], k, v))
            for row, s in enumerate(which):
                outputs[s].append(out[row:row + 1])
                done[s] += t
    assert done == [seq[1].shape[2] for seq in sequences]
    return [torch.cat(parts, dim=2) for parts in outputs]


def max_error(a, b):
    return (a - b).abs().max().item()


def test_sequences_of_different_lengths_decode_exactly_in_one_batch():
    lengths = [7, 3, 12]
    sequences = make_sequences(lengths)
    cache = ea.PagedKVCache(16, 4, H_KV, D, d_value=D_V, dtype=F64)
    schedule = [((0,), 4), ((1,), 2), ((2,), 5),  # prefills of different lengths
                ((0, 1, 2), 1), ((0, 2), 2), ((2,), 3), ((1, 2, 0), 0), ((2,), 1)]
    outputs = decode(cache, sequences, schedule)
    for (q, k, v), out in zip(sequences, outputs, strict=True):
        assert out.shape == (1, 2 * H_KV, k.shape[2], D_V)
        assert max_error(out, exact(q, k, v)) < 1e-12
    assert [cache.length(s) for s in range(3)] == lengths
    assert [len(cache.block_table(s)) for s in range(3)] == [2, 1, 3]  # ceil(n / 4)
    assert cache.num_free_blocks == 16 - 6


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 5),
       st.sampled_from([1, 2]), st.randoms(use_true_random=False))
def test_any_lengths_blocks_and_schedule(lengths, block_size, group, rng):
    sequences = make_sequences(lengths, group=group, seed=len(lengths))
    left = list(lengths)
    schedule = []
    while any(left):
        which = tuple(s for s in range(len(left)) if left[s] and rng.random() < 0.7)
        if not which:
            continue
        t = rng.randint(1, min(left[s] for s in which))
        schedule.append((which, t))
        for s in which:
            left[s] -= t
    blocks = sum(math.ceil(n / block_size) for n in lengths)
    cache = ea.PagedKVCache(blocks, block_size, H_KV, D, d_value=D_V, dtype=F64)
    ids = [10 * s + 3 for s in range(len(lengths))]  # any ints name the sequences
    outputs = decode(cache, sequences, schedule, ids)
    for (q, k, v), out in zip(sequences, outputs, strict=True):
        assert max_error(out, exact(q, k, v)) < 1e-12
    assert cache.num_free_blocks == 0  # exactly ceil(n / B) blocks per sequence
    assert sorted(b for s in ids for b in cache.block_table(s)) == list(range(blocks))
    # the read of one more query per sequence sees all its keys and nothing beyond
    q = torch.randn(len(lengths), H_KV * group, 1, D, dtype=F64)
    out = ea.cached_attention(q, cache.gather(ids))
    for row, (_, k, v) in enumerate(sequences):
        expected = ea.softmax_attention(q[row:row + 1], k.repeat_interleave(group, 1),
                                        v.repeat_interleave(group, 1))
        assert max_error(out[row:row + 1], expected) < 1e-12


def test_freed_blocks_are_reused_and_their_old_contents_never_leak():
    cache = ea.PagedKVCache(4, 3, H_KV, D, d_value=D_V, dtype=F64)
    poison = torch.full((1, H_KV, 7, D), float("nan"), dtype=F64)
    cache.append(0, poison, poison[..., :D_V])  # 3 blocks of NaN
    first = cache.block_table(0)
    assert first == (0, 1, 2) and cache.num_free_blocks == 1
    cache.free(0)
    assert cache.sequences == () and cache.num_free_blocks == 4
    (q, k, v), = make_sequences([5])
    out, = decode(cache, [(q, k, v)], [((0,), 2), ((0,), 1), ((0,), 1), ((0,), 1)], [7])
    assert cache.block_table(7) == (0, 1)  # the freed blocks, first freed first
    assert torch.isfinite(out).all() and max_error(out, exact(q, k, v)) < 1e-12
    with pytest.raises(ValueError, match=r"sequence 0 is not in the cache \(it holds \[7\]\)"):
        cache.length(0)


def test_exhausted_pool_raises_and_changes_nothing():
    cache = ea.PagedKVCache(3, 2, H_KV, D, dtype=F64)
    k = torch.randn(2, H_KV, 3, D, dtype=F64)
    cache.append([0, 1], k[:, :, :2], k[:, :, :2])  # one block each
    with pytest.raises(ea.CacheFullError, match=r"needs 2 new block\(s\) of 2 positions, and "
                                                r"only 1 of the 3 are free.*free\(\)"):
        cache.append([0, 1], k[:, :, :1], k[:, :, :1])
    assert [cache.length(0), cache.length(1)] == [2, 2] and cache.num_free_blocks == 1
    cache.append(1, k[:1, :, :2], k[:1, :, :2])  # one sequence still fits
    cache.free(0)
    cache.append(0, k[:1, :, :2], k[:1, :, :2])  # ... and once one is freed, another starts
    assert cache.num_free_blocks == 0 and isinstance(ea.CacheFullError(), RuntimeError)


def test_truncate_rolls_back_and_frees_whole_blocks():
    (q, k, v), = make_sequences([9])
    cache = ea.PagedKVCache(5, 2, H_KV, D, d_value=D_V, dtype=F64)
    with torch.inference_mode():
        cache.append(0, k[:, :, :6], v[:, :, :6])
        cache.append(0, torch.randn(1, H_KV, 3, D, dtype=F64),
                     torch.randn(1, H_KV, 3, D_V, dtype=F64))  # rejected draft tokens
        assert cache.num_free_blocks == 0
        cache.truncate(0, 5)
        assert cache.length(0) == 5 and len(cache.block_table(0)) == 3
        assert cache.num_free_blocks == 2
        out = ea.cached_attention(q[:, :, 5:], cache.append(0, k[:, :, 5:], v[:, :, 5:]))
    assert max_error(out, exact(q, k, v)[:, :, 5:]) < 1e-12
    with pytest.raises(ValueError, match="at most the 9 tokens of sequence 0, got 10"):
        cache.truncate(0, 10)


def test_bytes_are_counted_exactly():
    cache = ea.PagedKVCache(10, 4, H_KV, D, d_value=D_V, dtype=torch.float32)
    block = H_KV * 4 * (D + D_V) * 4
    assert cache.block_nbytes == block and cache.nbytes == 10 * block
    assert cache.allocated_nbytes == cache.used_nbytes == 0
    lengths = [5, 1, 8]
    for s, n in enumerate(lengths):
        cache.append(s, torch.randn(1, H_KV, n, D), torch.randn(1, H_KV, n, D_V))
    assert cache.allocated_nbytes == (2 + 1 + 2) * block
    assert cache.used_nbytes == sum(lengths) * H_KV * (D + D_V) * 4
    assert cache.nbytes == cache.key_pool.nbytes + cache.value_pool.nbytes


def test_footprint_of_paged_and_preallocated_caches():
    per_token = ea.cache_bytes_per_token(2, 4, 8, torch.float16)  # 2 * 2 * 4 * 8 * 2 = 256
    lengths = [1, 16, 17, 100, 0]
    footprint = ea.kv_cache_footprint(lengths, max_len=128, block_size=16, num_kv_heads=4,
                                      d_head=8, num_layers=2)
    assert footprint.used == 134 * per_token
    assert footprint.paged == (1 + 1 + 2 + 7 + 0) * 16 * per_token
    assert footprint.preallocated == 5 * 128 * per_token
    assert footprint.paged - footprint.used < 15 * per_token * len(lengths)
    cache = ea.PagedKVCache(20, 16, 4, 8, dtype=torch.float16)  # one layer: the same blocks
    for s, n in enumerate(lengths):
        cache.append(s, torch.zeros(1, 4, n, 8, dtype=torch.float16),
                     torch.zeros(1, 4, n, 8, dtype=torch.float16))
    one_layer = ea.kv_cache_footprint(lengths, max_len=128, block_size=16, num_kv_heads=4,
                                      d_head=8)
    assert (cache.allocated_nbytes, cache.used_nbytes) == (one_layer.paged, one_layer.used)
    assert ea.kv_cache_footprint([], max_len=4, block_size=2, num_kv_heads=1,
                                 d_head=1) == (0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_dtype_and_float32_accuracy(dtype):
    lengths = [6, 2]
    sequences = make_sequences(lengths, dtype=dtype, seed=3)
    cache = ea.PagedKVCache(8, 2, H_KV, D, d_value=D_V, dtype=dtype)
    outputs = decode(cache, sequences, [((0,), 3), ((1, 0), 1), ((0, 1), 1), ((0,), 1)])
    for (q, k, v), out in zip(sequences, outputs, strict=True):
        assert out.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        assert max_error(out.double(), exact(q.double(), k.double(), v.double())) < tolerance


def test_a_pool_made_under_inference_mode_serves_outside_it():
    with torch.inference_mode():
        cache = ea.PagedKVCache(2, 2, H_KV, D, dtype=F64)
    k = torch.randn(1, H_KV, 3, D, dtype=F64)
    with torch.no_grad():
        cache.append(0, k, k)
    assert torch.equal(cache.gather(0).keys[:, :, :3], k)


@pytest.mark.parametrize(
    "make, error, words",
    [(lambda: ea.PagedKVCache(0, 4, 2, 4), ValueError, ["num_blocks", "positive", "0"]),
     (lambda: ea.PagedKVCache(4, 2.0, 2, 4), TypeError, ["block_size", "int", "float"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4, dtype=torch.int8), TypeError,
      ["dtype", "floating", "int8"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4, dtype="float16"), TypeError, ["dtype", "str"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append([0, 0], torch.randn(2, 2, 1, 4),
                                                 torch.randn(2, 2, 1, 4)),
      ValueError, ["sequences", "repeat", "[0, 0]"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append([0], torch.randn(2, 2, 1, 4),
                                                 torch.randn(2, 2, 1, 4)),
      ValueError, ["one sequence per batch row", "2, got 1"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append(-1, torch.randn(1, 2, 1, 4),
                                                 torch.randn(1, 2, 1, 4)),
      ValueError, ["sequences", ">= 0", "-1"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append("a", torch.randn(1, 2, 1, 4),
                                                 torch.randn(1, 2, 1, 4)),
      TypeError, ["sequences", "list or tuple", "str"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append(0, torch.randn(1, 3, 1, 4),
                                                 torch.randn(1, 3, 1, 4)),
      ValueError, ["(kv_heads, d)=(2, 4)", "(1, 3, 1, 4)"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).append(0, torch.randn(1, 2, 1, 4).double(),
                                                 torch.randn(1, 2, 1, 4).double()),
      TypeError, ["pool's dtype torch.float32", "float64"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).gather([3]), ValueError,
      ["sequence 3 is not in the cache"]),
     (lambda: ea.PagedKVCache(4, 2, 2, 4).free(1), ValueError, ["sequence 1"]),
     (lambda: ea.kv_cache_footprint([3, 9], max_len=8, block_size=2, num_kv_heads=1,
                                    d_head=1), ValueError, ["max_len=8", "[9]"]),
     (lambda: ea.kv_cache_footprint([3, 2.5], max_len=8, block_size=2, num_kv_heads=1,
                                    d_head=1), TypeError, ["lengths", "float 2.5"]),
     (lambda: ea.kv_cache_footprint(5, max_len=8, block_size=2, num_kv_heads=1, d_head=1),
      TypeError, ["lengths", "list or tuple", "int"])],
)
def test_bad_input(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


@pytest.mark.cuda
def test_paged_decode_on_cuda():
    sequences = [tuple(t.cuda() for t in seq) for seq in make_sequences([5, 3])]
    cache = ea.PagedKVCache(5, 2, H_KV, D, d_value=D_V, dtype=F64, device="cuda")
    outputs = decode(cache, sequences, [((0, 1), 2), ((0,), 2), ((0, 1), 1)])
    for (q, k, v), out in zip(sequences, outputs, strict=True):
        assert out.device.type == "cuda" and max_error(out, exact(q, k, v)) < 1e-12
