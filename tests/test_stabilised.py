"""Tests for efficient_attention._stabilised's query blocks: contiguous pieces of the
output, written in place."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from efficient_attention import _stabilised


@given(batch=st.integers(1, 6), n=st.integers(1, 40), block_size=st.integers(1, 50),
       all_heads=st.booleans())
@settings(max_examples=200, deadline=None)
def test_query_blocks_cover_every_output_row_once_in_contiguous_pieces(
        batch, n, block_size, all_heads):
    out = torch.zeros(batch, n, 3)
    for heads, rows, pieces in _stabilised._query_blocks(batch, n, block_size, all_heads):
        piece = out[heads, rows]
        assert all_heads or piece.is_contiguous()
        assert piece.numel() <= 3 * max(batch * block_size, n)  # about one block's worth
        assert pieces == 1 or (piece.shape[0] == 1 and piece.shape[1] == pieces * block_size)
        piece += 1
    torch.testing.assert_close(out, torch.ones_like(out))
