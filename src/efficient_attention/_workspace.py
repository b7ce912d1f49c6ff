"""Buffers reused from block to block and, on the CPU, from call to call.

FAVOR+ (:mod:`._stabilised`, :mod:`.performer`) computes its features block by block.
Without autograd each block writes its rows, log-features and ``[v, 1]`` into buffers
that the next block overwrites: fresh multi-MiB tensors would each cost a page fault per
4 KiB on first touch, as much as the arithmetic. On the CPU the buffers are also kept
from one call to the next, per thread, up to ``WORKSPACE_BYTES`` in all, because memory
freed at the end of a call is often given back to the system (measured at ``n = 8192``,
8 heads: about 10,000 page faults per call without them, none with them).
"""

from __future__ import annotations

import math
import threading

import torch

WORKSPACE_BYTES = 64 * 2**20  # CPU buffers kept between calls, per thread
_WORKSPACE = threading.local()  # .buffers: {(name, dtype, device): flat tensor}


class Scratch:
    """Buffers reused from block to block: ``get(name, shape, like)`` is a contiguous
    tensor of ``shape`` with the dtype and device of ``like``, whose content the caller
    overwrites until its next ``get`` of the same name. Never used when autograd records
    (saved tensors must not change), and nothing of it is returned to the caller.

    CPU buffers are also kept from call to call, per thread, up to ``WORKSPACE_BYTES``
    in all (:func:`release_workspace` frees them): a fresh multi-MiB tensor costs a page
    fault per 4 KiB on first touch, and memory freed at the end of a call is often given
    back to the system, so that every call paid them again. Other devices have caching
    allocators: their buffers live for one call.
    """

    def __init__(self) -> None:
        self._call: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        key = (name, like.dtype, like.device)
        kept = _kept_buffers() if like.device.type == "cpu" else {}
        for store in (kept, self._call):
            flat = store.get(key)
            if flat is not None and flat.numel() >= size:
                return flat[:size].view(shape)
        kept.pop(key, None)  # too small: replaced
        used = sum(t.numel() * t.element_size() for t in kept.values())
        if like.device.type == "cpu" and used + size * like.element_size() <= WORKSPACE_BYTES:
            # a normal tensor even under torch.inference_mode: a later call outside it
            # may not write into an inference tensor
            with torch.inference_mode(False):
                flat = kept[key] = torch.empty(size, dtype=like.dtype, device=like.device)
        else:
            flat = self._call[key] = like.new_empty(size)
        return flat.view(shape)


def _kept_buffers() -> dict[tuple, torch.Tensor]:
    if not hasattr(_WORKSPACE, "buffers"):
        _WORKSPACE.buffers = {}
    return _WORKSPACE.buffers


def release_workspace() -> None:
    """Free the CPU buffers FAVOR+ keeps between calls in this thread (at most
    ``WORKSPACE_BYTES``; the next call makes them again)."""
    _kept_buffers().clear()
