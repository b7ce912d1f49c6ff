"""Tests for efficient_attention.tiling: tiled exact attention and the softmax merge."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import efficient_attention as ea

F64 = torch.float64
BLOCK_SIZES = [None, 1, 7, (3, 11), (16, 5), 1000]  # 1000 > n: a single tile


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*shape, seed=0, dtype=F64, **kwargs):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype,
                       **kwargs)


def _padding(*shape, seed, p=0.3):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def _reference_lse(q, k, causal=False, key_padding_mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(ea.causal_mask(q.shape[-2]), float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask.unsqueeze(-2), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


# float64 rounding: each output is a convex combination of values, accumulated over at
# most a few hundred terms with relative error ~1e-16 each; 1e-12 leaves a wide margin
# yet fails any algorithmic slip (a missing rescale is off by O(1)).
def _assert_exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n", [1, 2, 37, 64])
def test_equals_softmax_attention(n, causal, padded, block_size):
    q, k, v = _randn(2, 3, n, 8, seed=1), _randn(2, 3, n, 8, seed=2), _randn(2, 3, n, 5, seed=3)
    mask = _padding(2, 1, n, seed=4) if padded else None
    expected = ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    out, lse = ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask,
                                  block_size=block_size, return_lse=True)
    _assert_exact(out, expected)
    _assert_exact(lse, _reference_lse(q, k, causal, mask))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("n_q", "n_k"), [(1, 9), (37, 50), (50, 37), (64, 3)])
def test_more_or_fewer_queries_than_keys(n_q, n_k, block_size):
    q, k, v = _randn(3, n_q, 6, seed=5), _randn(3, n_k, 6, seed=6), _randn(3, n_k, 4, seed=7)
    mask = _padding(3, n_k, seed=8)
    expected = ea.softmax_attention(q, k, v, key_padding_mask=mask)
    _assert_exact(ea.tiled_attention(q, k, v, key_padding_mask=mask, block_size=block_size),
                  expected)


def test_leading_dimensions_broadcast():
    q, k = _randn(2, 4, 10, 8, seed=9), _randn(2, 4, 12, 8, seed=10)  # (batch, heads, n, d)
    v = _randn(4, 12, 3, seed=11)  # shared over the batch
    mask = _padding(2, 1, 12, seed=12)  # (batch, 1, n_k): one mask for every head
    expected = ea.softmax_attention(q, k, v, key_padding_mask=mask)
    out = ea.tiled_attention(q, k, v, key_padding_mask=mask, block_size=(4, 5))
    assert out.shape == (2, 4, 10, 3)
    _assert_exact(out, expected)
    unbatched = ea.tiled_attention(q[0, 0], k[0, 0], v[0], block_size=3)  # (n, d)
    _assert_exact(unbatched, ea.softmax_attention(q[0, 0], k[0, 0], v[0]))


def test_large_scores_do_not_overflow():
    # scores of size ~1e4: exp would overflow without the running maximum
    q, k, v = 100 * _randn(2, 30, 16, seed=13), 100 * _randn(2, 30, 16, seed=14), _randn(
        2, 30, 4, seed=15)
    out = ea.tiled_attention(q, k, v, causal=True, block_size=4)
    _assert_exact(out, ea.softmax_attention(q, k, v, causal=True))


def test_row_without_keys_is_zero_with_lse_minus_inf_and_zero_gradients():
    q, k, v = (_randn(2, 6, 4, seed=s, requires_grad=True) for s in (16, 17, 18))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1] = True  # the second sequence is all padding
    out, lse = ea.tiled_attention(q, k, v, key_padding_mask=mask, block_size=4, return_lse=True)
    assert torch.equal(out[1], torch.zeros(6, 4, dtype=F64))
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    (out.sum() + lse[0].sum()).backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[1], torch.zeros(6, 4, dtype=F64))


def test_padded_keys_holding_nan_and_inf_take_no_part():
    q, k, v = (_randn(2, 9, 4, seed=s) for s in (19, 20, 21))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 6:] = True
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, 6], v_bad[:, 7], k_bad[:, 8], v_bad[:, 8] = math.nan, math.inf, -math.inf, math.nan
    inputs = [x.requires_grad_() for x in (q.clone(), k_bad, v_bad)]
    out = ea.tiled_attention(*inputs, key_padding_mask=mask, block_size=4, causal=True)
    expected = ea.softmax_attention(q, k, v, key_padding_mask=mask, causal=True)
    _assert_exact(out, expected)
    out.sum().backward()
    clean = [x.requires_grad_() for x in (q, k, v)]  # the same without NaN and inf
    ea.softmax_attention(*clean, key_padding_mask=mask, causal=True).sum().backward()
    for x, ref in zip(inputs, clean, strict=True):
        assert torch.isfinite(x.grad).all()
        _assert_exact(x.grad, ref.grad)
    for x in inputs[1:]:
        assert torch.equal(x.grad[:, 6:], torch.zeros(2, 3, 4, dtype=F64))


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_those_of_softmax_attention(causal):
    q, k, v = (_randn(2, 2, 23, 8, seed=s, requires_grad=True) for s in (22, 23, 24))
    mask = _padding(2, 1, 23, seed=25)
    g = _randn(2, 2, 23, 8, seed=26)
    (ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask, block_size=(5, 7))
     * g).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    (ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask) * g).sum().backward()
    for got, x in zip(grads, (q, k, v), strict=True):
        _assert_exact(got, x.grad)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gradcheck(causal, padded):
    q, k, v = (_randn(1, 2, 7, 3, seed=s, requires_grad=True) for s in (27, 28, 29))
    mask = None
    if padded:  # one padded key in head 0, every key padded in head 1 (zero rows)
        mask = torch.zeros(1, 2, 7, dtype=torch.bool)
        mask[0, 0, 4], mask[0, 1] = True, True

    def f(q, k, v):
        return ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask,
                                  block_size=(2, 3))

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_second_derivatives_are_refused_not_wrong():
    q = _randn(5, 3, seed=59, requires_grad=True)
    (grad,) = torch.autograd.grad(ea.tiled_attention(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


def test_gradcheck_of_the_log_sum_exp():
    q, k, v = (_randn(2, 6, 3, seed=s, requires_grad=True) for s in (30, 31, 32))
    mask = torch.tensor([True, False, False, False, False, True])

    def f(q, k, v):  # query 0 sees only key 0, which is padding: its lse is -inf, left out
        return ea.tiled_attention(q, k, v, causal=True, key_padding_mask=mask, block_size=4,
                                  return_lse=True)[1][:, 1:]

    assert torch.autograd.gradcheck(f, (q, k, v))


def _split_attention(q, k, v, cut):
    a = ea.tiled_attention(q, k[..., :cut, :], v[..., :cut, :], return_lse=True)
    b = ea.tiled_attention(q, k[..., cut:, :], v[..., cut:, :], return_lse=True)
    return a, b


@pytest.mark.parametrize("cut", [1, 5, 19])
def test_merging_two_partials_is_exact(cut):
    q, k, v = _randn(2, 11, 8, seed=33), 3 * _randn(2, 20, 8, seed=34), _randn(2, 20, 5, seed=35)
    (out_a, lse_a), (out_b, lse_b) = _split_attention(q, k, v, cut)
    out, lse = ea.merge_softmax_partials(out_a, lse_a, out_b, lse_b)
    _assert_exact(out, ea.softmax_attention(q, k, v))
    _assert_exact(lse, _reference_lse(q, k))
    swapped = ea.merge_softmax_partials(out_b, lse_b, out_a, lse_a)  # commutative
    _assert_exact(swapped[0], out)


def test_merging_three_devices_in_any_grouping_is_exact():
    q, k, v = _randn(3, 9, 4, seed=36), _randn(3, 30, 4, seed=37), _randn(3, 30, 4, seed=38)
    parts = [ea.tiled_attention(q, k[:, s], v[:, s], return_lse=True)
             for s in (slice(0, 8), slice(8, 21), slice(21, 30))]
    left = ea.merge_softmax_partials(*ea.merge_softmax_partials(*parts[0], *parts[1]), *parts[2])
    right = ea.merge_softmax_partials(*parts[0], *ea.merge_softmax_partials(*parts[1], *parts[2]))
    _assert_exact(left[0], ea.softmax_attention(q, k, v))
    _assert_exact(right[0], left[0])


def test_merging_with_an_empty_side():
    out_a, lse_a = _randn(4, 3, seed=39), _randn(4, seed=40)
    garbage = torch.full((4, 3), math.nan, dtype=F64)  # an empty side's output is ignored
    empty = torch.full((4,), -math.inf, dtype=F64)
    for args in ((out_a, lse_a, garbage, empty), (garbage, empty, out_a, lse_a)):
        out, lse = ea.merge_softmax_partials(*args)
        assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = ea.merge_softmax_partials(garbage, empty, torch.zeros(4, 3, dtype=F64), empty)
    assert torch.equal(out, torch.zeros(4, 3, dtype=F64)) and torch.isneginf(lse).all()


def test_merge_gradients_are_finite_with_empty_sides():
    out_a, lse_a = _randn(4, 3, seed=41, requires_grad=True), _randn(4, seed=42)
    lse_a = torch.where(torch.arange(4) < 2, lse_a, -math.inf).requires_grad_()
    out_b = _randn(4, 3, seed=43, requires_grad=True)
    lse_b = torch.full((4,), -math.inf, dtype=F64).requires_grad_()
    out, lse = ea.merge_softmax_partials(out_a, lse_a, out_b, lse_b)
    (out.sum() + lse[:2].sum()).backward()
    for x in (out_a, lse_a, out_b, lse_b):
        assert torch.isfinite(x.grad).all()
    assert torch.autograd.gradcheck(
        ea.merge_softmax_partials,
        (out_a.detach()[:2].requires_grad_(), lse_a.detach()[:2].requires_grad_(),
         out_b.detach()[:2].requires_grad_(), _randn(2, seed=44, requires_grad=True)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    q, k, v = (_randn(2, 40, 16, seed=s, dtype=torch.float32).to(dtype) for s in (45, 46, 47))
    out, lse = ea.tiled_attention(q, k, v, causal=True, block_size=(8, 16), return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected = ea.softmax_attention(q.float(), k.float(), v.float(), causal=True)
    # Computed in float32 (error ~1e-6), then rounded once to the output dtype: half an
    # ulp, a relative error of at most 2^-11 (float16) or 2^-8 (bfloat16).
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, rtol=eps / 2, atol=1e-5)
    q.requires_grad_()
    ea.tiled_attention(q, k, v).sum().backward()
    assert q.grad.dtype == dtype and torch.isfinite(q.grad).all()


def test_forward_and_backward_never_allocate_more_than_a_tile_or_the_inputs():
    """At n = 1024 every tensor made during a causal, padded training step is at most the
    size of an input, n d per batch element, or one tile; an n x n score matrix would be
    64 times larger than the inputs (n / d = 64)."""
    batch, n, d, block = 2, 1024, 16, (64, 128)
    q, k, v = (_randn(batch, n, d, seed=s, requires_grad=True) for s in (48, 49, 50))
    mask = _padding(batch, n, seed=51)
    largest = {"forward": 0, "backward": 0, "saved": 0}

    class Largest(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    largest[self.phase] = max(largest[self.phase], t.numel())
            return out

    def pack(t):
        largest["saved"] = max(largest["saved"], t.numel())
        return t

    mode = Largest()
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ea.tiled_attention(q, k, v, causal=True, key_padding_mask=mask, block_size=block)
        mode.phase = "backward"
        out.sum().backward()
    bound = max(batch * n * d, batch * block[0] * block[1])
    assert 0 < largest["forward"] <= bound and 0 < largest["backward"] <= bound, largest
    assert largest["saved"] <= batch * n * d  # the forward keeps inputs, output, lse only
    assert batch * n * n >= 64 * bound  # the test can tell a quadratic buffer apart


def test_causal_skips_the_tiles_above_the_diagonal():
    counts = {}

    class CountMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__.rstrip("_")  # baddbmm_ is in place
            if name in ("bmm", "baddbmm"):
                counts[self.key] = counts.get(self.key, 0) + 1
            return func(*args, **(kwargs or {}))

    q, k, v = (_randn(1, 64, 4, seed=s) for s in (52, 53, 54))
    for causal in (False, True):
        mode = CountMatmuls()
        mode.key = causal
        with mode:
            ea.tiled_attention(q, k, v, causal=causal, block_size=16)
    # 4 x 4 tiles, two products each; causal keeps the 4 * 5 / 2 = 10 tiles on or below
    # the diagonal
    assert counts == {False: 2 * 16, True: 2 * 10}


def _count_fallbacks(monkeypatch):
    """Count the query tiles that the forward redoes with the running maximum."""
    import efficient_attention.tiling as tiling

    calls = []
    original = tiling._running_max_tile

    def counted(*args):
        calls.append(args[6] - args[5])  # (q_tile, k, v, mask, causal, q_start, q_stop, ..)
        return original(*args)

    monkeypatch.setattr(tiling, "_running_max_tile", counted)
    return calls


def _spike(n, d, key, gap, dtype):
    """Queries with first coordinate 1 and keys near 0, except key ``key`` = ``gap sqrt(d)``
    times the first axis: its score is exactly ``gap`` above 0 for every query, the other
    scores are within ``0.1^2 d / sqrt(d)`` of 0."""
    q = 0.1 * _randn(2, n, d, seed=60, dtype=dtype)
    q[..., 0] = 1.0
    k, v = 0.1 * _randn(2, n, d, seed=61, dtype=dtype), _randn(2, n, 3, seed=62, dtype=dtype)
    k[:, key] = 0.0
    k[:, key, 0] = gap * math.sqrt(d)
    return q, k, v


def _float32_tolerance(q, k, v):
    """Bound on |tiled - exact| for float32 inputs: each score s_ij = q_i.k_j / sqrt(d) is
    off by at most (d + 2) eps sum_c |q_ic k_jc| / sqrt(d) (a dot product, the scale and
    log2 e), the exponential by a few ulps; a relative error delta in every weight moves
    the output, a convex combination of values, by at most 2 delta max |v|."""
    eps = torch.finfo(torch.float32).eps
    score_error = (q.abs() @ k.abs().transpose(-2, -1)).max().item() / math.sqrt(q.shape[-1])
    delta = (q.shape[-1] + 2) * eps * score_error + 4 * eps
    return 2 * delta * v.abs().max().item() + 1e-6


def test_ordinary_inputs_keep_one_shift_per_query(monkeypatch):
    """No query tile of ordinary inputs (scores of order 1, padding that leaves a key in
    every first tile) needs the running maximum; the result is exact in float64."""
    fallbacks = _count_fallbacks(monkeypatch)
    q, k = _randn(2, 3, 70, 8, seed=63), _randn(2, 3, 70, 8, seed=64)
    v = _randn(2, 3, 70, 5, seed=65)
    mask = _padding(2, 1, 70, seed=66)
    mask[..., 0] = False  # key 0 is in every first tile
    for causal in (False, True):
        expected = ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        out = ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask, block_size=(8, 16))
        _assert_exact(out, expected)
    assert fallbacks == []


@pytest.mark.parametrize("causal", [False, True])
def test_a_gap_of_60_in_float32_needs_no_rescaling(monkeypatch, causal):
    """A later score 60 above the first tile's maximum gives a weight 2^86.6: large, but a
    float32 sum of such weights stays finite (below 2^128), so the shift of the first tile
    is kept, and the quotient is as accurate as float32 allows."""
    fallbacks = _count_fallbacks(monkeypatch)
    q, k, v = _spike(64, 4, key=40, gap=60.0, dtype=torch.float32)
    out = ea.tiled_attention(q, k, v, causal=causal, block_size=(8, 16))
    expected = ea.softmax_attention(q.double(), k.double(), v.double(), causal=causal)
    torch.testing.assert_close(out.double(), expected, rtol=0,
                               atol=_float32_tolerance(q, k, v))
    assert fallbacks == []
    # the spike dominates: queries that see key 40 output (almost exactly) its value
    torch.testing.assert_close(out[:, 40:], v[:, 40:41].expand(-1, 24, -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("dtype", "gap"), [(torch.float32, 100.0), (F64, 800.0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sums_that_would_overflow_fall_back_to_the_running_maximum(monkeypatch, dtype, gap,
                                                                     causal):
    """e^gap overflows (float32 above e^88.7, float64 above e^709.8): the query tiles that
    see the spike are redone with the running maximum, and the result is still exact."""
    fallbacks = _count_fallbacks(monkeypatch)
    q, k, v = _spike(64, 4, key=40, gap=gap, dtype=dtype)
    out, lse = ea.tiled_attention(q, k, v, causal=causal, block_size=(8, 16), return_lse=True)
    expected = ea.softmax_attention(q.double(), k.double(), v.double(), causal=causal)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if dtype == F64:
        _assert_exact(out, expected)
        _assert_exact(lse, _reference_lse(q, k, causal=causal))
    else:
        torch.testing.assert_close(out.double(), expected, rtol=0,
                                   atol=_float32_tolerance(q, k, v))
    # every query sees key 40 unless causal, where only the 3 tiles from query 40 on do
    assert fallbacks == ([8] * 3 if causal else [8] * 8)


def test_a_query_with_no_key_in_its_first_tile_falls_back(monkeypatch):
    """Padding over the whole first key tile leaves no shift to take: that batch element's
    query tiles use the running maximum (all of them, as the batch shares the tiles)."""
    fallbacks = _count_fallbacks(monkeypatch)
    q, k, v = _randn(2, 40, 6, seed=67), _randn(2, 40, 6, seed=68), _randn(2, 40, 6, seed=69)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, :12] = True  # batch element 1: the first key tile (16 keys) has 4 visible keys
    _assert_exact(ea.tiled_attention(q, k, v, key_padding_mask=mask, block_size=(8, 16)),
                  ea.softmax_attention(q, k, v, key_padding_mask=mask))
    assert fallbacks == []
    mask[1, :16] = True  # now none
    _assert_exact(ea.tiled_attention(q, k, v, key_padding_mask=mask, block_size=(8, 16)),
                  ea.softmax_attention(q, k, v, key_padding_mask=mask))
    assert fallbacks == [8] * 5


def test_the_flop_counter_sees_both_products():
    """2 n_q n_k (d + d_v) operations per batch element, the scores and the weighted sum of
    values, as for standard attention; causal with one tile per block: (T + 1) / 2T."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _randn(3, 96, 8, seed=70), _randn(3, 96, 8, seed=71), _randn(3, 96, 5, seed=72)
    counted = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            ea.tiled_attention(q, k, v, causal=causal, block_size=16)
        counted[causal] = counter.get_total_flops()
    assert counted[False] == 3 * 2 * 96 * 96 * (8 + 5)
    assert counted[True] / counted[False] == (6 + 1) / (2 * 6)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), max_size=2),
    n_q=st.integers(1, 20),
    n_k=st.integers(1, 20),
    d=st.integers(1, 6),
    d_v=st.integers(1, 6),
    block_q=st.integers(1, 24),
    block_k=st.integers(1, 24),
    causal=st.booleans(),
    pad_rate=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_tile_and_mask(batch, n_q, n_k, d, d_v, block_q, block_k, causal,
                                          pad_rate, seed):
    if causal:
        n_k = n_q
    q, k = _randn(*batch, n_q, d, seed=seed), _randn(*batch, n_k, d, seed=seed + 1)
    v = _randn(*batch, n_k, d_v, seed=seed + 2)
    mask = _padding(*batch, n_k, seed=seed + 3, p=pad_rate) if pad_rate else None
    out = ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask,
                             block_size=(block_q, block_k))
    assert out.shape == (*batch, n_q, d_v)
    _assert_exact(out, ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask))


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"q": [[1.0]]}, TypeError, "q must be a torch.Tensor"),
        ({"q": torch.ones(2, 3, dtype=torch.int64)}, TypeError,
         "q must be a real floating-point tensor"),
        ({"k": torch.ones(5, 4)}, ValueError, "q and k must have the same last dimension"),
        ({"v": torch.ones(4, 3)}, ValueError, "k and v must have the same sequence length"),
        ({"block_size": 0}, ValueError, "block_size must be a positive int"),
        ({"block_size": 2.0}, TypeError, "block_size must be a positive int"),
        ({"block_size": (4, 0)}, ValueError, "block_size[1]"),
        ({"block_size": (1, 2, 3)}, ValueError, "block_size must be an int or a pair"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"return_lse": "yes"}, TypeError, "return_lse must be a bool"),
        ({"k": torch.ones(3, 3), "v": torch.ones(3, 3), "causal": True}, ValueError,
         "causal=True needs as many queries as keys"),
        ({"key_padding_mask": torch.zeros(5)}, TypeError, "key_padding_mask must have dtype"),
        ({"key_padding_mask": torch.zeros(4, dtype=torch.bool)}, ValueError,
         "key_padding_mask must be broadcastable"),
        ({name: torch.ones(shape, dtype=torch.complex64)
          for name, shape in (("q", (2, 3)), ("k", (5, 3)), ("v", (5, 2)))},
         TypeError, "float16, bfloat16"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    args = {"q": torch.ones(2, 3), "k": torch.ones(5, 3), "v": torch.ones(5, 2), **kwargs}
    with pytest.raises(error, match=re.escape(words)):
        ea.tiled_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_merge_bad_input_names_the_argument():
    out, lse = torch.zeros(3, 4), torch.zeros(3)
    with pytest.raises(ValueError, match="lse_b must have the shape of out_b"):
        ea.merge_softmax_partials(out, lse, out, torch.zeros(4))
    with pytest.raises(ValueError, match="out_a and out_b must have the same shape"):
        ea.merge_softmax_partials(out, lse, torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(TypeError, match="out_a must be a torch.Tensor"):
        ea.merge_softmax_partials(None, lse, out, lse)


def test_module_is_importable_under_its_own_name():
    import efficient_attention.tiling as tiling

    assert tiling.tiled_attention is ea.tiled_attention
    assert {"tiled_attention", "merge_softmax_partials"} <= set(ea.__all__)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_cpu(causal):
    q, k, v = (_randn(2, 4, 300, 32, seed=s, dtype=torch.float32) for s in (55, 56, 57))
    mask = _padding(2, 1, 300, seed=58)
    expected = ea.tiled_attention(q, k, v, causal=causal, key_padding_mask=mask)
    cuda = [x.cuda().requires_grad_() for x in (q, k, v)]
    out = ea.tiled_attention(*cuda, causal=causal, key_padding_mask=mask.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in cuda)
