"""Token and position embeddings.

This module starts with the two fixed encodings a Transformer needs before any
learning: one-hot vectors and the sinusoidal positional encoding of Vaswani et
al. (2017). Learned word vectors (word2vec) live in :mod:`.word2vec` and are
re-exported here.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_positive_int
from .word2vec import (
    SkipGram,
    Vocabulary,
    cosine_similarity_matrix,
    load_pydoc_corpus,
    most_similar,
    tokenize,
    train_word2vec,
)

__all__ = [
    "one_hot",
    "sinusoidal_positional_encoding",
    "tokenize",
    "load_pydoc_corpus",
    "Vocabulary",
    "SkipGram",
    "train_word2vec",
    "most_similar",
    "cosine_similarity_matrix",
]


def one_hot(
    indices: torch.Tensor, num_classes: int, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One-hot vectors: ``(...)`` integer indices -> ``(..., num_classes)``.

    ``out[..., c] = 1`` if ``indices[...] == c`` else ``0``. Each row has exactly
    one non-zero entry, so distinct tokens are orthogonal and equidistant: a
    one-hot code carries no notion of similarity. Memory ``O(numel * num_classes)``.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor of ints, got {type(indices).__name__}")
    if indices.is_floating_point() or indices.dtype == torch.bool or indices.is_complex():
        raise TypeError(f"indices must be an integer tensor, got dtype {indices.dtype}")
    check_positive_int(num_classes, "num_classes")
    if indices.numel() and (indices.min() < 0 or indices.max() >= num_classes):
        raise ValueError(
            f"indices must lie in [0, num_classes={num_classes}), got values in "
            f"[{int(indices.min())}, {int(indices.max())}]"
        )
    return torch.nn.functional.one_hot(indices.long(), num_classes).to(dtype)


def sinusoidal_positional_encoding(
    n: int,
    d: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""Sinusoidal positional encoding ``(n, d)`` of Vaswani et al. (2017).

    .. math::
        PE_{p, 2i} = \sin(p / \mathrm{base}^{2i/d}), \qquad
        PE_{p, 2i+1} = \cos(p / \mathrm{base}^{2i/d})

    for positions ``p = 0..n-1``. For odd ``d`` the last column is a sine. For a
    fixed offset ``t``, ``PE_{p+t}`` is a rotation of ``PE_p`` (per frequency pair),
    so relative positions are linear functions of the code. Cost ``O(n d)``.
    """
    check_positive_int(n, "n")
    check_positive_int(d, "d")
    position = torch.arange(n, dtype=torch.float64, device=device).unsqueeze(1)  # (n, 1)
    two_i = torch.arange(0, d, 2, dtype=torch.float64, device=device)  # (ceil(d/2),)
    frequency = torch.exp(-math.log(base) * two_i / d)  # base^(-2i/d)
    angle = position * frequency  # (n, ceil(d/2))
    pe = torch.zeros(n, d, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d // 2])
    return pe.to(dtype)
