"""The library at its edges (issue 14): empty sizes, NaN and inf, padding that holds
garbage, large inputs, half precision. Every attention function is run through the same
cases; the property tests (test_properties.py) draw the shapes at random."""

import pytest
import torch

import efficient_attention as ea

F64 = torch.float64


def _w(m=16, d=4, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ea.gaussian_random_matrix(m, d, orthogonal=True, generator=g, dtype=dtype)


def _favor(kind):
    def run(q, k, v, **kw):
        return ea.favor_attention(q, k, v, _w(d=max(q.shape[-1], 1), dtype=q.dtype),
                                  features=kind,
                                  **kw)
    return run


def _fmm(q, k, v, **kw):
    return ea.fmm_attention(q, k, v, bandwidth=2, feature_maps=[ea.elu_feature_map],
                            near_weight=0.5, far_weight=[0.5], **kw)


# name -> (function(q, k, v, **kw), supports causal, needs n_q == n_k)
ATTENTION = {
    "softmax": (ea.softmax_attention, True, False),
    "kernelized": (lambda q, k, v, **kw: ea.kernelized_attention(q, k, v, ea.softmax_kernel,
                                                                 **kw), True, False),
    "linear": (ea.linear_attention, True, False),
    "favor_positive": (_favor("positive"), True, False),
    "favor_hyperbolic": (_favor("hyperbolic"), True, False),
    "favor_trig": (_favor("trig"), True, False),
    "banded": (lambda q, k, v, **kw: ea.banded_attention(q, k, v, 2, **kw), True, True),
    "fmm": (_fmm, True, True),
    "nystrom": (lambda q, k, v, causal=False, **kw: ea.nystrom_attention(q, k, v, 3, **kw),
                False, False),
    "tiled": (lambda q, k, v, **kw: ea.tiled_attention(q, k, v, block_size=(2, 3), **kw),
              True, False),
}


def _qkv(batch, n_q, n_k, d=4, d_v=3, dtype=F64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*batch, n, e, generator=g, dtype=dtype).requires_grad_(requires_grad)
        for n, e in ((n_q, d), (n_k, d), (n_k, d_v))
    )


def _cases(need_causal=False):
    for name, (fn, causal_ok, square) in ATTENTION.items():
        for causal in (False, True):
            if causal and not causal_ok or need_causal and not causal:
                continue
            yield pytest.param(fn, causal, square, id=f"{name}-causal={causal}")


# --- 1. empty sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("fn, causal, square", list(_cases()))
@pytest.mark.parametrize(
    "batch, n_q, n_k, d_v",
    [((0,), 5, 5, 3), ((2, 0), 5, 5, 3), ((2,), 0, 0, 3), ((2,), 0, 5, 3), ((2,), 5, 0, 3),
     ((2,), 5, 5, 0), ((), 0, 0, 0)],
)
def test_empty_sizes_return_the_right_empty_result(fn, causal, square, batch, n_q, n_k, d_v):
    """Issue 14: linear/favor never returned on empty sizes, banded/fmm/softmax raised
    misleading errors. Now: the empty result, or zeros for queries with no key (n_k = 0);
    never a hang. Gradients flow (n_q = 0 under autograd used to fail)."""
    if (causal or square) and n_q != n_k:
        with pytest.raises(ValueError, match="as many queries as keys"):
            fn(*_qkv(batch, n_q, n_k, d_v=d_v), causal=causal)
        return
    q, k, v = _qkv(batch, n_q, n_k, d_v=d_v, requires_grad=True)
    out = fn(q, k, v, causal=causal)
    assert out.shape == (*batch, n_q, d_v) and out.dtype == q.dtype
    assert torch.equal(out, torch.zeros_like(out))  # n_k = 0: no key, documented zeros
    out.sum().backward()


@pytest.mark.parametrize("fn, causal, square", list(_cases()))
def test_no_feature_is_a_clear_error(fn, causal, square):
    with pytest.raises(ValueError, match=r"at least one feature \(d >= 1\)"):
        fn(*_qkv((2,), 3, 3, d=0), causal=causal)


def test_other_empty_edges():
    q, k, v = _qkv((2,), 3, 0)
    with pytest.raises(ValueError, match="argmax_attention needs at least one key"):
        ea.argmax_attention(q, k, v)
    assert ea.argmax_attention(*_qkv((0,), 3, 4)).shape == (0, 3, 3)
    assert ea.causal_mask(0).shape == (0, 0)
    rnn = ea.RecurrentLinearAttention()
    assert rnn(*_qkv((2,), 0, 0)).shape == (2, 0, 3) and rnn.state is None
    assert ea.iterative_pinv(torch.zeros(0, 0)).shape == (0, 0)
    assert ea.iterative_pinv(torch.zeros(4, 0, 0)).shape == (4, 0, 0)
    with pytest.raises(ValueError, match=r"w must have shape \(m, d\) with m >= 1"):
        ea.favor_attention(*_qkv((2,), 3, 3), torch.zeros(0, 4, dtype=F64))
    with pytest.raises(ValueError, match="w must be a matrix .* m >= 1"):
        ea.positive_softmax_features(torch.randn(3, 4), torch.zeros(0, 4))
    mha = ea.MultiHeadAttention(8, 2)
    assert mha(torch.randn(0, 5, 8)).shape == (0, 5, 8)
    assert mha(torch.randn(2, 0, 8), causal=True).shape == (2, 0, 8)


def test_block_size_heuristic_ends_on_empty_width():
    """The loop in default_block_size never ended when batch * width = 0."""
    from efficient_attention._blockwise import default_block_size

    assert default_block_size(0, 5, 10) == 10
    assert default_block_size(3, 0, 1000) == 64
    assert default_block_size(0, 0, 0) == 1
    assert default_block_size(8, 256, 8192) == 512  # the measured size, unchanged


