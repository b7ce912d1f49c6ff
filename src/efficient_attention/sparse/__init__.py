"""Sparse selection: attention restricted to chosen keys, computed exactly on them.

- :mod:`.block_sparse`: :func:`block_sparse_attention` over a block mask, and
  :func:`block_mask_to_token_mask` (its dense equivalent, for tests and figures);
- :mod:`.patterns`: Longformer's and BigBird's block masks;
- :mod:`.lsh`: Reformer's LSH attention with shared queries and keys;
- :mod:`.topk`: top-k block selection by mean keys (MoBA; NSA's selection branch).

Each attention function equals :func:`~efficient_attention.softmax_attention` with the
dense mask its docstring states (tested in float64), at a cost proportional to the
number of selected (query, key) pairs: nothing ``n x n`` is formed.
"""

from .block_sparse import block_mask_to_token_mask, block_sparse_attention
from .lsh import lsh_attention, lsh_buckets
from .patterns import bigbird_block_mask, longformer_block_mask
from .topk import topk_block_attention, topk_block_mask

__all__ = [
    "block_sparse_attention",
    "block_mask_to_token_mask",
    "longformer_block_mask",
    "bigbird_block_mask",
    "lsh_attention",
    "lsh_buckets",
    "topk_block_attention",
    "topk_block_mask",
]
