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