# --- 2. NaN and inf propagate where the maths does --------------------------------------


@pytest.mark.parametrize("fn, causal, square", list(_cases()))
def test_a_nan_query_gives_a_nan_row(fn, causal, square):
    """softmax_attention used to turn every NaN into 0. A NaN in query i must show in
    output i (nystrom mixes every query into its landmarks: there, everything is NaN)."""
    q, k, v = _qkv((2,), 6, 6)
    q[0, 4, 1] = float("nan")
    out = fn(q, k, v, causal=causal)
    assert out[0, 4].isnan().all()
    assert torch.isfinite(out[1]).all()


def test_softmax_nan_scale_and_keys_propagate_like_sdpa():
    q, k, v = _qkv((2, 3), 5, 7)
    out = ea.softmax_attention(q, k, v, scale=float("nan"))
    assert out.isnan().all()
    k_nan = k.clone()
    k_nan[0, 0, 2, 0] = float("nan")
    ours = ea.softmax_attention(q, k_nan, v)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k_nan, v)
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours[0, 0].isnan().all()
    torch.testing.assert_close(ours[1], theirs[1])


def test_fully_masked_rows_are_the_only_zero_rows():
    q, k, v = _qkv((2,), 4, 5)
    mask = torch.tensor([[True] * 5, [False, True, False, True, True]])
    out, weights = ea.softmax_attention(q, k, v, key_padding_mask=mask, return_weights=True)
    assert torch.equal(out[0], torch.zeros(4, 3, dtype=F64))
    assert torch.equal(weights[0], torch.zeros(4, 5, dtype=F64))
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(4, dtype=F64))


def test_float16_scores_are_scaled_before_the_product():
    """q = 130, k = 1 in float16 with d = 4: q k^T = 520 per entry would fit, but with
    q = k = 130, q k^T = 67600 overflows float16 (max 65504) while the scaled score
    33800 does not. The old code scaled after the product: inf - inf = NaN."""
    q = torch.full((1, 2, 4), 130.0, dtype=torch.float16)
    k = torch.full((1, 3, 4), 130.0, dtype=torch.float16)
    v = torch.randn(1, 3, 2).to(torch.float16)
    out = ea.softmax_attention(q, k, v)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    expected = ea.softmax_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3)


# --- 4. padded keys and values take no part, whatever they hold ---------------------------


@pytest.mark.parametrize("fn, causal, square", list(_cases()))
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_padded_keys_and_values_holding_garbage_do_not_leak(fn, causal, square, garbage):
    """Issue 14: a NaN in a padded key or value leaked into every output row of softmax,
    banded, fmm, kernelized and nystrom attention (0 * NaN = NaN), and nystrom leaked it
    through the landmark means. Padded rows are now replaced, not multiplied by 0."""
    q, k, v = _qkv((2, 2), 9, 9)
    mask = torch.zeros(2, 1, 9, dtype=torch.bool)
    mask[0, 0, [1, 5, 8]] = True
    mask[1, 0, 6:] = True
    clean = fn(q, k, v, causal=causal, key_padding_mask=mask)
    k_bad, v_bad = k.clone(), v.clone()
    padded = mask.expand(2, 2, 9)
    k_bad[padded] = garbage
    v_bad[padded] = garbage
    dirty = fn(q, k_bad, v_bad, causal=causal, key_padding_mask=mask)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=1e-12, atol=1e-12)


# --- 3. FAVOR+ at large norms: no zero rows, independent of block and chunk sizes --------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("norm", [10.0, 30.0])
def test_favor_large_norms_in_float32_match_float64(causal, kind, norm):
    """The cases of issue 14: inputs x10 (causal) and x30 (bidirectional) in float32 gave
    5 and 8 all-zero rows of 64, and the causal output moved by up to 1.88 with
    block_size. Now every row matches the float64 result for every block and chunk size.

    Tolerance: exponents here reach |w^T k~| + |k~|^2 / 2 ~ 10^3 at x30 (d = 16), each
    rounded in float32 to ~10^3 * 2^-24 ~ 6e-5 relative; outputs are convex combinations
    of values of size ~3, so 3 * 6e-5 * (a few terms) < 2e-3."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 16, generator=g) for _ in range(3))
    q, k = q * norm, k * norm
    w = ea.gaussian_random_matrix(64, 16, orthogonal=True, generator=g)
    reference = ea.favor_attention(q.double(), k.double(), v.double(), w.double(),
                                   causal=causal, features=kind, block_size=1, chunk_size=1)
    for block_size, chunk_size in [(None, None), (1, 1), (7, 3), (64, 64), (16, 5)]:
        out = ea.favor_attention(q, k, v, w, causal=causal, features=kind,
                                 block_size=block_size, chunk_size=chunk_size)
        assert (out.abs().sum(-1) > 0).all()  # no zero row: every query has keys
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-3)


def test_favor_stabiliser_never_uses_future_keys():
    """A huge key at the end of the sequence must not flush the earlier causal rows to 0:
    a key constant that included it (one constant per block) did exactly that."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 32, 8, generator=g) for _ in range(3))
    k[0, -1] = 40.0
    w = ea.gaussian_random_matrix(32, 8, generator=g)
    out = ea.favor_attention(q, k, v, w, causal=True, block_size=32, chunk_size=32)
    reference = ea.favor_attention(q.double(), k.double(), v.double(), w.double(), causal=True)
    assert (out[0, :-1].abs().sum(-1) > 0).all()
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-4)
