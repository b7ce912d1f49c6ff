"""Tests for efficient_attention.lowrank: truncated SVD and the Eckart-Young theorem."""

import pytest
import torch

import efficient_attention as ea


def _matrix(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("shape", [(7, 5), (3, 6, 9), (2, 2, 8, 8)])
def test_error_equals_tail_of_singular_values(shape):
    a = _matrix(*shape)
    s = torch.linalg.svdvals(a)
    for rank in range(1, min(shape[-2:]) + 1):
        approx = ea.low_rank_approximation(a, rank)
        frobenius = torch.linalg.matrix_norm(a - approx)
        spectral = torch.linalg.matrix_norm(a - approx, ord=2)
        tail = s[..., rank:]
        torch.testing.assert_close(frobenius, tail.square().sum(-1).sqrt())
        torch.testing.assert_close(ea.eckart_young_error(a, rank), frobenius)
        expected_spectral = tail[..., 0] if tail.shape[-1] else torch.zeros_like(s[..., 0])
        torch.testing.assert_close(spectral, expected_spectral, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(ea.eckart_young_error(a, rank, norm="spectral"), spectral,
                                   atol=1e-12, rtol=1e-10)
        assert (torch.linalg.matrix_rank(approx) == rank).all()


def test_full_rank_reproduces_the_matrix():
    a = _matrix(6, 4)
    torch.testing.assert_close(ea.low_rank_approximation(a, 4), a)
    assert ea.eckart_young_error(a, 4).item() == 0.0


def test_truncated_svd_beats_random_rank_r_factorisations():
    a = _matrix(12, 10, seed=1)
    rank = 3
    best = ea.eckart_young_error(a, rank)
    generator = torch.Generator().manual_seed(2)
    for _ in range(200):
        left = torch.randn(12, rank, generator=generator, dtype=torch.float64)
        right = torch.randn(rank, 10, generator=generator, dtype=torch.float64)
        # A random factorisation, and the best one with the same column space (least squares).
        assert torch.linalg.matrix_norm(a - left @ right) >= best
        projected = left @ torch.linalg.lstsq(left, a).solution
        assert torch.linalg.matrix_norm(a - projected) >= best - 1e-12


def test_spectrum_is_sorted_and_energy_matches_the_error():
    a = _matrix(9, 7, seed=3)
    s = ea.singular_value_spectrum(a)
    torch.testing.assert_close(s, torch.linalg.svdvals(a))
    assert (s[:-1] >= s[1:]).all()
    energy = ea.spectral_energy(s)
    total = torch.linalg.matrix_norm(a).square()
    for rank in range(1, 8):
        relative_error = ea.eckart_young_error(a, rank).square() / total
        torch.testing.assert_close(1 - energy[rank - 1], relative_error)
    assert ea.spectral_energy(torch.zeros(3)).eq(0).all()


def test_float32_and_batched_shapes():
    a = torch.randn(4, 5, 6)
    out = ea.low_rank_approximation(a, 2)
    assert out.shape == a.shape and out.dtype == torch.float32
    assert ea.eckart_young_error(a, 2).shape == (4,)


def test_bad_input():
    a = _matrix(4, 3)
    with pytest.raises(ValueError, match="rank must be at most min\\(n, m\\)=3.*got 4"):
        ea.low_rank_approximation(a, 4)
    with pytest.raises(ValueError, match="rank must be a positive int, got 0"):
        ea.eckart_young_error(a, 0)
    with pytest.raises(TypeError, match="rank must be a positive int, got float"):
        ea.low_rank_approximation(a, 1.0)
    with pytest.raises(TypeError, match="a must be a torch.Tensor, got list"):
        ea.low_rank_approximation([[1.0]], 1)
    with pytest.raises(ValueError, match="a must have at least 2 dimension"):
        ea.singular_value_spectrum(torch.ones(3))
    with pytest.raises(ValueError, match="norm must be 'fro' or 'spectral', got 'nuc'"):
        ea.eckart_young_error(a, 1, norm="nuc")
