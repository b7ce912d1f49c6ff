"""Tests for efficient_attention.linearized: exactness, causality, masks, memory."""

import pytest
import torch

import efficient_attention as ea
from efficient_attention._blockwise import default_chunk_size


def elu_kernel(a, b):
    """K(q, k) = phi(q)^T phi(k) with phi = elu + 1, as a (..., n_q, n_k) matrix."""
    return ea.elu_feature_map(a) @ ea.elu_feature_map(b).transpose(-2, -1)


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 37, 5, generator=g, dtype=torch.float64)
    return q, k, v


def test_elu_feature_map_is_positive_elu_plus_one():
    x = torch.linspace(-20, 5, 101, dtype=torch.float64)
    phi = ea.elu_feature_map(x)
    assert (phi > 0).all()
    torch.testing.assert_close(phi, torch.nn.functional.elu(x) + 1)


@pytest.mark.parametrize("causal", [False, True])
def test_kernelized_attention_with_softmax_kernel_is_softmax_attention(qkv, causal):
    q, k, v = qkv
    mask = torch.zeros(2, 1, 37, dtype=torch.bool)
    mask[1, 0, 30:] = True
    got = ea.kernelized_attention(q, k, v, ea.softmax_kernel, causal=causal,
                                  key_padding_mask=mask)
    expected = ea.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size, chunk_size", [(None, None), (8, 3), (16, 16), (5, 64)])
def test_linear_attention_equals_the_quadratic_form(qkv, causal, block_size, chunk_size):
    """Regrouping the sums is exact: same result as the masked n x n form (eps = 0)."""
    q, k, v = qkv
    got = ea.linear_attention(q, k, v, causal=causal, eps=0.0, block_size=block_size,
                              chunk_size=chunk_size)
    expected = ea.kernelized_attention(q, k, v, elu_kernel, causal=causal)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_eps_is_added_to_the_denominator(qkv):
    q, k, v = qkv
    phi_q, phi_k = ea.elu_feature_map(q), ea.elu_feature_map(k)
    expected = (phi_q @ (phi_k.transpose(-2, -1) @ v)) / (
        phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1) + 0.5
    )
    torch.testing.assert_close(ea.linear_attention(q, k, v, eps=0.5), expected)


def test_custom_feature_map_and_cross_attention():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 3, generator=g, dtype=torch.float64)
    k = torch.randn(4, 9, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 9, 2, generator=g, dtype=torch.float64)  # broadcast over the batch

    def squares(x):
        return torch.cat([x**2, torch.ones_like(x[..., :1])], dim=-1)

    got = ea.linear_attention(q, k, v, squares, eps=0.0)
    expected = ea.kernelized_attention(
        q, k, v, lambda a, b: squares(a) @ squares(b).transpose(-2, -1)
    )
    assert got.shape == (4, 6, 2)
    torch.testing.assert_close(got, expected)


def test_future_keys_do_not_change_past_outputs(qkv):
    q, k, v = qkv
    out = ea.linear_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., 20:, :] += 3.0
    v2[..., 20:, :] -= 7.0
    out2 = ea.linear_attention(q, k2, v2, causal=True)
    torch.testing.assert_close(out[..., :20, :], out2[..., :20, :])
    assert not torch.allclose(out[..., 20:, :], out2[..., 20:, :])


def test_recurrent_view_equals_parallel_causal_form(qkv):
    q, k, v = qkv
    rnn = ea.RecurrentLinearAttention()
    steps = torch.stack(
        [rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])], dim=-2
    )
    parallel = ea.linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(steps, parallel)
    assert rnn.state.shape == (2, 3, 8, 5) and rnn.normalizer.shape == (2, 3, 8)
    rnn.reset()
    torch.testing.assert_close(rnn(q, k, v), parallel)  # forward runs the steps
    # Without a reset the state carries on: the second pass differs.
    assert not torch.allclose(rnn(q, k, v), parallel)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_take_no_part(qkv, causal):
    """Output with trailing padding == output on the unpadded sequence, NaN padding included."""
    q, k, v = qkv
    n = 29
    mask = torch.zeros(2, 3, 37, dtype=torch.bool)
    mask[..., n:] = True
    k_pad, v_pad = k.clone(), v.clone()
    k_pad[..., n:, :] = float("nan")
    v_pad[..., n:, :] = float("nan")
    got = ea.linear_attention(q, k_pad, v_pad, causal=causal, key_padding_mask=mask,
                              block_size=8, chunk_size=4)
    if causal:
        expected = ea.linear_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], causal=True)
        torch.testing.assert_close(got[..., :n, :], expected)
        assert torch.isfinite(got).all()
    else:
        expected = ea.linear_attention(q, k[..., :n, :], v[..., :n, :])
        torch.testing.assert_close(got, expected)


