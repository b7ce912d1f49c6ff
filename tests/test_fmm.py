"""Tests for efficient_attention.fmm: banded attention and FMMformer."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import efficient_attention as ea

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: threads only add overhead, and on a loaded machine every OpenMP
    # barrier can cost milliseconds. Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _dense_band(q, k, v, w, causal=False, key_padding_mask=None):
    """Reference from ea.softmax_attention itself: each query is its own batch element and
    sees the keys of its band, expressed as a per-query key padding mask (n x n memory)."""
    n = q.shape[-2]
    i = torch.arange(n)
    outside = (i[:, None] - i[None, :]).abs() > w  # (n, n): True = not in the band
    if causal:
        outside |= i[None, :] > i[:, None]
    if key_padding_mask is not None:
        outside = outside | key_padding_mask.unsqueeze(-2)  # (..., n, n)
    out = ea.softmax_attention(
        q.unsqueeze(-2),  # (..., n, 1, d): one query per batch element
        k.unsqueeze(-3).expand(*k.shape[:-2], n, n, k.shape[-1]),
        v.unsqueeze(-3).expand(*v.shape[:-2], n, n, v.shape[-1]),
        key_padding_mask=outside,
    )
    return out.squeeze(-2)


@pytest.mark.parametrize("n", [1, 6, 37, 100])
@pytest.mark.parametrize("w", [0, 1, 5, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_band_equals_dense_band_masked_softmax(n, w, causal):
    q, k, v = _randn(2, 3, n, 8, seed=1), _randn(2, 3, n, 8, seed=2), _randn(2, 3, n, 5, seed=3)
    expected = _dense_band(q, k, v, w, causal)
    for block_size in (None, 1, 7, 32):  # blocks that do not divide n
        out = ea.banded_attention(q, k, v, w, causal=causal, block_size=block_size)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_band_with_key_padding_mask(causal):
    n = 45
    q, k, v = _randn(2, 3, n, 8, seed=4), _randn(2, 3, n, 8, seed=5), _randn(2, 3, n, 4, seed=6)
    mask = torch.rand(2, 1, n, generator=torch.Generator().manual_seed(7)) < 0.5
    mask[0, 0, 10:30] = True  # a long padded run: some queries have no key in their band
    for block_size in (None, 4, 13):
        out = ea.banded_attention(q, k, v, 3, causal=causal, key_padding_mask=mask,
                                  block_size=block_size)
        torch.testing.assert_close(out, _dense_band(q, k, v, 3, causal, mask))
    assert torch.equal(out[0, :, 15], torch.zeros(3, 4))  # no key within 3 of position 15


def test_wide_band_is_full_attention():
    q, k, v = _randn(2, 20, 8, seed=8), _randn(2, 20, 8, seed=9), _randn(2, 20, 8, seed=10)
    torch.testing.assert_close(ea.banded_attention(q, k, v, 19), ea.softmax_attention(q, k, v))
    torch.testing.assert_close(
        ea.banded_attention(q, k, v, 25, causal=True), ea.softmax_attention(q, k, v, causal=True)
    )


def test_band_broadcasts_batch_dimensions():
    q = _randn(2, 3, 10, 4, seed=11)
    k, v = _randn(1, 3, 10, 4, seed=12), _randn(2, 1, 10, 4, seed=13)
    expected = _dense_band(q, k.expand(2, 3, 10, 4), v.expand(2, 3, 10, 4), 2)
    torch.testing.assert_close(ea.banded_attention(q, k, v, 2), expected)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_band_never_builds_the_n_by_n_matrix(causal):
    n, d, w = 2048, 4, 8
    q, k, v = (torch.randn(1, n, d) for _ in range(3))
    with _LargestTensor() as record:
        ea.banded_attention(q, k, v, w, causal=causal)
    # Scores per query: B + 2w = 32 with the default block B = max(w // 2, 16) = 16, so
    # 32 numbers per query, and per sequence ceil(2w / B) = 1 block of 16 queries past
    # its end (windows never cross sequences): 32 (n + 16) at most; the dense matrix
    # would be n^2 = 2048 n.
    assert record.largest <= (16 + 2 * w) * (n + 16)
    assert record.largest < n * n // 32


def test_band_gradcheck():
    q, k, v = (_randn(1, 2, 9, 3, seed=s).requires_grad_() for s in (14, 15, 16))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.banded_attention(q, k, v, 2, block_size=4), (q, k, v)
    )
    mask = torch.tensor([[False] * 6 + [True] * 3])
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.banded_attention(q, k, v, 2, causal=True, key_padding_mask=mask,
                                            block_size=4),
        (q, k, v),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_fmm_is_the_weighted_sum_of_its_parts(causal):
    q, k, v = _randn(2, 2, 30, 6, seed=17), _randn(2, 2, 30, 6, seed=18), _randn(2, 2, 30, 4)
    maps = [ea.elu_feature_map, ea.elu_negative_feature_map]
    out = ea.fmm_attention(q, k, v, bandwidth=3, feature_maps=maps, near_weight=0.7,
                           far_weight=[0.2, 1.5], causal=causal)
    near = ea.banded_attention(q, k, v, 3, causal=causal)
    far = [ea.linear_attention(q, k, v, f, causal=causal) for f in maps]
    torch.testing.assert_close(out, 0.7 * near + 0.2 * far[0] + 1.5 * far[1])
    # A single map and tensor weights are accepted too.
    single = ea.fmm_attention(q, k, v, bandwidth=3, feature_maps=ea.elu_feature_map,
                              near_weight=torch.tensor(2.0, dtype=F64),
                              far_weight=torch.tensor([0.5], dtype=F64), causal=causal)
    torch.testing.assert_close(single, 2.0 * near + 0.5 * far[0])


def test_fmm_causal_output_ignores_the_future():
    q, k, v = _randn(1, 20, 4, seed=19), _randn(1, 20, 4, seed=20), _randn(1, 20, 4, seed=21)
    module = ea.FMMAttention(bandwidth=2).double()
    out = module(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, 12:], v2[:, 12:] = 5.0, -5.0
    torch.testing.assert_close(module(q, k2, v2, causal=True)[:, :12], out[:, :12])


def test_fmm_module_weights_are_positive_and_learnable():
    module = ea.FMMAttention(bandwidth=2, init_near_weight=0.3, init_far_weight=0.9)
    torch.testing.assert_close(module.near_weight, torch.tensor(0.3))
    torch.testing.assert_close(module.far_weight, torch.tensor([0.9, 0.9]))
    assert len(module.feature_maps) == 2  # elu(x) + 1 and elu(-x) + 1 by default
    with torch.no_grad():
        module.raw_near_weight.fill_(-50.0)
        module.raw_far_weight.copy_(torch.tensor([-30.0, 20.0]))
    assert module.near_weight > 0 and (module.far_weight > 0).all()
    q, k, v = torch.randn(3, 2, 16, 8).unbind(0)
    module(q, k, v).square().sum().backward()
    assert module.raw_near_weight.grad is not None and module.raw_far_weight.grad.shape == (2,)
    # Used as the attention of MultiHeadAttention (with causal masking and padding).
    mha = ea.MultiHeadAttention(16, 2, attention=ea.FMMAttention(bandwidth=3))
    x = torch.randn(2, 16, 16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, 12:] = True
    assert mha(x, causal=True, key_padding_mask=mask).shape == (2, 16, 16)


def test_bad_input():
    q = k = v = torch.randn(2, 10, 4)
    with pytest.raises(ValueError, match="bandwidth must be a non-negative int, got -1"):
        ea.banded_attention(q, k, v, -1)
    with pytest.raises(ValueError, match="needs as many queries as keys"):
        ea.banded_attention(q[:, :5], k, v, 2)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        ea.banded_attention(q, k, v, 2, block_size=0)
    with pytest.raises(ValueError, match="key_padding_mask must be broadcastable"):
        ea.banded_attention(q, k, v, 2, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="far_weight must have one weight per feature map"):
        ea.fmm_attention(q, k, v, bandwidth=1, feature_maps=[ea.elu_feature_map],
                         near_weight=1.0, far_weight=[1.0, 2.0])
    with pytest.raises(TypeError, match="feature_maps must be a callable or a non-empty"):
        ea.fmm_attention(q, k, v, bandwidth=1, feature_maps=[], near_weight=1.0, far_weight=[])
    with pytest.raises(ValueError, match="near_weight must be a scalar"):
        ea.fmm_attention(q, k, v, bandwidth=1, feature_maps=ea.elu_feature_map,
                         near_weight=torch.ones(2), far_weight=1.0)
    with pytest.raises(ValueError, match="init_near_weight must be a positive finite number"):
        ea.FMMAttention(2, init_near_weight=0.0)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_band_and_fmm_on_cuda_match_cpu(causal):
    q, k, v = _randn(2, 3, 50, 8, seed=22), _randn(2, 3, 50, 8, seed=23), _randn(2, 3, 50, 8)
    mask = torch.rand(2, 1, 50, generator=torch.Generator().manual_seed(24)) < 0.3
    on_gpu = ea.banded_attention(q.cuda(), k.cuda(), v.cuda(), 4, causal=causal,
                                 key_padding_mask=mask.cuda())
    assert on_gpu.device.type == "cuda"
    expected = ea.banded_attention(q, k, v, 4, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(on_gpu.cpu(), expected)
    module = ea.FMMAttention(bandwidth=4).double()
    expected = module(q, k, v, causal=causal)
    torch.testing.assert_close(module.cuda()(q.cuda(), k.cuda(), v.cuda(), causal=causal).cpu(),
                               expected)
