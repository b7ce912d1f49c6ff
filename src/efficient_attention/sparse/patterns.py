r"""Block masks of fixed sparsity patterns: Longformer's and BigBird's.

Each builder returns a bool block mask ``(nb, nb)``, ``nb = ceil(n / block_size)``,
``True`` where query block ``I`` attends to key block ``J``, for
:func:`~efficient_attention.block_sparse_attention`:

- *sliding window* (``window = w``): ``|I - J| <= w``, ``2 w + 1`` blocks per row;
- *global blocks* (``num_global = g``): the first ``g`` blocks attend to every block
  (rows ``I < g``) and every block attends to them (columns ``J < g``);
- *random blocks* (BigBird, ``num_random = r``): ``r`` further key blocks per query
  block, drawn uniformly without replacement among those the window and the global
  blocks did not select (fewer when fewer are left).

With ``causal=True`` the mask keeps only ``J <= I`` (and random blocks are drawn among
those), which is what ``block_sparse_attention(..., causal=True)`` uses anyway.
A mask with ``N`` selected blocks costs ``N B^2 (d + d_v)`` in the attention: here
``N <= nb (2 w + 1 + r) + 2 g nb``, linear in ``n`` for fixed ``w, g, r``.

References: I. Beltagy, M. E. Peters and A. Cohan, "Longformer: the long-document
transformer", 2020; M. Zaheer et al., "Big Bird: transformers for longer sequences",
NeurIPS 2020 (its block-sparse "ITC" variant: global, window and random blocks).
"""

from __future__ import annotations

import torch

from .._checks import check_bool, check_generator, check_nonnegative_int, check_positive_int
from .block_sparse import num_blocks

__all__ = ["longformer_block_mask", "bigbird_block_mask"]


def _window_and_global(n, block_size, window, num_global, causal, device):
    check_nonnegative_int(n, "n")
    block_size = check_positive_int(block_size, "block_size")
    check_nonnegative_int(window, "window")
    check_nonnegative_int(num_global, "num_global")
    check_bool(causal, "causal")
    nb = num_blocks(n, block_size)
    rows = torch.arange(nb, device=device).unsqueeze(-1)
    cols = torch.arange(nb, device=device)
    mask = ((rows - cols).abs() <= window) | (rows < num_global) | (cols < num_global)
    if causal:
        mask &= cols <= rows
    return mask


def longformer_block_mask(
    n: int,
    *,
    block_size: int,
    window: int,
    num_global: int = 0,
    causal: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""Longformer's sliding window with global tokens, as a block mask.

    .. math::
        M_{IJ} = (|I - J| \le w) \vee (I < g) \vee (J < g) \quad (\wedge\ J \le I
        \text{ if causal})

    Args:
        n: sequence length (tokens); the mask has ``nb = ceil(n / block_size)`` rows and
            columns.
        block_size: tokens per block ``B``.
        window: ``w``, blocks attended on each side of the query block (0: only its own).
        num_global: ``g``, the first ``g`` blocks are global: they attend to all blocks
            and all blocks attend to them (Longformer's global tokens, block-rounded).
        causal: keep only key blocks ``J <= I``.
        device: where the mask is made.

    Returns:
        bool ``(nb, nb)``, ``True`` = attend. Cost ``O(nb^2)`` booleans (block level).

    Reference: Beltagy et al., "Longformer: the long-document transformer", 2020.
    """
    return _window_and_global(n, block_size, window, num_global, causal, device)


def bigbird_block_mask(
    n: int,
    *,
    block_size: int,
    window: int,
    num_global: int,
    num_random: int,
    causal: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""BigBird's block mask: sliding window, global blocks and random blocks.

    The Longformer mask of :func:`longformer_block_mask` (window ``w`` blocks each side,
    ``g`` global blocks), plus, for every query block, ``r = num_random`` key blocks
    drawn uniformly without replacement from those not yet selected (and ``J <= I``
    when ``causal``); a row with fewer than ``r`` blocks left gets them all.

    Args:
        n, block_size, window, num_global, causal, device: as in
            :func:`longformer_block_mask`.
        num_random: ``r``, random key blocks per query block.
        generator: a ``torch.Generator`` for the random blocks (the draw is made on its
            device, on the CPU without one, then moved to ``device``): the same seed gives
            the same mask.

    Returns:
        bool ``(nb, nb)``, ``True`` = attend, ``nb = ceil(n / block_size)``. Cost
        ``O(nb^2)`` (one uniform number per block pair, the top ``r`` per row).

    Reference: Zaheer et al., "Big Bird: transformers for longer sequences", NeurIPS 2020.
    """
    check_nonnegative_int(num_random, "num_random")
    generator = check_generator(generator)
    mask = _window_and_global(n, block_size, window, num_global, causal, device)
    nb = mask.shape[0]
    if num_random == 0 or nb == 0:
        return mask
    candidates = ~mask
    if causal:
        candidates &= torch.ones(nb, nb, dtype=torch.bool, device=mask.device).tril()
    draw_on = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand(nb, nb, generator=generator, device=draw_on).to(mask.device)
    noise = noise.masked_fill(~candidates, -1.0)  # uniform in [0, 1) where free
    top = noise.topk(min(num_random, nb), dim=-1)
    picked = torch.zeros_like(mask).scatter_(-1, top.indices, top.values >= 0)
    return mask | picked
