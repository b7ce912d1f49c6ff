"""Property tests (hypothesis): every public attention function against a float64 reference
written out here, on drawn shapes (empty and size-1 dimensions, 0 to 3 leading dims,
n_q != n_k), dtypes and every accepted mask shape -- or against its documented error.

The references are the formulas themselves, as dense ``n_q x n_k`` weight matrices in
float64: ``out_i = sum_j W_ij v_j / sum_j W_ij`` over the keys query ``i`` may see, and 0
for a query with none.

Tolerances: float64 results differ from the dense reference only by summation order
(~1e-12 for these tiny sizes); float32 carries ~6e-8 relative rounding per operation and
the outputs are averages of O(1) values, so 1e-4 is generous; float16/bfloat16 inputs
are computed in float32 but the output is rounded to 11 (8) significant bits:
2^-8 ~ 4e-3 relative for bfloat16 on values of size up to ~4, hence 5e-2.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-2,
             torch.bfloat16: 5e-2}


@st.composite
def problems(draw, *, square=False, causal_ok=True, dtypes=tuple(TOLERANCE)):
    """Shapes, dtype, causal flag and a mask of any accepted shape (or None)."""
    batch = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    n_k = draw(st.integers(0, 6))
    n_q = n_k if square else draw(st.integers(0, 6))
    d = draw(st.integers(1, 4))
    d_v = draw(st.integers(0, 3))
    causal = draw(st.booleans()) if causal_ok else False
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # Leading dims of q, k and v may each be 1 where the others are not (broadcasting).
    shapes = [[b if draw(st.booleans()) else 1 for b in batch] for _ in range(3)]
    q = torch.randn(*shapes[0], n_q, d, generator=g, dtype=F64)
    k = torch.randn(*shapes[1], n_k, d, generator=g, dtype=F64)
    v = torch.randn(*shapes[2], n_k, d_v, generator=g, dtype=F64)
    mask = None
    if draw(st.booleans()):
        # Any shape broadcastable to k.shape[:-1]: a suffix of the key batch dims, each
        # kept or 1, and n_k or 1 for the last.
        key_batch = list(k.shape[:-2])
        keep = draw(st.integers(0, len(key_batch)))
        mask_batch = [b if draw(st.booleans()) else 1 for b in key_batch[len(key_batch) - keep:]]
        last = n_k if draw(st.booleans()) else 1
        mask = torch.rand(*mask_batch, last, generator=g) < 0.4
    return q.to(dtype), k.to(dtype), v.to(dtype), causal, mask


def _visible(q, k, causal, mask, band=None):
    """Bool (..., n_q, n_k): True where query i may see key j."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    i = torch.arange(n_q).unsqueeze(-1)
    j = torch.arange(n_k)
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if band is not None:
        visible &= (i - j).abs() <= band
    if mask is not None:
        visible = visible & ~mask.unsqueeze(-2)
    return visible


def _normalise(weights, visible, v, eps=0.0):
    """sum_j W_ij v_j / (sum_j W_ij + eps) over visible keys; rows with no key give 0."""
    weights = torch.where(visible, weights, torch.zeros((), dtype=F64))
    total = weights.sum(-1, keepdim=True)
    if eps == 0.0:
        total = torch.where(total == 0, torch.ones((), dtype=F64), total)
    else:
        total = total + eps
    return (weights @ v) / total


def _softmax_reference(q, k, v, causal, mask, band=None):
    q, k, v = q.double(), k.double(), v.double()
    visible = _visible(q, k, causal, mask, band)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = torch.where(visible, scores, torch.tensor(-math.inf, dtype=F64))
    if scores.shape[-1] == 0:  # no key at all: every row is 0
        return _normalise(scores, visible, v)
    top = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # rows with no key: anything finite
    return _normalise(torch.exp(scores - top), visible, v)


def _linear_reference(q, k, v, causal, mask, feature_map=ea.elu_feature_map, eps=1e-6):
    q, k, v = q.double(), k.double(), v.double()
    weights = feature_map(q) @ feature_map(k).transpose(-2, -1)
    return _normalise(weights, _visible(q, k, causal, mask), v, eps)


def _check(out, expected, q):
    assert out.dtype == q.dtype and out.shape == expected.shape
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def _expect_documented_error(fn, q, k, v, causal, mask, square=False):
    """Causal (or a band) needs n_q == n_k: the documented ValueError, else None."""
    if (causal or square) and q.shape[-2] != k.shape[-2]:
        with pytest.raises(ValueError, match="as many queries as keys"):
            fn(q, k, v, causal=causal, key_padding_mask=mask)
        return True
    return False


@SETTINGS
@given(problems())
def test_softmax_attention(problem):
    q, k, v, causal, mask = problem
    if _expect_documented_error(ea.softmax_attention, q, k, v, causal, mask):
        return
    out = ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    _check(out, _softmax_reference(q, k, v, causal, mask), q)


@SETTINGS
@given(problems())
def test_kernelized_attention_with_the_softmax_kernel(problem):
    q, k, v, causal, mask = problem

    def fn(q, k, v, **kw):
        return ea.kernelized_attention(q, k, v, ea.softmax_kernel, **kw)

    if _expect_documented_error(fn, q, k, v, causal, mask):
        return
    _check(fn(q, k, v, causal=causal, key_padding_mask=mask),
           _softmax_reference(q, k, v, causal, mask), q)


@SETTINGS
@given(problems(), st.sampled_from([None, 1, 4]), st.sampled_from([None, 1, 2]))
def test_linear_attention(problem, block_size, chunk_size):
    q, k, v, causal, mask = problem
    if _expect_documented_error(ea.linear_attention, q, k, v, causal, mask):
        return
    out = ea.linear_attention(q, k, v, causal=causal, key_padding_mask=mask,
                              block_size=block_size, chunk_size=chunk_size)
    _check(out, _linear_reference(q, k, v, causal, mask), q)