def test_padding_is_left_out_of_the_normaliser(qkv):
    """Zeroing only v_j would keep phi(k_j) in D: check against the explicit formula."""
    q, k, v = qkv
    mask = torch.zeros(37, dtype=torch.bool)
    mask[::4] = True
    keep = ~mask
    phi_q, phi_k = ea.elu_feature_map(q), ea.elu_feature_map(k[..., keep, :])
    expected = (phi_q @ (phi_k.transpose(-2, -1) @ v[..., keep, :])) / (
        phi_q @ phi_k.sum(-2).unsqueeze(-1)
    )
    got = ea.linear_attention(q, k, v, key_padding_mask=mask, eps=0.0)
    torch.testing.assert_close(got, expected)


def test_all_keys_padded_gives_zeros_not_nan(qkv):
    q, k, v = qkv
    mask = torch.ones(37, dtype=torch.bool)
    for causal in (False, True):
        out = ea.linear_attention(q, k, v, causal=causal, key_padding_mask=mask, eps=0.0)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    v = torch.randn(2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 7:] = True
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.linear_attention(q, k, v, causal=causal, key_padding_mask=mask,
                                            block_size=4, chunk_size=3),
        (q, k, v),
    )


def saved_numel(fn, *args):
    """Total number of elements autograd keeps for the backward pass of ``fn(*args)``."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(sizes)


def test_causal_backward_memory_is_linear_in_n():
    """Saved tensors stay O(n (m + d)): doubling n doubles them, and they are far below the
    n * m * d_v that per-position states would need (here 16x above the bound)."""
    d, d_v = 32, 32
    sizes = {}
    for n in (512, 1024):
        g = torch.Generator().manual_seed(3)
        q, k = (torch.randn(1, n, d, generator=g, requires_grad=True) for _ in range(2))
        v = torch.randn(1, n, d_v, generator=g, requires_grad=True)
        sizes[n] = saved_numel(
            lambda q, k, v: ea.linear_attention(q, k, v, causal=True).sum(), q, k, v
        )
        m = d  # elu + 1 keeps the width
        assert sizes[n] <= 12 * n * (m + d_v + 1) < n * m * d_v
    assert sizes[1024] <= 2.1 * sizes[512]


def test_default_chunk_size_bounds_the_states():
    for m, d_v in [(256, 65), (32, 33), (1024, 129), (16, 16)]:
        c = default_chunk_size(m, d_v)
        assert c >= 16 and c & (c - 1) == 0
        assert m * d_v / c <= m + d_v  # per-chunk states: at most n (m + d_v) in total


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_is_finite_and_close(dtype, causal):
    """Half inputs are computed in float32: the error is the rounding of the inputs and of
    the output, about 2^-11 (fp16) or 2^-8 (bf16) relative on values of size ~1 (3 sigma
    of a unit Gaussian); outputs are averages of v, so a few units of 2^-8 suffice."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 300, 16, generator=g) for _ in range(3))
    reference = ea.linear_attention(q, k, v, causal=causal)
    out = ea.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=4 * 2**-8)


def test_bad_inputs_name_the_argument(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        ea.linear_attention(q[..., :5, :], k, v, causal=True)
    with pytest.raises(ValueError, match="k and v"):
        ea.linear_attention(q, k, v[..., :5, :])
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        ea.linear_attention(q, k, v, key_padding_mask=torch.zeros(37))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ea.linear_attention(q, k, v, key_padding_mask=torch.zeros(36, dtype=torch.bool))
    with pytest.raises(ValueError, match="eps"):
        ea.linear_attention(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="feature_map must be callable"):
        ea.linear_attention(q, k, v, feature_map="elu")
    with pytest.raises(ValueError, match="chunk_size"):
        ea.linear_attention(q, k, v, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match="feature_map must map"):
        ea.linear_attention(q, k, v, feature_map=lambda x: x.sum(-2))
    with pytest.raises(ValueError, match="kernel"):
        ea.kernelized_attention(q, k, v, lambda a, b: a)
    with pytest.raises(TypeError, match="kernel must be callable"):
        ea.kernelized_attention(q, k, v, None)
    rnn = ea.RecurrentLinearAttention()
    with pytest.raises(ValueError, match="q_t and k_t"):
        rnn.step(q[..., 0, :], k[..., 0, :3], v[..., 0, :])
    with pytest.raises(TypeError, match="causal must be a bool"):
        ea.linear_attention(q, k, v, causal=None)


@pytest.mark.cuda
def test_linear_attention_on_cuda_matches_cpu(qkv):
    q, k, v = qkv
    cuda = [t.float().cuda() for t in (q, k, v)]
    for causal in (False, True):
        out = ea.linear_attention(*cuda, causal=causal)
        assert out.is_cuda
        torch.testing.assert_close(
            out.cpu(), ea.linear_attention(q, k, v, causal=causal).float(), rtol=1e-4, atol=1e-5
        )
