# Grader tools (read-only). Run this cell second, after the setup cell.
# The test cells check your answers with the private copies kept here, and verify before each
# test that torch, math and the builtins are the ones this cell saw; so nothing an answer cell
# does to a library changes what a test checks. Never use `_grader` in your answers: the
# integrity check rejects an answer cell that names it. Warnings are printed on stdout, so a
# warning shows under the cell but does not fail a test (nbgrader fails any output on stderr).


def _make_grader():
    import builtins
    import math as math_module
    import os
    import sys
    import types
    import warnings
    import weakref

    import torch as torch_module
    import torch.nn.functional as functional_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def show_warning(message, category, filename, lineno, file=None, line=None):
        sys.stdout.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show_warning

    watched = {
        "warnings": warnings,
        "builtins": builtins,
        "math": math_module,
        "torch": torch_module,
        "torch.testing": torch_module.testing,
        "torch.linalg": torch_module.linalg,
        "torch.nn.functional": functional_module,
        "torch.Tensor": torch_module.Tensor,
        "torch._C.TensorBase": torch_module._C.TensorBase,
    }
    try:
        import numpy as numpy_module

        watched["numpy"] = numpy_module
        watched["numpy.testing"] = numpy_module.testing
    except ImportError:  # pragma: no cover - numpy ships with torch's wheels
        pass

    class TamperedError(AssertionError):
        """An answer changed a library function the tests rely on."""

    def check():
        """Raise if any function of torch, math, numpy or the builtins was replaced."""
        for name, obj in watched.items():
            current = vars(obj)
            for key, value in snapshot[name].items():
                if current.get(key, value) is not value:
                    raise TamperedError(f"{name}.{key} was replaced after the setup cell")
                if key not in current:
                    raise TamperedError(f"{name}.{key} was deleted after the setup cell")

    def new_storages(args, kwargs, out):
        # (tensor, storage) for each output of an operator that holds new memory: not the
        # storage of an input (views and in-place results are free), not on the meta device.
        inputs = tree_flatten((args, kwargs))[0]
        seen = {t.untyped_storage().data_ptr() for t in inputs
                if isinstance(t, torch_module.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch_module.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    yield t, storage

    class _Recording(TorchDispatchMode):
        # By default the first operator inside a dispatch mode imports torch._dynamo (to keep
        # it out of __torch_dispatch__): tens of MB of Python objects, which a test's
        # tracemalloc window would count, and a second of CPU. Nothing here is compiled.

        @classmethod
        def _should_skip_dynamo(cls):
            return False

    class _LargestStorage(_Recording):
        # Largest new storage (in elements) created by any PyTorch operator in the block.

        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t, storage in new_storages(args, kwargs, out):
                self.largest = max(self.largest, storage.nbytes() // t.element_size())
            return out

    class _PeakBytes(_Recording):
        # Peak bytes held at once by the tensors created inside the block.

        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        def _release(self, key):
            self.live[key][1] -= 1
            if self.live[key][1] == 0:
                self.current -= self.live.pop(key)[0]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t, storage in new_storages(args, kwargs, out):
                key = storage.data_ptr()
                entry = self.live.setdefault(key, [storage.nbytes(), 0])
                if entry[1] == 0:
                    self.current += entry[0]
                    self.peak = max(self.peak, self.current)
                entry[1] += 1
                weakref.finalize(t, self._release, key)
            return out

    def largest_allocation(fn, *args, **kwargs):
        """(fn(*args, **kwargs), elements of the largest tensor storage created during the call)."""
        with _LargestStorage() as record:
            result = fn(*args, **kwargs)
        return result, record.largest

    def peak_bytes(fn, *args, **kwargs):
        """(fn(*args, **kwargs), peak bytes held at once by tensors created during the call)."""
        with _PeakBytes() as record:
            result = fn(*args, **kwargs)
        return result, record.peak

    def seed():
        """A fresh seed from the operating system: hidden inputs differ at every grading."""
        return int.from_bytes(os.urandom(7), "little")

    def generator():
        """A torch.Generator seeded by ``seed()``."""
        return torch_module.Generator().manual_seed(seed())

    # Importing torch._dynamo (torch.compile, an optimizer step ... do) replaces
    # torch.manual_seed by a wrapper, unless it was wrapped already. Wrap it here, before the
    # snapshot, as torch._dynamo would: a later import then changes nothing the check watches,
    # and no kernel pays a second for importing torch._dynamo up front.
    if torch_module.manual_seed is torch_module.random.manual_seed:
        import torch.jit._builtins as jit_builtins

        torch_module.manual_seed = torch_module._disable_dynamo(torch_module.manual_seed)
        jit_builtins._register_builtin(torch_module.manual_seed, "aten::manual_seed")
    # IPython rebinds these builtins at every execution (stdin forwarding, display hooks).
    kernel_managed = {"input", "getpass", "display", "get_ipython", "exit", "quit", "open",
                      "print", "help", "copyright", "credits", "license", "runfile"}
    snapshot = {
        name: {key: value for key, value in vars(obj).items()
               if not key.startswith("_") and not (name == "builtins" and key in kernel_managed)}
        for name, obj in watched.items()
    }

    return types.SimpleNamespace(
        assert_close=torch_module.testing.assert_close,
        allclose=torch_module.allclose,
        equal=torch_module.equal,
        isclose=math_module.isclose,
        isinstance=builtins.isinstance,
        check=check,
        largest_allocation=largest_allocation,
        peak_bytes=peak_bytes,
        seed=seed,
        generator=generator,
        TamperedError=TamperedError,
    )


_grader = _make_grader()
del _make_grader
