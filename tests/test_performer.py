"""Tests for efficient_attention.performer: FAVOR+ attention and the FavorAttention module."""

import pytest
import torch

import efficient_attention as ea

KINDS = {
    "positive": ea.positive_softmax_features,
    "trig": ea.trig_softmax_features,
    "hyperbolic": ea.hyperbolic_softmax_features,
}


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 29, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 29, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 29, 5, generator=g, dtype=torch.float64)
    return q, k, v


def frequencies(m, d, seed=1, orthogonal=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return ea.gaussian_random_matrix(m, d, orthogonal=orthogonal, generator=g, dtype=dtype)


def unstabilised(q, k, v, w, kind, causal=False, mask=None):
    """The textbook estimator: public (unbiased, unstabilised) features of d^-1/4 q and
    d^-1/4 k, plugged into linear attention with eps = 0."""
    s = q.shape[-1] ** -0.25
    return ea.linear_attention(q * s, k * s, v, lambda x: KINDS[kind](x, w), causal=causal,
                               key_padding_mask=mask, eps=0.0)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
def test_output_is_invariant_to_the_stabiliser(qkv, kind, causal):
    """The internal max subtractions cancel: same output as the unstabilised formula."""
    q, k, v = qkv
    w = frequencies(16, 8)
    mask = torch.zeros(2, 1, 29, dtype=torch.bool)
    mask[0, 0, 20:] = True
    mask[1, 0, ::5] = True
    got = ea.favor_attention(q, k, v, w, causal=causal, features=kind, key_padding_mask=mask)
    expected = unstabilised(q, k, v, w, kind, causal, mask)
    # Trig normalisers are sums of signed terms (cancellation): looser relative tolerance.
    rtol = 1e-9 if kind == "trig" else 1e-12
    torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-9)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
