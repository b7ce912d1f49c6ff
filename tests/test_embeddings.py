"""Tests for the fixed encodings in efficient_attention.embeddings."""

import math

import pytest
import torch

import efficient_attention as ea


def test_one_hot_rows_and_lookup():
    idx = torch.tensor([[0, 3], [2, 2]])
    oh = ea.one_hot(idx, 4)
    assert oh.shape == (2, 2, 4) and oh.dtype == torch.float32
    assert torch.equal(oh.sum(-1), torch.ones(2, 2))
    assert torch.equal(oh.argmax(-1), idx)
    table = torch.randn(4, 5)
    torch.testing.assert_close(oh @ table, table[idx])  # one-hot times a matrix is a lookup


def test_one_hot_codes_are_orthogonal_and_equidistant():
    oh = ea.one_hot(torch.arange(6), 6)
    torch.testing.assert_close(oh @ oh.T, torch.eye(6))
    distances = torch.cdist(oh, oh)
    off_diagonal = distances[~torch.eye(6, dtype=torch.bool)]
    torch.testing.assert_close(off_diagonal, torch.full_like(off_diagonal, math.sqrt(2)))


def test_one_hot_bad_input():
    with pytest.raises(TypeError, match="indices must be an integer tensor.*float32"):
        ea.one_hot(torch.tensor([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, num_classes=3\).*\[0, 3\]"):
        ea.one_hot(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="num_classes must be a positive int, got 0"):
        ea.one_hot(torch.tensor([0]), 0)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor.*list"):
        ea.one_hot([0, 1], 3)


def test_sinusoidal_encoding_matches_formula():
    n, d = 7, 6
    pe = ea.sinusoidal_positional_encoding(n, d)
    assert pe.shape == (n, d)
    for p in range(n):
        for i in range(d // 2):
            angle = p / 10000 ** (2 * i / d)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_encoding_odd_dimension_and_dtype():
    pe = ea.sinusoidal_positional_encoding(5, 5, dtype=torch.float64)
    assert pe.shape == (5, 5) and pe.dtype == torch.float64
    assert pe[3, 4].item() == pytest.approx(math.sin(3 / 10000 ** (4 / 5)))


def test_sinusoidal_offset_is_a_rotation():
    # PE[p + t] = PE[p] R(t): sin(a+b) = sin a cos b + cos a sin b and
    # cos(a+b) = cos a cos b - sin a sin b,
    # so each (sin, cos) pair turns by a rotation that depends on t but not on p.
    n, d, t = 20, 8, 3
    pe = ea.sinusoidal_positional_encoding(n + t, d, dtype=torch.float64)
    for i in range(d // 2):
        w = 1 / 10000 ** (2 * i / d)
        c, s = math.cos(w * t), math.sin(w * t)
        rotation = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        pair = pe[:n, 2 * i : 2 * i + 2]  # (n, 2): (sin, cos)
        torch.testing.assert_close(pair @ rotation, pe[t : n + t, 2 * i : 2 * i + 2])


def test_sinusoidal_bad_input():
    with pytest.raises(ValueError, match="d must be a positive int, got -1"):
        ea.sinusoidal_positional_encoding(3, -1)
    with pytest.raises(TypeError, match="n must be a positive int, got float"):
        ea.sinusoidal_positional_encoding(3.0, 4)
