"""Tests for efficient_attention._stabilised's machinery: the per-thread CPU workspace
of block buffers and the query blocks that write the output in place."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import efficient_attention as ea
from efficient_attention import _stabilised


def inputs(seed, n=70, heads=3, d=8, d_v=5):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, heads, n, d, generator=g) for _ in range(2))
    v = torch.randn(2, heads, n, d_v, generator=g)
    w = ea.gaussian_random_matrix(16, d, generator=g)
    return q, k, v, w


def kept():
    return dict(_stabilised._kept_buffers())


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


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_is_kept_between_calls_without_touching_results(causal):
    _stabilised.release_workspace()
    q, k, v, w = inputs(0)
    first = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    expected = first.clone()
    buffers = kept()
    assert buffers, "a CPU call without autograd keeps its block buffers"
    assert sum(t.numel() * t.element_size() for t in buffers.values()) <= (
        _stabilised.WORKSPACE_BYTES)
    q2, k2, v2, w2 = inputs(1)
    second = ea.favor_attention(q2, k2, v2, w2, causal=causal, block_size=16)
    # the same buffers again, none of them in either result
    assert {key: t.data_ptr() for key, t in kept().items()} == {
        key: t.data_ptr() for key, t in buffers.items()}
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    for result in (first, second):
        assert all(result.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                   for t in buffers.values())
    _stabilised.release_workspace()
    assert not kept()
    torch.testing.assert_close(ea.favor_attention(q2, k2, v2, w2, causal=causal,
                                                  block_size=16), second, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_buffers_over_the_limit_live_for_one_call(monkeypatch, causal):
    q, k, v, w = inputs(2)
    _stabilised.release_workspace()
    expected = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    _stabilised.release_workspace()
    monkeypatch.setattr(_stabilised, "WORKSPACE_BYTES", 64)
    got = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    assert not kept()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_workspace_made_in_inference_mode_serves_later_calls_outside_it():
    """Buffers kept by a call under torch.inference_mode are written by later calls under
    no_grad and with autograd enabled (an inference tensor could not be)."""
    _stabilised.release_workspace()
    q, k, v, w = inputs(6)
    with torch.inference_mode():
        first = ea.favor_attention(q, k, v, w, block_size=16)
    assert kept()
    with torch.no_grad():
        second = ea.favor_attention(q, k, v, w, block_size=16)
    third = ea.favor_attention(q, k, v, w, block_size=16)
    with torch.inference_mode():
        fourth = ea.favor_attention(q, k, v, w, block_size=16)
    for result in (second, third, fourth):
        torch.testing.assert_close(result, first, rtol=0, atol=0)


def test_autograd_keeps_no_workspace():
    _stabilised.release_workspace()
    q, k, v, w = inputs(3)
    q.requires_grad_()
    ea.favor_attention(q, k, v, w, causal=True, block_size=16).sum().backward()
    assert not kept()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_threads_use_their_own_workspace():
    """Calls running at the same time in two threads give the results of calls made one
    after the other (each thread has its buffers)."""
    cases = [inputs(seed, n=300) for seed in (4, 5)]
    expected = [ea.favor_attention(*case, causal=True, block_size=32) for case in cases]
    results = [[None] * 5 for _ in cases]
    start = threading.Barrier(len(cases))

    def run(i):
        start.wait()
        for r in range(5):
            results[i][r] = ea.favor_attention(*cases[i], causal=True, block_size=32)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        for result in got:
            torch.testing.assert_close(result, want, rtol=0, atol=0)