def test_block_size_does_not_change_the_result(kind, causal):
    """Key blocks of very different sizes raise the running maximum mid-sequence; the
    rescaled state must give the same output as a single block."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 40, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 40, 8, generator=g, dtype=torch.float64)
    # Later keys have far larger log-features. (Trig features of such keys have
    # normalisers that nearly cancel, which makes any two summation orders disagree:
    # a milder step keeps that test about the rescaling.)
    k[:, 25:] *= 1.5 if kind == "trig" else 4.0
    v = torch.randn(2, 40, 3, generator=g, dtype=torch.float64)
    w = frequencies(16, 8)
    whole = ea.favor_attention(q, k, v, w, causal=causal, features=kind, block_size=40)
    for block_size, chunk_size in [(7, 3), (16, 16), (1, 1)]:
        blocked = ea.favor_attention(q, k, v, w, causal=causal, features=kind,
                                     block_size=block_size, chunk_size=chunk_size)
        rtol = 1e-8 if kind == "trig" else 1e-12
        torch.testing.assert_close(blocked, whole, rtol=rtol, atol=1e-9)


def test_large_inputs_stay_accurate_in_float32():
    """|k~|^2 / 2 ~ 70: unstabilised positive features exp(w.k~ - |k~|^2/2) underflow in
    float32 (below ~1e-38 = e^-87 for many keys), so the textbook formula loses whole
    rows; the stabilised one matches the float64 result."""
    g = torch.Generator().manual_seed(3)
    q = 6.0 * torch.randn(1, 50, 16, generator=g)
    k = 6.0 * torch.randn(1, 50, 16, generator=g)
    v = torch.randn(1, 50, 4, generator=g)
    w = frequencies(64, 16, dtype=torch.float32)
    naive = unstabilised(q, k, v, w, "positive")
    float64 = ea.favor_attention(q.double(), k.double(), v.double(), w.double())
    assert (naive.double() - float64).abs().max() > 0.1  # the textbook formula fails ...
    for causal in (False, True):
        out = ea.favor_attention(q, k, v, w, causal=causal)
        reference = ea.favor_attention(q.double(), k.double(), v.double(), w.double(),
                                       causal=causal)
        assert torch.isfinite(out).all()  # ... the stabilised one does not
        # float32 rounding of exponents of size ~100: relative error ~100 * 2^-24 per term.
        torch.testing.assert_close(out.double(), reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_approaches_softmax_attention_as_m_grows(kind):
    """Each weight exp(q~.k~) is estimated with relative error about
    sqrt(exp(|q~|^2 + |k~|^2) / m) <= sqrt(e^1.2 / 16384) ~ 0.014 here (|q~|^2 ~ 0.6);
    the normalised output is off by a few times that, and 0.1 leaves room for the
    maximum over 400 outputs."""
    g = torch.Generator().manual_seed(4)
    q, k = (0.5 * torch.randn(1, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 40, 10, generator=g, dtype=torch.float64)
    for causal in (False, True):
        exact = ea.softmax_attention(q, k, v, causal=causal)
        errors = [
            (ea.favor_attention(q, k, v, frequencies(m, 8), causal=causal, features=kind)
             - exact).abs().max().item()
            for m in (16, 16384)
        ]
        assert errors[1] < 0.1 and errors[1] < errors[0]


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_take_no_part(qkv, causal):
    """Masked output == output on the unpadded sequence, even when the padding holds a key
    so large that, left in the stabilising maximum, it would flush every feature to 0."""
    q, k, v = qkv
    w = frequencies(32, 8)
    n = 21
    mask = torch.zeros(2, 3, 29, dtype=torch.bool)
    mask[..., n:] = True
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[..., n:, :] = 1e4
    v_pad[..., n:, :] = float("nan")
    for kind in KINDS:
        got = ea.favor_attention(q, k_pad, v_pad, w, causal=causal, key_padding_mask=mask,
                                 features=kind, block_size=8)
        if causal:
            expected = ea.favor_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], w,
                                          causal=True, features=kind)
            got = got[..., :n, :]
        else:
            expected = ea.favor_attention(q, k[..., :n, :], v[..., :n, :], w, features=kind)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_all_keys_padded_gives_zeros_not_nan(qkv):
    q, k, v = qkv
    mask = torch.ones(29, dtype=torch.bool)
    for causal in (False, True):
        out = ea.favor_attention(q, k, v, frequencies(16, 8), causal=causal,
                                 key_padding_mask=mask)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(kind, causal):
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    v = torch.randn(2, 9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = frequencies(6, 4)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 6:] = True
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.favor_attention(q, k, v, w, causal=causal, features=kind,
                                           key_padding_mask=mask, block_size=4, chunk_size=2),
        (q, k, v),
    )


def test_inference_path_matches_autograd_path_and_w_gets_gradients(qkv):
    """Under no_grad the blocks are written into one output buffer; with autograd they
    are concatenated. Same numbers either way; a w that requires grad gets one."""
    q, k, v = qkv
    w = frequencies(16, 8).requires_grad_()
    for causal in (False, True):
        with torch.no_grad():
            fast = ea.favor_attention(q, k, v, w, causal=causal, block_size=8)
            fast_linear = ea.linear_attention(q, k, v, causal=causal, block_size=8)
        tracked = ea.favor_attention(q, k, v, w, causal=causal, block_size=8)
        torch.testing.assert_close(fast, tracked.detach())
        torch.testing.assert_close(
            fast_linear, ea.linear_attention(q, k, v, causal=causal, block_size=8)
        )
        tracked.sum().backward()
        assert w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("only", ["q", "k", "v", "w"])
def test_a_gradient_for_one_input_alone_matches(qkv, causal, only):
    """Without autograd the blocks reuse buffers; when any one input (or w) requires a
    gradient none may be reused (autograd keeps them). Its gradient alone equals its
    gradient when all four require one, over several blocks of several batch rows."""
    inputs = dict(zip("qkv", qkv, strict=True), w=frequencies(16, 8))
    grad_out = torch.randn(2, 3, 29, 5, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64)

    def gradients(names):
        leaves = {name: t.detach().clone().requires_grad_(name in names)
                  for name, t in inputs.items()}
        out = ea.favor_attention(leaves["q"], leaves["k"], leaves["v"], leaves["w"],
                                 causal=causal, block_size=8, chunk_size=4)
        (out * grad_out).sum().backward()
        return {name: leaves[name].grad for name in names}

    torch.testing.assert_close(gradients({only})[only], gradients(set(inputs))[only])


def test_causal_backward_memory_is_linear_in_n():
    """Autograd keeps O(n (m + d)) numbers, far below n * m * d_v (16x above the bound)."""
    d, m = 32, 64
    sizes = {}
    for n in (512, 1024):
        g = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(1, n, d, generator=g, requires_grad=True) for _ in range(3))
        w = frequencies(m, d, dtype=torch.float32)
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ea.favor_attention(q, k, v, w, causal=True).sum()
        sizes[n] = sum(saved)
        assert sizes[n] <= 12 * n * (m + d + 1) < n * m * d
    assert sizes[1024] <= 2.1 * sizes[512]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_is_finite_and_close(dtype, causal):
    """Computed in float32 inside: errors come from rounding the inputs (2^-11 or 2^-8
    relative), which moves exponents of size ~3 by ~3 * 2^-8 at most, and the output;
    outputs are averages of v, so 4 * 2^-8 absolute is a safe bound."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 300, 16, generator=g) for _ in range(3))
    w = frequencies(64, 16, dtype=torch.float32)
    reference = ea.favor_attention(q, k, v, w, causal=causal)
    out = ea.favor_attention(q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype), causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=4 * 2**-8)


