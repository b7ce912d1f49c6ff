"""Tests of efficient_attention.memory: the tensor memory tracker the chapters use.

Sizes are exact: a float32 tensor of N elements owns a storage of 4 N bytes, so every
expected number below follows from the shapes.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
import torch.nn.functional as F

import efficient_attention as ea

FLOAT32 = 4  # bytes per element


def test_module_and_top_level_names():
    module = importlib.import_module("efficient_attention.memory")
    assert module.TensorMemoryTracker is ea.TensorMemoryTracker
    assert module.peak_tensor_memory is ea.peak_tensor_memory
    assert {"TensorMemoryTracker", "peak_tensor_memory"} <= set(ea.__all__)


def test_one_allocation_is_counted_exactly():
    with ea.TensorMemoryTracker() as tracker:
        x = torch.zeros(100, 30)
    assert tracker.peak == tracker.largest == tracker.allocated == FLOAT32 * 3000
    del x


def test_tensors_freed_in_between_do_not_add_up():
    def two_in_turn():
        a = torch.ones(1000)
        del a
        gc.collect()
        b = torch.ones(500)
        return b.sum()

    with ea.TensorMemoryTracker() as tracker:
        two_in_turn()
    # the larger of the two (b and its 4-byte sum come to 2004 bytes), not their sum
    assert tracker.peak == FLOAT32 * 1000
    assert tracker.largest == FLOAT32 * 1000
    assert tracker.allocated == FLOAT32 * (1000 + 500 + 1)


def test_tensors_alive_together_add_up():
    with ea.TensorMemoryTracker() as tracker:
        a = torch.ones(1000)
        b = torch.ones(500)
    assert tracker.peak == FLOAT32 * 1500
    assert tracker.largest == FLOAT32 * 1000
    del a, b


def test_views_and_inplace_results_cost_nothing():
    x = torch.randn(64, 64)  # created outside: not counted
    with ea.TensorMemoryTracker() as tracker:
        y = x.t()
        z = x.view(-1)[:10]
        x.mul_(2.0)
    assert tracker.peak == tracker.allocated == 0
    del y, z


def test_a_view_keeps_its_storage_alive():
    with ea.TensorMemoryTracker() as tracker:
        base = torch.ones(1000)
        view = base[:10]
        del base
        gc.collect()
        assert tracker.current == FLOAT32 * 1000  # the view still holds the storage
        del view
        gc.collect()
        assert tracker.current == 0
    assert tracker.peak == FLOAT32 * 1000


def test_tracker_restarts_on_each_entry():
    tracker = ea.TensorMemoryTracker()
    with tracker:
        a = torch.ones(1000)
    with tracker:
        b = torch.ones(10)
    assert tracker.peak == FLOAT32 * 10
    del a, b


def test_exact_attention_holds_the_weights_and_fused_sdpa_does_not():
    n, d = 512, 32
    q, k, v = torch.randn(3, 1, 1, n, d).unbind(0)  # 4-D: SDPA takes its fused CPU kernel
    weights = FLOAT32 * n * n
    assert ea.peak_tensor_memory(ea.softmax_attention, q, k, v) >= weights
    assert ea.peak_tensor_memory(F.scaled_dot_product_attention, q, k, v) < weights / 8
    with ea.TensorMemoryTracker() as tracker:
        ea.softmax_attention(q, k, v)
    assert tracker.largest >= weights  # the n x n matrix is one allocation


def test_linear_attention_memory_grows_linearly():
    d = 16
    peaks = []
    for n in (1024, 2048):
        q, k, v = torch.randn(3, n, d).unbind(0)
        peaks.append(ea.peak_tensor_memory(ea.linear_attention, q, k, v))
    # every tensor is (n, d), (n, 1) or (d, d): doubling n at most doubles the peak, and the
    # O(n) part dominates the (d, d) state, so the ratio is close to 2
    assert 1.8 < peaks[1] / peaks[0] <= 2.0


def test_keyword_arguments_are_passed():
    q, k, v = torch.randn(3, 64, 8).unbind(0)
    plain = ea.peak_tensor_memory(ea.softmax_attention, q, k, v)
    weights = ea.peak_tensor_memory(ea.softmax_attention, q, k, v, return_weights=True)
    assert weights >= plain > 0


def test_not_callable_is_rejected():
    with pytest.raises(TypeError, match="fn must be callable"):
        ea.peak_tensor_memory(torch.ones(3))


@pytest.mark.cuda
def test_cuda_tensors_are_counted_like_cpu_ones():
    device = torch.device("cuda")
    q, k, v = torch.randn(3, 1, 1, 256, 16, device=device).unbind(0)
    with ea.TensorMemoryTracker() as tracker:
        ea.softmax_attention(q, k, v)
    assert tracker.largest >= FLOAT32 * 256 * 256  # the weights, on the GPU
    with ea.TensorMemoryTracker() as tracker:
        x = torch.empty(1000, device=device)
    assert tracker.peak == FLOAT32 * 1000
    del x
