"""Tests for efficient_attention.nystrom: Nystrom Gram matrices, iterative pinv, Nystromformer."""

import math
from itertools import pairwise

import pytest
import torch

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


def _gaussian(a, b):
    return ea.gaussian_kernel(a, b, sigma=1.0)


# --------------------------------------------------------------------------- nystrom_gram


def test_gram_is_exact_with_every_point_as_landmark():
    x = _randn(30, 3)
    approx = ea.nystrom_gram(x, _gaussian, 30, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(approx, _gaussian(x, x), atol=1e-8, rtol=1e-8)


def test_gram_is_exact_for_a_kernel_of_low_rank():
    # The linear kernel x^T y on d = 4 features has rank 4: any 4 generic landmarks span it.
    x = _randn(2, 25, 4, seed=1)
    approx, indices = ea.nystrom_gram(
        x, lambda a, b: a @ b.transpose(-2, -1), 6,
        generator=torch.Generator().manual_seed(1), return_indices=True,
    )
    torch.testing.assert_close(approx, x @ x.transpose(-2, -1))
    assert indices.shape == (6,) and len(set(indices.tolist())) == 6
    assert (indices[1:] > indices[:-1]).all()


def test_gram_error_falls_with_more_landmarks_and_never_beats_eckart_young():
    x = _randn(120, 2, seed=2)
    exact = _gaussian(x, x)
    mean_errors = []
    for m in (4, 8, 16, 32):
        errors = []
        for seed in range(8):
            approx = ea.nystrom_gram(x, _gaussian, m, generator=torch.Generator().manual_seed(seed))
            error = torch.linalg.matrix_norm(exact - approx)
            # C W^+ C^T has rank <= m, so the truncated SVD is at least as good (deterministic).
            assert error >= ea.eckart_young_error(exact, m) - 1e-9
            errors.append(error.item())
        mean_errors.append(sum(errors) / len(errors))
    # The Gaussian kernel's spectrum decays fast on 2-D points: doubling m cuts the error
    # by far more than the spread of the 8-draw averages, so the order is not luck.
    assert all(later < 0.5 * earlier for earlier, later in pairwise(mean_errors))


def test_gram_landmarks_follow_the_generator():
    x = _randn(40, 3, seed=3)
    first = ea.nystrom_gram(x, _gaussian, 5, generator=torch.Generator().manual_seed(7),
                            return_indices=True)[1]
    again = ea.nystrom_gram(x, _gaussian, 5, generator=torch.Generator().manual_seed(7),
                            return_indices=True)[1]
    other = ea.nystrom_gram(x, _gaussian, 5, generator=torch.Generator().manual_seed(8),
                            return_indices=True)[1]
    assert torch.equal(first, again) and not torch.equal(first, other)


# --------------------------------------------------------------------------- iterative_pinv


@pytest.mark.parametrize("kind", ["shifted_gaussian", "softmax"])
def test_iterative_pinv_converges_to_the_inverse(kind):
    if kind == "shifted_gaussian":
        a = _randn(4, 8, 8, seed=4) + 4 * torch.eye(8, dtype=F64)  # well conditioned
    else:
        a = torch.softmax(_randn(4, 8, 8, seed=5), dim=-1)  # what Nystromformer inverts
    target = torch.linalg.inv(a)
    errors = [
        torch.linalg.matrix_norm(ea.iterative_pinv(a, it) - target).max().item()
        for it in (0, 2, 4, 8, 40)
    ]
    assert all(later < earlier for earlier, later in pairwise(errors))
    assert errors[-1] < 1e-9 * torch.linalg.matrix_norm(target).max().item()


def test_iterative_pinv_of_a_singular_matrix_converges_then_drifts():
    # Rank 3 of 8: the iterates approach the Moore-Penrose pseudo-inverse, but each step
    # multiplies the rounding error in the null space by 13/4, so it grows again later.
    b = _randn(4, 8, 3, seed=6)
    a = b @ b.transpose(-2, -1)
    target = torch.linalg.pinv(a)
    scale = torch.linalg.matrix_norm(target).max().item()
    error = {
        it: torch.linalg.matrix_norm(ea.iterative_pinv(a, it) - target).max().item() / scale
        for it in (2, 12, 60)
    }
    assert error[12] < 1e-8 < error[2]
    assert error[60] > 1e3 * error[12]


def test_iterative_pinv_bad_input():
    with pytest.raises(ValueError, match="a must be square"):
        ea.iterative_pinv(torch.ones(3, 4))
    with pytest.raises(ValueError, match="iterations must be a non-negative int, got -1"):
        ea.iterative_pinv(torch.eye(3), -1)


# ------------------------------------------------------------------------ nystrom_attention


def _reference_nystrom(q, k, v, m):
    """Nystromformer written out directly: segments of sizes floor/ceil(n/m), exact pinv."""
    n, d = q.shape[-2], q.shape[-1]
    q, k = q * d**-0.25, k * d**-0.25
    bounds = [math.ceil(j * n / m) for j in range(m + 1)]  # segment j holds i with
    # floor(i m / n) == j, that is ceil(j n / m) <= i < ceil((j + 1) n / m)
    segments = list(pairwise(bounds))
    q_land = torch.stack([q[..., lo:hi, :].mean(-2) for lo, hi in segments], -2)
    k_land = torch.stack([k[..., lo:hi, :].mean(-2) for lo, hi in segments], -2)
    kernel_1 = torch.softmax(q @ k_land.transpose(-2, -1), -1)
    kernel_2 = torch.softmax(q_land @ k_land.transpose(-2, -1), -1)
    kernel_3 = torch.softmax(q_land @ k.transpose(-2, -1), -1)
    out = kernel_1 @ torch.linalg.pinv(kernel_2) @ kernel_3 @ v
    return out, [hi - lo for lo, hi in segments]


@pytest.mark.parametrize("n, m", [(37, 10), (40, 10), (16, 5), (9, 8)])
def test_any_length_matches_the_written_out_formula(n, m):
    q, k, v = _randn(2, 3, n, 8, seed=7), _randn(2, 3, n, 8, seed=8), _randn(2, 3, n, 5, seed=9)
    expected, sizes = _reference_nystrom(q, k, v, m)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    out = ea.nystrom_attention(q, k, v, m, pinv_iterations=None)
    torch.testing.assert_close(out, expected)
    # With the iterative inverse (converged) the result is the same.
    torch.testing.assert_close(ea.nystrom_attention(q, k, v, m, pinv_iterations=60), expected)


@pytest.mark.parametrize("n, m", [(37, 37), (20, 64), (1, 3)])
def test_equals_softmax_attention_when_landmarks_are_the_keys(n, m):
    q, k, v = _randn(2, n, 8, seed=10), _randn(2, n, 8, seed=11), _randn(2, n, 4, seed=12)
    exact = ea.softmax_attention(q, k, v)
    torch.testing.assert_close(ea.nystrom_attention(q, k, v, m, pinv_iterations=None), exact)
    # The iteration converges on these softmax matrices well within 60 steps.
    torch.testing.assert_close(ea.nystrom_attention(q, k, v, m, pinv_iterations=60), exact)


def test_approximation_improves_with_more_landmarks_on_smooth_sequences():
    # Queries and keys that vary smoothly along the sequence: segment means represent them
    # well, so the error should fall steadily as m grows. (Near m = n the landmark matrix
    # of such smooth data is nearly singular and torch.linalg.pinv's cut-off dominates.)
    t = torch.linspace(0, 1, 64, dtype=F64).unsqueeze(-1)
    freq = _randn(1, 8, seed=13)
    q, k = torch.sin(3 * t * freq), torch.cos(3 * t * freq + 1)
    v = _randn(64, 4, seed=14)
    exact = ea.softmax_attention(q, k, v)
    errors = [
        (ea.nystrom_attention(q, k, v, m, pinv_iterations=None) - exact).abs().max().item()
        for m in (2, 4, 8, 16)
    ]
    assert all(later < 0.5 * earlier for earlier, later in pairwise(errors))
    assert errors[-1] < 1e-4


def test_fast_and_general_paths_agree():
    q, k, v = _randn(3, 40, 6, seed=15), _randn(3, 40, 6, seed=16), _randn(3, 40, 6, seed=17)
    no_padding = torch.zeros(3, 40, dtype=torch.bool)  # forces the masked (general) path
    torch.testing.assert_close(
        ea.nystrom_attention(q, k, v, 8),
        ea.nystrom_attention(q, k, v, 8, key_padding_mask=no_padding),
    )


@pytest.mark.parametrize("kept, m", [(29, 10), (6, 10), (37, 10)])
def test_padding_gives_the_output_of_the_unpadded_sequence(kept, m):
    n = 37
    q, k, v = _randn(2, 4, n, 8, seed=18), _randn(2, 4, n, 8, seed=19), _randn(2, 4, n, 8, seed=20)
    mask = torch.zeros(2, 1, n, dtype=torch.bool)  # one mask for all 4 heads
    mask[0, :, kept:] = True  # sequence 0 is padded after `kept` tokens; sequence 1 is not
    out = ea.nystrom_attention(q, k, v, m, pinv_iterations=None, key_padding_mask=mask)
    short = ea.nystrom_attention(
        q[0, :, :kept], k[0, :, :kept], v[0, :, :kept], m, pinv_iterations=None
    )
    torch.testing.assert_close(out[0, :, :kept], short)
    torch.testing.assert_close(out[1], ea.nystrom_attention(q[1], k[1], v[1], m,
                                                            pinv_iterations=None))


@pytest.mark.parametrize("n_q", [37, 11])
def test_padded_keys_get_no_weight(n_q):
    n_k = 37
    generator = torch.Generator().manual_seed(21)
    mask = torch.rand(2, n_k, generator=generator) < 0.4  # scattered padding
    q, k, v = _randn(2, n_q, 8, seed=22), _randn(2, n_k, 8, seed=23), _randn(2, n_k, 3, seed=24)
    out = ea.nystrom_attention(q, k, v, 6, key_padding_mask=mask)
    # Whatever sits at padded positions must not matter.
    k2 = torch.where(mask.unsqueeze(-1), 100 * _randn(2, n_k, 8, seed=25), k)
    v2 = torch.where(mask.unsqueeze(-1), 100 * _randn(2, n_k, 3, seed=26), v)
    torch.testing.assert_close(ea.nystrom_attention(q, k2, v2, 6, key_padding_mask=mask), out)
    assert torch.isfinite(out).all()


def test_all_keys_padded_gives_zeros():
    q = k = v = _randn(1, 5, 4, seed=27)
    out = ea.nystrom_attention(q, k, v, 2, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


def test_gradcheck():
    q, k, v = (_randn(1, 1, 7, 3, seed=s).requires_grad_() for s in (28, 29, 30))
    assert torch.autograd.gradcheck(lambda q, k, v: ea.nystrom_attention(q, k, v, 3), (q, k, v))
    mask = torch.tensor([[False] * 5 + [True] * 2])
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.nystrom_attention(q, k, v, 3, pinv_iterations=4,
                                             key_padding_mask=mask),
        (q, k, v),
    )


def test_module_and_multi_head_attention():
    module = ea.NystromAttention(num_landmarks=4)
    q, k, v = _randn(2, 2, 12, 4, seed=31), _randn(2, 2, 12, 4, seed=32), _randn(2, 2, 12, 4)
    torch.testing.assert_close(module(q, k, v), ea.nystrom_attention(q, k, v, 4))
    with pytest.raises(ValueError, match="causal=True is not supported by NystromAttention"):
        module(q, k, v, causal=True)
    mha = ea.MultiHeadAttention(16, 4, attention=module).double()
    x = _randn(2, 12, 16, seed=33)
    assert mha(x).shape == (2, 12, 16)
    with pytest.raises(ValueError, match="causal=True is not supported"):
        mha(x, causal=True)


def test_bad_input():
    q = k = v = torch.randn(2, 10, 4)
    with pytest.raises(ValueError, match="num_landmarks must be a positive int, got 0"):
        ea.nystrom_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="pinv_iterations must be a non-negative int"):
        ea.nystrom_attention(q, k, v, 2, pinv_iterations=-3)
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        ea.nystrom_attention(q, k, v, 2, key_padding_mask=torch.zeros(2, 10))
    with pytest.raises(ValueError, match="k and v must have the same sequence length"):
        ea.nystrom_attention(q, k, v[:, :5], 2)
    with pytest.raises(ValueError, match="num_landmarks must be at most the number of points"):
        ea.nystrom_gram(torch.randn(5, 2), _gaussian, 6)
    with pytest.raises(TypeError, match="kernel must be callable"):
        ea.nystrom_gram(torch.randn(5, 2), "gaussian", 2)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        ea.nystrom_gram(torch.randn(5, 2), _gaussian, 2, generator=0)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    q, k, v = _randn(2, 3, 37, 8, seed=34), _randn(2, 3, 37, 8, seed=35), _randn(2, 3, 37, 8)
    mask = torch.zeros(2, 1, 37, dtype=torch.bool)
    mask[0, :, 30:] = True
    for key_padding_mask in (None, mask):
        expected = ea.nystrom_attention(q, k, v, 10, key_padding_mask=key_padding_mask)
        gpu_mask = None if key_padding_mask is None else key_padding_mask.cuda()
        on_gpu = ea.nystrom_attention(q.cuda(), k.cuda(), v.cuda(), 10, key_padding_mask=gpu_mask)
        assert on_gpu.device.type == "cuda"
        torch.testing.assert_close(on_gpu.cpu(), expected)
    x = _randn(20, 3, seed=36)
    approx = ea.nystrom_gram(x.cuda(), _gaussian, 20, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(approx.cpu(), _gaussian(x, x), atol=1e-8, rtol=1e-8)