# ------------------------------------------------------------------- FavorAttention


def test_module_redraws_every_interval_in_training_only():
    module = ea.FavorAttention(8, 16, redraw_interval=3, seed=0)
    q = torch.randn(1, 5, 8)
    seen = []
    for _ in range(7):
        module(q, q, q)
        seen.append(module.w.clone())
    # calls 0-2 use the first draw, 3-5 the second, 6 the third
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[3], seen[5])
    assert not torch.equal(seen[2], seen[3]) and not torch.equal(seen[5], seen[6])
    module.eval()
    frozen = module.w.clone()
    outputs = [module(q, q, q) for _ in range(10)]
    assert torch.equal(module.w, frozen)
    assert all(torch.equal(outputs[0], out) for out in outputs)


def test_module_never_redraws_without_interval_and_is_seeded():
    a = ea.FavorAttention(8, 16, redraw_interval=None, seed=1)
    b = ea.FavorAttention(8, 16, redraw_interval=None, seed=1)
    assert torch.equal(a.w, b.w)
    q = torch.randn(1, 5, 8)
    first = a.w.clone()
    for _ in range(5):
        a(q, q, q)
    assert torch.equal(a.w, first)
    assert "w" in a.state_dict()
    # Orthogonal by default: the first d rows are mutually orthogonal.
    directions = a.w[:8] / a.w[:8].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(directions @ directions.T, torch.eye(8), atol=1e-5, rtol=0)
    g = torch.Generator().manual_seed(1)
    c = ea.FavorAttention(8, 16, generator=g)
    assert c.w.shape == (16, 8)


