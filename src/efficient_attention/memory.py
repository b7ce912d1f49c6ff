r"""Memory of the tensors that PyTorch operators create: peak and largest allocation.

The chapters measure how much memory an attention function needs without relying on a
device allocator: a ``TorchDispatchMode`` sees every operator call inside a ``with`` block,
and each tensor an operator returns on storage it did not receive as an input is a new
allocation. The tracker adds its bytes to the live total when it appears and removes them
when the last tensor that holds that storage is garbage-collected, so that

.. math:: \text{peak} = \max_t \sum_{\text{storages alive at } t} \text{bytes},

the quantity whose growth (``O(n^2)`` for the weights of exact attention, ``O(n)`` for the
linear-time methods) the chapters compare. Views and in-place results share the storage of
an input and cost nothing. The same code runs on CPU and GPU.

What it does not see: memory allocated inside a single kernel that never becomes a
tensor (the scratch buffers of a fused kernel), and tensors created outside the block.
Both are fine for comparing how methods scale; for absolute numbers on a GPU use
``torch.cuda.max_memory_allocated``.

Cost: one Python call per operator, so time a function without the tracker.

Reference: PyTorch's ``torch.utils._python_dispatch.TorchDispatchMode``, the mechanism
behind ``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker", "peak_tensor_memory"]


class TensorMemoryTracker(TorchDispatchMode):
    """Records the memory of the tensors created by PyTorch operators inside a ``with`` block.

    Attributes (bytes), valid during and after the block:

    - ``peak``: the largest total of storages alive at once;
    - ``largest``: the largest single storage created;
    - ``allocated``: the sum of every storage created (an upper bound on ``peak``);
    - ``current``: the total alive now.

    Example::

        with ea.TensorMemoryTracker() as tracker:
            ea.softmax_attention(q, k, v)
        tracker.peak, tracker.largest
    """

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._alive: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors holding it]
        self.current = 0
        self.peak = 0
        self.largest = 0
        self.allocated = 0

    def __enter__(self):
        self._reset()
        return super().__enter__()

    def _release(self, key: int) -> None:
        entry = self._alive.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= self._alive.pop(key)[0]

    def _hold(self, tensor: torch.Tensor, key: int) -> None:
        self._alive[key][1] += 1
        weakref.finalize(tensor, self._release, key)  # count down when the tensor dies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in inputs:
                # A view or an in-place result: no new memory, but a view of a tracked
                # storage keeps it alive after the tensor it came from is gone.
                if key in self._alive:
                    self._hold(t, key)
                continue
            size = t.untyped_storage().nbytes()
            if key not in self._alive:
                self._alive[key] = [size, 0]
                self.current += size
                self.allocated += size
                self.peak = max(self.peak, self.current)
                self.largest = max(self.largest, size)
            self._hold(t, key)
        return out


def peak_tensor_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Peak bytes of the tensors created while ``fn(*args, **kwargs)`` runs.

    The result of ``fn`` is dropped before returning, so tensors it returns count while
    they exist, inside the call. See :class:`TensorMemoryTracker` for what is counted.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    with TensorMemoryTracker() as tracker:
        fn(*args, **kwargs)
    return tracker.peak