FEATURES = {"positive": ea.positive_softmax_features, "hyperbolic":
            ea.hyperbolic_softmax_features, "trig": ea.trig_softmax_features}


@SETTINGS
@given(problems(dtypes=(torch.float64, torch.float32)), st.sampled_from(list(FEATURES)),
       st.sampled_from([None, 1, 3]), st.sampled_from([None, 1, 2]))
def test_favor_attention(problem, kind, block_size, chunk_size):
    """Reference: the textbook estimator, W_ij = phi(q~_i) . phi(k~_j) with the public
    (unstabilised, unbiased) feature maps, q~ = d^-1/4 q. (Trig weights can sum to values
    near 0, which amplifies rounding: trig is checked in float64 only.)"""
    q, k, v, causal, mask = problem
    if kind == "trig" and q.dtype != F64:
        q, k, v = q.double(), k.double(), v.double()
    d = q.shape[-1]
    w = ea.gaussian_random_matrix(8, d, orthogonal=True, dtype=q.dtype,
                                  generator=torch.Generator().manual_seed(d))

    def fn(q, k, v, **kw):
        return ea.favor_attention(q, k, v, w, features=kind, block_size=block_size,
                                  chunk_size=chunk_size, **kw)

    if _expect_documented_error(fn, q, k, v, causal, mask):
        return
    out = fn(q, k, v, causal=causal, key_padding_mask=mask)
    scale = d**-0.25

    def phi(x):
        return FEATURES[kind](x * scale, w.double())

    expected = _linear_reference(q, k, v, causal, mask, phi, eps=0.0)
    if kind == "trig":  # sums of signed terms: compare where the normaliser is not tiny
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        _check(out, expected, q)


@SETTINGS
@given(problems(square=True), st.integers(0, 3), st.sampled_from([None, 1, 2, 5]))
def test_banded_attention(problem, bandwidth, block_size):
    q, k, v, causal, mask = problem
    out = ea.banded_attention(q, k, v, bandwidth, causal=causal, key_padding_mask=mask,
                              block_size=block_size)
    _check(out, _softmax_reference(q, k, v, causal, mask, band=bandwidth), q)


@SETTINGS
@given(problems(square=False))
def test_banded_and_fmm_attention_need_square_inputs(problem):
    q, k, v, causal, mask = problem
    fmm = dict(bandwidth=1, feature_maps=ea.elu_feature_map, near_weight=1.0, far_weight=1.0)
    if q.shape[-2] == k.shape[-2]:
        return
    with pytest.raises(ValueError, match="as many queries as keys"):
        ea.banded_attention(q, k, v, 1, causal=causal, key_padding_mask=mask)
    with pytest.raises(ValueError, match="as many queries as keys"):
        ea.fmm_attention(q, k, v, causal=causal, key_padding_mask=mask, **fmm)


@SETTINGS
@given(problems(square=True), st.integers(0, 3), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_fmm_attention(problem, bandwidth, near, far):
    q, k, v, causal, mask = problem
    maps = [ea.elu_feature_map, ea.elu_negative_feature_map]
    out = ea.fmm_attention(q, k, v, bandwidth=bandwidth, feature_maps=maps, near_weight=near,
                           far_weight=[far, 0.5], causal=causal, key_padding_mask=mask)
    expected = near * _softmax_reference(q, k, v, causal, mask, band=bandwidth)
    expected = expected + far * _linear_reference(q, k, v, causal, mask, maps[0])
    expected = expected + 0.5 * _linear_reference(q, k, v, causal, mask, maps[1])
    _check(out, expected, q)


@SETTINGS
@given(problems(causal_ok=False, dtypes=(torch.float64,)))
def test_nystrom_attention_with_every_key_a_landmark_is_softmax(problem):
    """With m >= n every segment holds one key (or query): A1 pinv(A2) A3 V = A V for the
    exact pseudo-inverse, whatever the padding (see nystrom_attention's docstring)."""
    q, k, v, _, mask = problem
    m = max(q.shape[-2], k.shape[-2], 1)
    out = ea.nystrom_attention(q, k, v, m, pinv_iterations=None, key_padding_mask=mask)
    _check(out, _softmax_reference(q, k, v, False, mask), q)


@SETTINGS
@given(problems(causal_ok=False, dtypes=(torch.float64, torch.float32, torch.bfloat16)),
       st.integers(1, 4))
def test_nystrom_attention_shapes_and_finiteness(problem, m):
    """Any m: the documented shape and dtype, finite outputs, zeros where no key is left."""
    q, k, v, _, mask = problem
    out = ea.nystrom_attention(q, k, v, m, key_padding_mask=mask)
    expected = _softmax_reference(q, k, v, False, mask)
    assert out.shape == expected.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    no_key = _visible(q, k, False, mask).sum(-1) == 0  # (..., n_q)
    no_key = no_key.expand(out.shape[:-1])
    assert torch.equal(out[no_key], torch.zeros_like(out[no_key]))


@SETTINGS
@given(problems(causal_ok=False))
def test_argmax_attention(problem):
    q, k, v, _, _ = problem
    if k.shape[-2] == 0:
        with pytest.raises(ValueError, match="at least one key"):
            ea.argmax_attention(q, k, v)
        return
    out = ea.argmax_attention(q, k, v)
    scores = q.double() @ k.double().transpose(-2, -1)
    expected = torch.nn.functional.one_hot(scores.argmax(-1), k.shape[-2]).double() @ v.double()
    if q.dtype == F64:  # in lower precision, near-ties may pick another key
        _check(out, expected, q)
    assert out.shape == expected.shape and out.dtype == q.dtype