def test_module_matches_the_function_and_plugs_into_multihead_attention():
    module = ea.FavorAttention(4, 32, seed=2).eval()
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 6, dtype=torch.bool)
    mask[1, 0, 4:] = True
    torch.testing.assert_close(
        module(q, k, v, causal=True, key_padding_mask=mask),
        ea.favor_attention(q, k, v, module.w, causal=True, key_padding_mask=mask),
    )
    mha = ea.MultiHeadAttention(8, 2, attention=module)
    x = torch.randn(2, 6, 8, generator=g)
    out = mha(x, causal=True, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    assert out.shape == (2, 6, 8) and torch.isfinite(out).all()
    assert any(name.endswith("w") for name, _ in mha.named_buffers())


def test_bad_inputs_name_the_argument(qkv):
    q, k, v = qkv
    w = frequencies(16, 8)
    with pytest.raises(ValueError, match="w must have shape"):
        ea.favor_attention(q, k, v, frequencies(16, 7))
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        ea.favor_attention(q, k, v, None)
    with pytest.raises(ValueError, match="features must be one of"):
        ea.favor_attention(q, k, v, w, features="relu")
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        ea.favor_attention(q[..., :4, :], k, v, w, causal=True)
    with pytest.raises(ValueError, match="block_size"):
        ea.favor_attention(q, k, v, w, block_size=0)
    with pytest.raises(ValueError, match="num_features"):
        ea.FavorAttention(8, 0)
    with pytest.raises(ValueError, match="redraw_interval"):
        ea.FavorAttention(8, 4, redraw_interval=-1)
    with pytest.raises(ValueError, match="at most one of generator and seed"):
        ea.FavorAttention(8, 4, generator=torch.Generator(), seed=0)
    with pytest.raises(ValueError, match="dim_head=8"):
        ea.FavorAttention(8, 4)(q[..., :4], k[..., :4], v)


@pytest.mark.cuda
def test_favor_on_cuda_matches_cpu(qkv):
    q, k, v = (t.float() for t in qkv)
    w = frequencies(64, 8, dtype=torch.float32)
    for causal in (False, True):
        out = ea.favor_attention(q.cuda(), k.cuda(), v.cuda(), w.cuda(), causal=causal)
        assert out.is_cuda
        expected = ea.favor_attention(q, k, v, w, causal=causal)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    module = ea.FavorAttention(8, 16, seed=0).cuda()
    assert module(q.cuda(), k.cuda(), v.cuda()).is_cuda
    module.redraw_features()
    assert module.w.is_cuda



@pytest.mark.parametrize("kind", list(KINDS))
def test_bidirectional_output_does_not_depend_on_the_order_of_the_keys(kind):
    """Bidirectional attention sums over keys: any permutation of the (key, value) rows
    gives the same output. The stabilising constants start from the first key and grow
    only when a later block would overflow, so putting a key with very small or very
    large log-features first sends every block down a different path (kept constant,
    exact re-maximisation); the result must not change beyond rounding."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 30, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 50, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 50, 3, generator=g, dtype=torch.float64)
    k[:, 10] *= 0.0  # log-features -|k~|^2/2 = 0: a middling first key
    k[:, 20] *= 8.0 if kind != "trig" else 2.0  # |k~|^2 / 2 ~ 60: far above and below
    w = frequencies(16, 8)
    reference = ea.favor_attention(q, k, v, w, features=kind)
    rtol = 1e-8 if kind == "trig" else 1e-11
    for first in (10, 20, 0):
        order = torch.cat([torch.tensor([first]), torch.arange(50)[torch.arange(50) != first]])
        order = order.flip(0) if first == 0 else order
        for block_size in (1, 7, 64):
            out = ea.favor_attention(q, k[:, order], v[:, order], w, features=kind,
                                     block_size=block_size)
            torch.testing.assert_close(out, reference, rtol=rtol, atol=1e-10)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_left_padding_and_growing_norms_match_float64_for_every_block_size(kind, causal):
    """Batch rows whose first keys are padded have no constant that all their queries
    see until their first real key; keys whose norms grow along the sequence overflow a
    kept constant (causal blocks are then redone with a raised constant, and split
    where a later key still outgrows it). Every block and chunk size must give the
    textbook (unstabilised) estimator computed in float64, where nothing under- or
    overflows here, and no query with a real key may get a zero row."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(3, 70, 8, generator=g) for _ in range(3))
    k = k * torch.linspace(0.5, 6.0, 70).unsqueeze(-1)  # |k~|^2 / 2 from ~0.4 to ~50
    # Row 2's real keys: every log-feature far below 0 (exp underflows in float32), so a
    # constant not taken from a key its queries see would leave them all-zero rows.
    k[2, 40:] = 15.0 * torch.randn(30, 8, generator=g)  # log-features ~ -300
    mask = torch.zeros(3, 70, dtype=torch.bool)
    mask[1, :13] = True  # left padding, across the first blocks
    mask[2, :40] = True
    w = frequencies(16, 8, dtype=torch.float32)
    reference = unstabilised(q.double(), k.double(), v.double(), w.double(), kind, causal,
                             mask)
    for block_size, chunk_size in [(None, None), (1, 1), (8, 4), (16, 16), (70, 8)]:
        out = ea.favor_attention(q, k, v, w, causal=causal, features=kind,
                                 key_padding_mask=mask, block_size=block_size,
                                 chunk_size=chunk_size)
        # log-features down to ~-400 (row 2), rounded in float32 to ~400 * 2^-24 ~ 2.4e-5
        # each; outputs are weighted averages of values of size ~3
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-4)
        sees_a_key = ~mask.cumsum(-1).eq(torch.arange(1, 71)) if causal else (
            torch.ones(3, 70, dtype=torch.bool))
        assert (out.abs().sum(-1)[sees_a_key] > 0).all()
