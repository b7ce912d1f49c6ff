"""Tests for efficient_attention.attention: the exact reference every method is checked against."""

import math

import pytest
import torch

import efficient_attention as ea


def direct_attention(q, k, v, scale=None, mask=None):
    """The textbook formula, one query at a time, in float64: sum_j softmax_j(s q_i.k_j) v_j."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[-2]):
        scores = (k.double() @ q[..., i, :].double().unsqueeze(-1)).squeeze(-1) * scale
        if mask is not None:
            scores = scores.masked_fill(mask[..., i, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[..., i, :] = (weights.unsqueeze(-1) * v.double()).sum(-2)
    return out


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 4, generator=g)
    return q, k, v


def test_matches_direct_formula(qkv):
    q, k, v = qkv
    torch.testing.assert_close(
        ea.softmax_attention(q, k, v).double(), direct_attention(q, k, v), atol=1e-5, rtol=1e-5
    )


def test_custom_scale_matches_direct_formula(qkv):
    q, k, v = qkv
    torch.testing.assert_close(
        ea.softmax_attention(q, k, v, scale=0.3).double(),
        direct_attention(q, k, v, scale=0.3),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(ea.softmax_attention(q, k, v, causal=causal), expected)


def test_causal_equals_direct_with_mask():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 6, 5, generator=g) for _ in range(3))
    expected = direct_attention(q, k, v, mask=ea.causal_mask(6))
    torch.testing.assert_close(ea.softmax_attention(q, k, v, causal=True).double(), expected)


def test_causal_output_does_not_see_the_future():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(10, 4, generator=g) for _ in range(3))
    out = ea.softmax_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[7:] += 5.0
    v2[7:] -= 3.0
    out2 = ea.softmax_attention(q, k2, v2, causal=True)
    torch.testing.assert_close(out[:7], out2[:7])
    assert not torch.allclose(out[7:], out2[7:])


def test_causal_mask_values():
    mask = ea.causal_mask(4)
    assert mask.dtype == torch.bool and mask.shape == (4, 4)
    assert torch.equal(mask, torch.tensor([[j > i for j in range(4)] for i in range(4)]))


def test_key_padding_equals_unpadded_sequence():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 4, generator=g)
    mask = torch.zeros(2, 1, 7, dtype=torch.bool)  # (batch, 1, n_k): the same for every head
    mask[0, :, 5:] = True  # sequence 0 has 5 real keys
    mask[1, :, 6:] = True  # sequence 1 has 6
    out, weights = ea.softmax_attention(q, k, v, key_padding_mask=mask, return_weights=True)
    for b, n_real in [(0, 5), (1, 6)]:
        expected = ea.softmax_attention(q[b], k[b, :, :n_real], v[b, :, :n_real])
        torch.testing.assert_close(out[b], expected)
        assert torch.all(weights[b, ..., n_real:] == 0)


def test_padding_changes_nothing_when_values_of_padded_keys_change():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, 4, generator=g) for _ in range(3))
    mask = torch.tensor([False, False, True, False, True, False])
    out = ea.softmax_attention(q, k, v, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[mask] = 100.0
    v2[mask] = -100.0
    torch.testing.assert_close(out, ea.softmax_attention(q, k2, v2, key_padding_mask=mask))


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 2)
    out = ea.softmax_attention(q, k, v, key_padding_mask=torch.ones(3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(3, 2))


def test_weights_are_stochastic_rows(qkv):
    q, k, v = qkv
    out, weights = ea.softmax_attention(q, k, v, return_weights=True)
    assert weights.shape == (2, 3, 5, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))
    torch.testing.assert_close(out, weights @ v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtype_and_shape_kept(dtype):
    q, k, v = (
        torch.randn(4, 5, 6, dtype=dtype),
        torch.randn(4, 3, 6, dtype=dtype),
        torch.randn(4, 3, 2, dtype=dtype),
    )
    out = ea.softmax_attention(q, k, v)
    assert out.dtype == dtype and out.shape == (4, 5, 2) and out.device == q.device


def test_gradients_match_sdpa():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 5, 4, generator=g, requires_grad=True) for _ in range(3))
    ea.softmax_attention(q, k, v, causal=True).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True
    ).square().sum().backward()
    for ours, theirs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(3, 2, dtype=torch.float64, generator=g, requires_grad=True) for _ in "qkv"
    )
    assert torch.autograd.gradcheck(lambda a, b, c: ea.softmax_attention(a, b, c), (q, k, v))


# --- argmax attention -----------------------------------------------------------------------


def test_argmax_attention_worked_example():
    # The homework's example: scores [3, 11, 5, 2] select the second value.
    q = torch.tensor([[1.0, 1.0, 2.0]])
    k = torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 4.0], [5.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    v = torch.tensor([[2.0, 0.0, 1.0], [1.0, 4.0, 3.0], [0.0, -1.0, 4.0], [1.0, 0.0, -1.0]])
    assert torch.equal((q @ k.T).squeeze(0), torch.tensor([3.0, 11.0, 5.0, 2.0]))
    assert torch.equal(ea.argmax_attention(q, k, v), torch.tensor([[1.0, 4.0, 3.0]]))


def test_argmax_is_the_zero_temperature_limit_of_softmax():
    g = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(2, 6, 4, generator=g),
        torch.randn(2, 9, 4, generator=g),
        torch.randn(2, 9, 3, generator=g),
    )
    hard = ea.argmax_attention(q, k, v)
    soft = ea.softmax_attention(q, k, v, scale=1e4)
    torch.testing.assert_close(soft, hard, atol=1e-4, rtol=0)


def test_argmax_gradients_vanish_for_queries_and_keys():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(5, 4, generator=g, requires_grad=True) for _ in range(3))
    ea.argmax_attention(q, k, v).sum().backward()
    assert q.grad is None or torch.all(q.grad == 0)
    assert k.grad is None or torch.all(k.grad == 0)
    assert v.grad is not None and v.grad.abs().sum() > 0


# --- MultiHeadAttention ---------------------------------------------------------------------


def test_multi_head_equals_manual_computation():
    torch.manual_seed(10)
    mha = ea.MultiHeadAttention(d_model=12, num_heads=3)
    x = torch.randn(2, 5, 12)
    q = mha.q_proj(x).view(2, 5, 3, 4).transpose(1, 2)
    k = mha.k_proj(x).view(2, 5, 3, 4).transpose(1, 2)
    v = mha.v_proj(x).view(2, 5, 3, 4).transpose(1, 2)
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    expected = mha.out_proj(heads.transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(mha(x), expected)


def test_multi_head_matches_torch_module():
    torch.manual_seed(11)
    ours = ea.MultiHeadAttention(d_model=8, num_heads=2)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(
            torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
        )
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(3, 6, 8)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    expected, _ = theirs(x, x, x, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(ours(x, key_padding_mask=pad), expected, atol=1e-5, rtol=1e-5)
    expected_causal, _ = theirs(
        x, x, x, attn_mask=ea.causal_mask(6), is_causal=True, need_weights=False
    )
    torch.testing.assert_close(ours(x, causal=True), expected_causal, atol=1e-5, rtol=1e-5)


def test_multi_head_pluggable_attention_is_called():
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, kwargs))
        return ea.softmax_attention(q, k, v, **kwargs)

    mha = ea.MultiHeadAttention(16, 4, attention=spy)
    out = mha(torch.randn(2, 3, 16), causal=True)
    assert out.shape == (2, 3, 16)
    assert calls == [(torch.Size([2, 4, 3, 4]), {"causal": True})]


def test_multi_head_cross_attention_shapes():
    mha = ea.MultiHeadAttention(8, 2)
    out = mha(torch.randn(2, 3, 8), context=torch.randn(2, 7, 8))
    assert out.shape == (2, 3, 8)


def test_multi_head_backward_reaches_every_parameter():
    mha = ea.MultiHeadAttention(8, 2)
    mha(torch.randn(2, 4, 8)).sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, error, words",
    [
        (([[1.0]], torch.randn(2, 2), torch.randn(2, 2)), TypeError, ["q", "torch.Tensor", "list"]),
        (
            (torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 2)),
            ValueError,
            ["q", "k", "(3, 5)"],
        ),
        ((torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 2)), ValueError, ["k", "v", "n_k"]),
        ((torch.randn(4), torch.randn(3, 4), torch.randn(3, 2)), ValueError, ["q", "(4,)", "2"]),
        (
            (torch.randn(3, 4), torch.randn(3, 4).double(), torch.randn(3, 2)),
            TypeError,
            ["dtype", "float64"],
        ),
    ],
)
def test_bad_input_messages(args, error, words):
    with pytest.raises(error) as info:
        ea.softmax_attention(*args)
    for word in words:
        assert word in str(info.value)
    with pytest.raises(error):
        ea.argmax_attention(*args)


def test_bad_mask_messages():
    q = k = torch.randn(2, 5, 4)
    v = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 5\).*\(2, 4\)"):
        ea.softmax_attention(q, k, v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask.*torch.bool.*float32"):
        ea.softmax_attention(q, k, v, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="causal.*n_q=2.*n_k=5"):
        ea.softmax_attention(torch.randn(2, 2, 4), k, v, causal=True)


def test_multi_head_bad_configuration():
    with pytest.raises(ValueError, match="num_heads must divide d_model.*d_model=10.*num_heads=3"):
        ea.MultiHeadAttention(10, 3)
    with pytest.raises(TypeError, match="attention must be callable"):
        ea.MultiHeadAttention(8, 2, attention="softmax")
    with pytest.raises(ValueError, match=r"x must have last dimension d_model=8.*\(2, 3, 6\)"):
        ea.MultiHeadAttention(8, 2)(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 3\).*\(2, 4\)"):
        ea.MultiHeadAttention(8, 2)(
            torch.randn(2, 3, 8), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)
        )


def test_default_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ea.default_device().type == expected


@pytest.mark.cuda
def test_runs_on_cuda_and_matches_cpu():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    cpu = ea.softmax_attention(q, k, v, causal=True)
    gpu = ea.softmax_attention(q.cuda(), k.cuda(), v.cuda(), causal=True)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-4)
    mha = ea.MultiHeadAttention(8, 2).cuda()
    assert mha(torch.randn(2, 5, 8, device="cuda")).device.type == "cuda"


# --- shared key-value heads (num_kv_heads: MQA, GQA) -----------------------------------------


def _tied_multi_head(gqa: ea.MultiHeadAttention) -> ea.MultiHeadAttention:
    """The multi-head module with the same weights, each key-value head copied to its group."""
    group = gqa.num_heads // gqa.num_kv_heads
    mha = ea.MultiHeadAttention(gqa.d_model, gqa.num_heads, attention=gqa.attention).double()
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            source, target = getattr(gqa, name), getattr(mha, name)
            rows = torch.arange(gqa.num_heads * gqa.d_head).view(gqa.num_heads, gqa.d_head)
            rows = (rows // (group * gqa.d_head) * gqa.d_head + rows % gqa.d_head).reshape(-1)
            target.weight.copy_(source.weight[rows])  # query head i reads kv head i // group
            target.bias.copy_(source.bias[rows])
    return mha


def _banded(q, k, v, *, causal=False, key_padding_mask=None):
    return ea.banded_attention(q, k, v, 2, causal=causal, key_padding_mask=key_padding_mask)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("attention", [ea.softmax_attention, ea.tiled_attention,
                                       ea.linear_attention, _banded])
def test_grouped_query_equals_multi_head_with_tied_kv_heads(num_kv_heads, attention):
    torch.manual_seed(20)
    gqa = ea.MultiHeadAttention(24, 6, attention=attention, num_kv_heads=num_kv_heads).double()
    mha = _tied_multi_head(gqa)
    x, context = torch.randn(2, 7, 24, dtype=torch.float64), torch.randn(2, 5, 24).double()
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    for kwargs in ({}, {"causal": True}, {"key_padding_mask": pad},
                   {"causal": True, "key_padding_mask": pad}):
        torch.testing.assert_close(gqa(x, **kwargs), mha(x, **kwargs), atol=1e-12, rtol=0)
    if attention is not _banded:  # a band is square: no cross-attention
        torch.testing.assert_close(gqa(x, context), mha(x, context), atol=1e-12, rtol=0)


def test_grouped_query_gradients_are_the_tied_sums():
    torch.manual_seed(21)
    gqa = ea.MultiHeadAttention(16, 4, num_kv_heads=2).double()
    mha = _tied_multi_head(gqa)
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    gqa(x, causal=True).square().sum().backward()
    mha(x, causal=True).square().sum().backward()
    torch.testing.assert_close(gqa.q_proj.weight.grad, mha.q_proj.weight.grad)
    for name in ("k_proj", "v_proj"):  # a shared weight gets the sum over its group's copies
        tied = getattr(mha, name).weight.grad.view(2, 2, 4, 16).sum(1).reshape(8, 16)
        torch.testing.assert_close(getattr(gqa, name).weight.grad, tied)


def test_multi_query_shapes_and_views():
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append((q.shape, k.shape, k.stride(), kwargs["key_padding_mask"].shape))
        return ea.softmax_attention(q, k, v, **kwargs)

    mqa = ea.MultiHeadAttention(32, 8, attention=spy, num_kv_heads=1)
    assert mqa.k_proj.weight.shape == mqa.v_proj.weight.shape == (4, 32)  # one head of 4
    assert mqa.q_proj.weight.shape == (32, 32) and mqa.num_kv_heads == 1
    pad = torch.zeros(2, 3, 5, dtype=torch.bool)
    out = mqa(torch.randn(2, 3, 5, 32), key_padding_mask=pad)  # two batch dimensions
    assert out.shape == (2, 3, 5, 32)
    q_shape, k_shape, k_stride, mask_shape = seen[0]
    assert q_shape == k_shape == (2, 3, 1, 8, 5, 4)  # (..., h_kv, group, n, d_head)
    assert k_stride[3] == 0  # the group sees one key head: expanded, not copied
    assert mask_shape == (2, 3, 1, 1, 5)
    assert ea.MultiHeadAttention(32, 8).k_proj.weight.shape == (32, 32)  # default: one per head


@pytest.mark.parametrize(
    "num_kv_heads, error, words",
    [(3, ValueError, ["num_kv_heads must divide num_heads", "num_heads=4", "num_kv_heads=3"]),
     (8, ValueError, ["num_heads=4", "num_kv_heads=8"]),
     (0, ValueError, ["num_kv_heads", "positive", "0"]),
     (-2, ValueError, ["num_kv_heads", "-2"]),
     (2.0, TypeError, ["num_kv_heads", "int", "float"]),
     (True, TypeError, ["num_kv_heads", "bool"])],
)
def test_num_kv_heads_bad_values(num_kv_heads, error, words):
    with pytest.raises(error) as info:
        ea.MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads)
    for word in words:
        assert word in str(info.value)


def test_multi_head_attention_names_a_wrong_dtype_and_a_list_mask():
    """float64 input to a float32 module failed deep in a matmul (forward and decode); a list
    as key_padding_mask raised AttributeError (issue 27.5)."""
    mha = ea.MultiHeadAttention(d_model=8, num_heads=2)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"x must have the dtype of the module's parameters "
                                        r"\(torch.float32\), got torch.float64"):
        mha(x)
    cache = ea.KVCache(max_len=8)
    with pytest.raises(TypeError, match="x must have the dtype of the module's parameters"):
        mha.decode(x[:, :1], cache)
    assert mha.double()(x).dtype == torch.float64  # what the message proposes
    with pytest.raises(TypeError, match="key_padding_mask must be a bool torch.Tensor, got list"):
        mha(x, key_padding_mask=[[True] * 5] * 2)
