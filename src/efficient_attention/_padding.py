"""Removing padded keys and values before any arithmetic touches them.

A padded key must take no part in any output, even when the padding holds NaN or inf
(uninitialised memory, a division by a zero length upstream). Multiplying by a zero
weight is not enough, since ``0 * NaN = NaN`` and ``0 * inf = NaN``: the padded rows are
replaced by zeros with ``torch.where`` first, and then also get zero weight.
"""

from __future__ import annotations

import torch


def zero_padded_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x (..., n, e)`` with the rows where ``mask (..., n)`` is ``True`` set to zero.

    The result has the broadcast batch shape of ``x`` and ``mask``. Cost ``O(n e)``.
    """
    if mask is None:
        return x
    return torch.where(mask.unsqueeze(-1), torch.zeros((), dtype=x.dtype, device=x.device), x)


def zeros_like_result(shape: tuple[int, ...], *inputs: torch.Tensor) -> torch.Tensor:
    """Zeros of ``shape`` for an empty case (no query, no key, empty batch), still part
    of the autograd graph of ``inputs`` (their gradients are zero), so that ``backward``
    works as it does for any other size. Adds sums of empty slices: exactly zero, even
    when an input holds NaN."""
    like = inputs[-1]
    out = torch.zeros(shape, dtype=like.dtype, device=like.device)
    for x in inputs:
        if x.requires_grad:
            out = out + x.reshape(-1)[:0].sum()
    return out
