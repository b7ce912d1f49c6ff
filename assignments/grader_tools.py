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
    from torch.utils.flop_counter import flop_registry

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

    Tensor = torch_module.Tensor

    def tensors(tree, found=None):
        # The tensors in an operator's arguments or results (tensors, and tuples, lists and
        # dicts of them); much faster than torch.utils._pytree.tree_flatten, which the
        # measuring modes would otherwise call tens of thousands of times in one test.
        found = [] if found is None else found
        if isinstance(tree, Tensor):
            found.append(tree)
        elif isinstance(tree, (tuple, list)):
            for item in tree:
                if isinstance(item, Tensor):
                    found.append(item)
                elif isinstance(item, (tuple, list, dict)):
                    tensors(item, found)
        elif isinstance(tree, dict):
            tensors(tuple(tree.values()), found)
        return found

    def new_storages(args, kwargs, out):
        # (tensor, storage) for each output of an operator that holds new memory: not the
        # storage of an input (views and in-place results are free), not on the meta device.
        seen = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        for t in tensors(out):
            if t.device.type != "meta":
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

    aten = torch_module.ops.aten

    def elements(tree):
        # numel of every tensor in a nested structure: the logical size, so an expanded
        # (broadcast) view counts every element it presents, not its storage
        return sum(t.numel() for t in tensors(tree))

    # 2 per multiply-add: matrix products (positions of the two factors), matrix-vector and
    # dot products (position of the matrix or vector); other products (convolutions, fused
    # attention) by the formulas of torch.utils.flop_counter
    matrix_products = {aten.mm: (0, 1), aten.bmm: (0, 1), aten.addmm: (1, 2),
                       aten.baddbmm: (1, 2), aten.addbmm: (1, 2)}
    vector_products = {aten.mv: 0, aten.addmv: 1, aten.dot: 0, aten.vdot: 0}

    def product_flops(packet, args, kwargs, out):
        if packet in matrix_products:
            left, right = matrix_products[packet]
            return 2 * args[left].numel() * args[right].shape[-1]
        if packet in vector_products:
            return 2 * args[vector_products[packet]].numel()
        if packet in flop_registry:
            return flop_registry[packet](*args, **kwargs, out_val=out)
        return 0

    # operators that read only the entries their index picks out of their first input
    gathers = {aten.index, aten.index_select, aten.gather, aten.take, aten.embedding}
    # in-place operators that write only the entries their index picks out of their first input
    scatters = {aten.index_put_, aten._index_put_impl_, aten.index_copy_, aten.index_add_,
                aten.index_fill_, aten.scatter_, aten.scatter_add_, aten.scatter_reduce_}

    # operators whose tensor argument gives only the dtype, device and perhaps the shape
    templates = {aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
                 aten.new_empty_strided, aten.zeros_like, aten.ones_like, aten.empty_like,
                 aten.full_like, aten.rand_like, aten.randn_like, aten.randint_like}

    def operator_work(func, args, kwargs, out):
        # See work(): the counting rule.
        if func.is_view:
            return 0
        packet = func.overloadpacket
        if packet in templates:
            return elements(out)
        if packet in gathers:
            return elements((args[1:], kwargs)) + 2 * elements(out)
        if packet in scatters:
            return 2 * elements((args[1:], kwargs))
        touched = elements((args, kwargs)) + elements(out)
        return max(touched, product_flops(packet, args, kwargs, out))

    class _Cost(_Recording):
        # In one run: the work of every PyTorch operator run inside the block (the rule of
        # work()), the largest new storage (as _LargestStorage) and the number of operators.
        # Past a limit (None: none) every further operator raises, so a long run stops early.

        def __init__(self, name="the function", max_work=None, max_operators=None):
            super().__init__()
            self.name, self.max_work, self.max_operators = name, max_work, max_operators
            self.work, self.largest, self.operators = 0, 0, 0

        def check_limits(self):
            if self.max_work is not None and self.work > self.max_work:
                raise AssertionError(f"{self.name} did more than {self.max_work} units of work "
                                     f"(_grader.work says how operators are counted)")
            if self.max_operators is not None and self.operators > self.max_operators:
                raise AssertionError(f"{self.name} ran more than {self.max_operators} PyTorch "
                                     f"operators")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.operators += 1
            self.work += operator_work(func, args, kwargs, out)
            for t, storage in new_storages(args, kwargs, out):
                self.largest = max(self.largest, storage.nbytes() // t.element_size())
            self.check_limits()
            return out

    def work(fn, *args, **kwargs):
        """(fn(*args, **kwargs), the work of every PyTorch operator run during the call).

        Every operator PyTorch's dispatcher runs (composite functions such as matmul, einsum
        or reshape arrive as their parts: mm, bmm, views, copies) is counted:
        - a view (slicing, integer indexing, transpose, expand, Tensor.unfold, a reshape that
          does not copy, ...): 0, it reads and writes nothing;
        - a product (mm, bmm, addmm, baddbmm, addbmm: 2 n k m for (n, k) times (k, m); mv,
          addmv, dot: 2 per multiply-add; convolutions and fused attention kernels: the
          formulas of torch.utils.flop_counter): its floating-point operations, or the
          elements it reads and writes (below) if that is more;
        - an operator that makes a tensor like another (new_zeros, zeros_like, ...): its output;
        - an operator that picks entries by an index (indexing with a tensor, index_select,
          gather, take, embedding): its index tensors and twice its output; one that writes
          entries at an index in place (index_put_, index_copy_, scatter_, ...): twice its
          index and value tensors;
        - any other operator: the elements it reads and writes, i.e. the numel of every tensor
          argument (a broadcast or strided view counts every element it presents) plus the
          numel of every tensor it returns.
        So the (n, n) product of an (n, d) and a (d, n) matrix costs 2 n^2 d, a broadcast
        product and sum over d about as much (n^2 d written, n^2 d read, n^2 written), an
        n x n mask made with ones and tril 3 n^2, a cumsum along it 2 n^2. Work outside PyTorch
        operators (Python arithmetic, numpy) is not seen.
        """
        with _Cost() as record:
            result = fn(*args, **kwargs)
        return result, record.work

    def cost_within(max_work, max_operators, fn, *args, **kwargs):
        """(fn(*args, **kwargs), its cost) from one run, stopped as soon as it passes a limit.

        The cost has three fields: ``work`` (as work() counts it), ``largest`` (as
        largest_allocation() measures it) and ``operators`` (the number of PyTorch operators
        run). AssertionError as soon as the work exceeds max_work or the number of operators
        exceeds max_operators (None: no limit), and at the end if the function caught it.
        """
        with _Cost(getattr(fn, "__name__", "the function"), max_work, max_operators) as record:
            result = fn(*args, **kwargs)
        record.check_limits()
        return result, types.SimpleNamespace(work=record.work, largest=record.largest,
                                             operators=record.operators)

    class _Operators(_Recording):
        # The name of every PyTorch operator run inside the block, in order.

        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def operators(fn, *args, **kwargs):
        """(fn(*args, **kwargs), the names of the PyTorch operators run during the call).

        One name per operator run, in order ("aten.mm", "aten._softmax", ...); so len() of
        the list counts them (a loop over n items runs at least n) and a test can look for
        one that must not run (a library softmax in a hand-written one).
        """
        with _Operators() as record:
            result = fn(*args, **kwargs)
        return result, record.names

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

    # torch.testing.assert_close, less its first call's import of torch.distributed.tensor
    # (to unwrap DTensors, which no test passes): a second of CPU in every graded notebook.
    # Same checks and messages; torch's own function where its internals differ.
    try:
        from torch.testing import _comparison as comparison

        pair_types = (comparison.NonePair, comparison.BooleanPair, comparison.NumberPair,
                      comparison.TensorLikePair)
        close_error_metas = comparison.not_close_error_metas
    except (ImportError, AttributeError):  # pragma: no cover - another version of torch
        close_error_metas = None

    def assert_close(actual, expected, *, allow_subclasses=True, rtol=None, atol=None,
                     equal_nan=False, check_device=True, check_dtype=True, check_layout=True,
                     check_stride=False, msg=None):
        """torch.testing.assert_close (same arguments, checks and messages)."""
        options = dict(allow_subclasses=allow_subclasses, rtol=rtol, atol=atol,
                       equal_nan=equal_nan, check_device=check_device, check_dtype=check_dtype,
                       check_layout=check_layout, check_stride=check_stride, msg=msg)
        if close_error_metas is None:  # pragma: no cover - another version of torch
            return torch_module.testing.assert_close(actual, expected, **options)
        errors = close_error_metas(actual, expected, pair_types=pair_types, **options)
        if errors:
            raise errors[0].to_error(msg)

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
        assert_close=assert_close,
        allclose=torch_module.allclose,
        equal=torch_module.equal,
        isclose=math_module.isclose,
        isinstance=builtins.isinstance,
        check=check,
        largest_allocation=largest_allocation,
        peak_bytes=peak_bytes,
        work=work,
        cost_within=cost_within,
        operators=operators,
        seed=seed,
        generator=generator,
        TamperedError=TamperedError,
    )


_grader = _make_grader()
del _make_grader
