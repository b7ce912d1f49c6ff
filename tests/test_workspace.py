"""Tests for efficient_attention._workspace: the per-thread CPU workspace of FAVOR+'s block
buffers (kept between calls, bounded, never part of a result, none under autograd)."""

import threading

import pytest
import torch

import efficient_attention as ea
from efficient_attention import _workspace


def inputs(seed, n=70, heads=3, d=8, d_v=5):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, heads, n, d, generator=g) for _ in range(2))
    v = torch.randn(2, heads, n, d_v, generator=g)
    w = ea.gaussian_random_matrix(16, d, generator=g)
    return q, k, v, w


def kept():
    return dict(_workspace._kept_buffers())


@pytest.mark.parametrize("causal", [False, True])
def test_workspace_is_kept_between_calls_without_touching_results(causal):
    _workspace.release_workspace()
    q, k, v, w = inputs(0)
    first = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    expected = first.clone()
    buffers = kept()
    assert buffers, "a CPU call without autograd keeps its block buffers"
    assert sum(t.numel() * t.element_size() for t in buffers.values()) <= (
        _workspace.WORKSPACE_BYTES)
    q2, k2, v2, w2 = inputs(1)
    second = ea.favor_attention(q2, k2, v2, w2, causal=causal, block_size=16)
    # the same buffers again, none of them in either result
    assert {key: t.data_ptr() for key, t in kept().items()} == {
        key: t.data_ptr() for key, t in buffers.items()}
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    for result in (first, second):
        assert all(result.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                   for t in buffers.values())
    _workspace.release_workspace()
    assert not kept()
    torch.testing.assert_close(ea.favor_attention(q2, k2, v2, w2, causal=causal,
                                                  block_size=16), second, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_buffers_over_the_limit_live_for_one_call(monkeypatch, causal):
    q, k, v, w = inputs(2)
    _workspace.release_workspace()
    expected = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    _workspace.release_workspace()
    monkeypatch.setattr(_workspace, "WORKSPACE_BYTES", 64)
    got = ea.favor_attention(q, k, v, w, causal=causal, block_size=16)
    assert not kept()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_workspace_made_in_inference_mode_serves_later_calls_outside_it():
    """Buffers kept by a call under torch.inference_mode are written by later calls under
    no_grad and with autograd enabled (an inference tensor could not be)."""
    _workspace.release_workspace()
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
    _workspace.release_workspace()
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
