"""Input validation shared by every module, and the one rule for compute dtypes.

Each helper raises ``TypeError`` (wrong kind of object) or ``ValueError`` (right kind,
wrong value) with a message that names the argument, what it got and what was
expected, so that a student who passes the wrong thing learns what to fix. Every
public function of the package validates through these helpers, so the same input
gets the same answer everywhere:

- tensors of attention inputs must be real floating point (no integer, bool or
  complex dtypes);
- flags are real ``bool`` values (``"yes"``, ``1`` or ``None`` are rejected);
- sizes are ``int`` (never ``bool``), counts ``>= 0`` or ``>= 1`` as stated;
- real parameters are finite numbers in the stated range;
- masks are bool tensors broadcastable to ``(..., n_k)``;
- a module's inputs have the dtype and device of its parameters (outside autocast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "HALF_DTYPES",
    "compute_dtype",
    "check_tensor",
    "check_same_last_dim",
    "check_qkv",
    "check_bool",
    "check_positive_int",
    "check_nonnegative_int",
    "check_real",
    "check_positive_float",
    "check_nonnegative_float",
    "check_fraction",
    "check_causal_lengths",
    "check_key_padding_mask",
    "check_generator",
    "check_module_input",
    "check_representable",
    "check_choice",
    "check_dtype",
    "check_nonnegative_ints",
    "SEQUENCE_LAYOUTS",
    "check_layout",
    "check_rank",
    "check_sequence_split",
    "check_shard_length",
    "check_process_group",
    "check_head_shards",
    "check_optional_instance",
    "check_dim",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype arithmetic is done in: the promoted dtype, float32 for half types.

    Half precision (float16, bfloat16) overflows at 65504 (float16) and keeps 3 (8-bit
    mantissa) significant digits, too few for exponentials and long sums; results are
    cast back to the input dtype by the caller.
    """
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return torch.float32 if dtype in HALF_DTYPES else dtype


def check_tensor(
    x: object,
    name: str,
    *,
    min_dim: int = 1,
    floating: bool = True,
    shape: str | None = None,
) -> torch.Tensor:
    """Return ``x`` if it is a tensor with at least ``min_dim`` dimensions.

    Raises ``TypeError`` for a non-tensor (``None`` included; the message states
    ``shape``, the expected shape in words, when given), and, when ``floating``, for any
    dtype that is not real floating point (integer, bool and complex tensors are
    rejected: the formulas of this package are for real numbers); ``ValueError`` for too
    few dimensions.
    """
    if not isinstance(x, torch.Tensor):
        expected = "a torch.Tensor" + ("" if shape is None else f" of shape {shape}")
        raise TypeError(f"{name} must be {expected}, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(
            f"{name} must be a real floating-point tensor (float16, bfloat16, float32 or "
            f"float64), got dtype {x.dtype}"
        )
    if x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s) (..., n, d), "
            f"got shape {tuple(x.shape)}"
        )
    return x


def check_same_last_dim(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    """Raise ``ValueError`` unless ``a`` and ``b`` share their feature dimension."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name_a} and {name_b} must have the same last dimension d, got "
            f"{name_a}.shape={tuple(a.shape)} and {name_b}.shape={tuple(b.shape)}"
        )


def check_qkv(q: object, k: object, v: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate queries ``(..., n_q, d)``, keys ``(..., n_k, d)``, values ``(..., n_k, d_v)``.

    Checks types (real floating point), rank (at least 2), ``d >= 1`` shared by q and k
    (with no feature the ``1/sqrt(d)`` scale is undefined), matching ``n_k`` of k and
    v, broadcastable batch dimensions, one dtype and one device. Any other size may be
    zero: the result is then empty (or, with ``n_k = 0``, the zero output of a query
    with no key).
    """
    q = check_tensor(q, "q", min_dim=2)
    k = check_tensor(k, "k", min_dim=2)
    v = check_tensor(v, "v", min_dim=2)
    check_same_last_dim(q, k, "q", "k")
    if q.shape[-1] == 0:
        raise ValueError(
            f"q and k must have at least one feature (d >= 1), got q.shape={tuple(q.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "k and v must have the same sequence length n_k (dimension -2), got "
            f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)}"
        )
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError as err:
        raise ValueError(
            "q, k and v must have broadcastable batch dimensions (...), got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        ) from err
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    return q, k, v


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a ``bool`` (``"yes"``, ``1``, ``None`` are rejected)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return value


def _check_number(value: object, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return float(value)


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive ``int`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_nonnegative_int(value: object, name: str) -> int:
    """Return ``value`` if it is an ``int`` >= 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be a non-negative int, got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def check_real(value: object, name: str) -> float:
    """Return ``float(value)`` for any real number, NaN and infinities included.

    For parameters whose non-finite values propagate through the formula as they
    would in PyTorch (a NaN ``scale`` gives NaN scores, as in SDPA).
    """
    return _check_number(value, name, "a real number")


def check_positive_float(value: object, name: str) -> float:
    """Return ``float(value)`` if it is a finite real number > 0."""
    value = _check_number(value, name, "a positive number")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


def check_nonnegative_float(value: object, name: str) -> float:
    """Return ``float(value)`` if it is a finite real number >= 0."""
    value = _check_number(value, name, "a number >= 0")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def check_fraction(value: object, name: str) -> float:
    """Return ``float(value)`` if it lies strictly between 0 and 1."""
    value = _check_number(value, name, "a number in (0, 1)")
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")
    return value


def check_causal_lengths(n_q: int, n_k: int) -> None:
    """Causal attention pairs query ``i`` with keys ``j <= i``: it needs ``n_q == n_k``."""
    if n_q != n_k:
        raise ValueError(f"causal=True needs as many queries as keys, got n_q={n_q} and n_k={n_k}")


def check_key_padding_mask(
    mask: object, key_shape: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """Validate a key padding mask against keys of shape ``(..., n_k, d)``.

    The mask is a bool tensor broadcastable to ``key_shape[:-1]`` (that is
    ``(..., n_k)``; e.g. ``(b, 1)`` for ``(b, n_k)`` masks every key of batch element
    ``b`` alike) and ``True`` where the key is padding. Returns the mask broadcast to
    ``key_shape[:-1]`` (a view), or ``None`` when no mask was given.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool torch.Tensor, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must have dtype torch.bool (True = padding), got {mask.dtype}"
        )
    target = tuple(key_shape[:-1])
    try:
        out = torch.broadcast_to(mask, target)
    except RuntimeError as err:
        raise ValueError(
            f"key_padding_mask must be broadcastable to the keys' {target} (..., n_k), "
            f"got shape {tuple(mask.shape)}"
        ) from err
    if mask.device != device:
        raise ValueError(
            f"key_padding_mask must be on the keys' device {device}, got {mask.device}"
        )
    return out


def check_generator(generator: object) -> torch.Generator | None:
    """Return ``generator`` if it is ``None`` or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    return generator


# --- sparse selection (issue 28): block masks, hash parameters, shared query-key ---------


def check_even_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive even ``int`` (bools rejected)."""
    value = check_positive_int(value, name)
    if value % 2:
        raise ValueError(f"{name} must be a positive even int, got {value}")
    return value


def check_block_mask(
    mask: object, batch: Sequence[int], num_blocks: tuple[int, int], device: torch.device,
    name: str = "block_mask",
) -> torch.Tensor:
    """Validate a block mask: bool ``(..., nb_q, nb_k)``, ``True`` = the block is attended.

    The last two dimensions must be exactly ``num_blocks`` and the leading ones must
    broadcast to ``batch`` (the batch dimensions of the queries, keys and values).
    Returns the mask broadcast to ``(*batch, nb_q, nb_k)`` (a view).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must have dtype torch.bool (True = attend to the block), got {mask.dtype}"
        )
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != tuple(num_blocks):
        raise ValueError(
            f"{name} must have shape (..., {num_blocks[0]}, {num_blocks[1]}) (query blocks, "
            f"key blocks: ceil(n / block_size) each), got shape {tuple(mask.shape)}"
        )
    target = (*batch, *num_blocks)
    try:
        out = torch.broadcast_to(mask, target)
    except RuntimeError as err:
        raise ValueError(
            f"{name} must be broadcastable to {target} (the batch dimensions of q, k and v, "
            f"then the blocks), got shape {tuple(mask.shape)}"
        ) from err
    if mask.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {mask.device}")
    return out


def check_shared_qk(qk: object, v: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shared queries-keys ``qk (..., n, d)`` with ``d >= 1`` and values
    ``(..., n, d_v)``: same ``n``, broadcastable batch dimensions, one dtype, one device."""
    qk = check_tensor(qk, "qk", min_dim=2)
    v = check_tensor(v, "v", min_dim=2)
    if qk.shape[-1] == 0:
        raise ValueError(
            f"qk must have at least one feature (d >= 1), got qk.shape={tuple(qk.shape)}"
        )
    if qk.shape[-2] != v.shape[-2]:
        raise ValueError(
            "qk and v must have the same sequence length n (dimension -2), got "
            f"qk.shape={tuple(qk.shape)} and v.shape={tuple(v.shape)}"
        )
    try:
        torch.broadcast_shapes(qk.shape[:-2], v.shape[:-2])
    except RuntimeError as err:
        raise ValueError(
            "qk and v must have broadcastable batch dimensions (...), got "
            f"qk.shape={tuple(qk.shape)} and v.shape={tuple(v.shape)}"
        ) from err
    if qk.dtype != v.dtype:
        raise TypeError(f"qk and v must share one dtype, got {qk.dtype} and {v.dtype}")
    if qk.device != v.device:
        raise ValueError(f"qk and v must be on one device, got {qk.device} and {v.device}")
    return qk, v


def check_module_input(x: torch.Tensor, name: str, module: torch.nn.Module) -> torch.Tensor:
    """Return ``x`` if it has the dtype and device of ``module``'s parameters.

    ``TypeError`` for another dtype (e.g. float64 inputs to a float32 module, which torch
    reports as a matmul error deep inside), except under ``torch.autocast``, which casts;
    ``ValueError`` for another device. A module without parameters takes anything.
    """
    parameter = next(module.parameters(), None)
    if parameter is None:
        return x
    if x.dtype != parameter.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name} must have the dtype of the module's parameters ({parameter.dtype}), "
            f"got {x.dtype}: convert the inputs (.to({parameter.dtype})) or the module "
            f"(.to({x.dtype}))"
        )
    if x.device != parameter.device:
        raise ValueError(
            f"{name} must be on the device of the module's parameters ({parameter.device}), "
            f"got {x.device}: move the inputs or the module (.to(device))"
        )
    return x


def check_representable(value: float, name: str, dtype: torch.dtype) -> float:
    """Return ``value`` if it is finite and within the range of the floating ``dtype``."""
    limit = torch.finfo(dtype).max
    if not (math.isfinite(value) and abs(value) <= limit):
        raise ValueError(
            f"{name} must be finite and within the range of {dtype} (|x| <= {limit:.3g}), "
            f"got {value:.6g}"
        )
    return value


# --- context parallelism (issue 28): layouts, ranks, process groups, head shards ---------

SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is one of :data:`SEQUENCE_LAYOUTS`."""
    if not isinstance(layout, str):
        raise TypeError(
            f"layout must be a str, one of {SEQUENCE_LAYOUTS}, got {type(layout).__name__} "
            f"{layout!r}"
        )
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}")
    return layout


def check_rank(rank: object, world_size: int) -> int:
    """Return ``rank`` if it is an ``int`` in ``[0, world_size)``."""
    rank = check_nonnegative_int(rank, "rank")
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}), got {rank}")
    return rank


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_sequence_split(n: int, world_size: int, layout: str, name: str) -> None:
    """A sequence of ``n`` tokens splits into ``world_size`` equal shards: ``n`` divisible by
    ``world_size`` (contiguous) or by ``2 world_size`` (zigzag: two chunks per rank)."""
    parts = world_size * _chunks_per_rank(layout)
    if n % parts:
        raise ValueError(
            f"{name} must have a sequence length divisible by {parts} ({layout} layout over "
            f"world_size={world_size}: {_chunks_per_rank(layout)} equal chunk(s) per rank), "
            f"got n={n}"
        )


def check_shard_length(n_shard: int, layout: str, name: str) -> None:
    """A rank's shard holds at least one token; in the zigzag layout an even number (its
    two chunks, ``i`` and ``2p - 1 - i``, have one length)."""
    if n_shard < 1:
        raise ValueError(
            f"{name} must hold at least one token of the sequence (dimension -2), got "
            f"{name}.shape[-2]={n_shard}"
        )
    if layout == "zigzag" and n_shard % 2:
        raise ValueError(
            f"{name} must hold an even number of tokens in the zigzag layout (two equal "
            f"chunks per rank), got {name}.shape[-2]={n_shard}"
        )


def check_process_group(group: object) -> object:
    """Return the process group to use: ``group``, or the default group for ``None``.

    ``RuntimeError`` when ``torch.distributed`` is unavailable or not initialised (call
    ``torch.distributed.init_process_group`` first, on every rank) or when this process is
    not a member of ``group``; ``TypeError`` when ``group`` is not a process group.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("context parallelism needs torch.distributed, which this build of "
                           "PyTorch does not provide")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on CUDA) on every rank before any distributed "
            "attention, or pass tensors to a single-device function instead"
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # from new_group
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of group: "
            "torch.distributed.new_group returned NON_GROUP_MEMBER on this rank"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), "
            f"got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise RuntimeError(
            f"this process (global rank {dist.get_rank()}) is not a member of group"
        )
    return group


def check_head_shards(batch: Sequence[int], world_size: int) -> int:
    """Heads for head parallelism: the last of the batch dimensions ``batch`` of q, k and v
    (broadcast; shapes ``(..., h, n, d)``), divisible by ``world_size``. Returns ``h``."""
    if len(batch) < 1:
        raise ValueError(
            "q, k and v must have a heads dimension, shape (..., h, n, d), got no dimension "
            "before the sequence"
        )
    heads = batch[-1]
    if heads < 1 or heads % world_size:
        raise ValueError(
            f"the number of heads h (dimension -3 of q, k and v) must be divisible by the "
            f"world size to split heads across ranks, got h={heads} and "
            f"world_size={world_size}"
        )
    return heads


def check_optional_instance(value: object, cls: type, name: str) -> object:
    """Return ``value`` if it is ``None`` or an instance of ``cls``."""
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")
    return value


def check_dim(dim: object, ndim: int, name: str = "dim") -> int:
    """Return ``dim`` as a non-negative index if it names a dimension of an ``ndim``-d
    tensor (``-ndim <= dim < ndim``; bools rejected)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__} {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name} must lie in [-{ndim}, {ndim}) for a {ndim}-d tensor, got {dim}"
        )
    return dim % ndim


# --- serving caches (issue 27.4): choices, dtypes, lists of ids or lengths ----------------


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of the strings ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {tuple(choices)}, got "
                        f"{type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_dtype(value: object, name: str, *, floating: bool = False) -> torch.dtype:
    """Return ``value`` if it is a ``torch.dtype`` (real floating point when ``floating``)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(value).__name__} {value!r}")
    if floating and (not value.is_floating_point or value.is_complex):
        raise TypeError(f"{name} must be a real floating-point dtype (float16, bfloat16, "
                        f"float32 or float64), got {value}")
    return value


def check_nonnegative_ints(values: object, name: str, *, distinct: bool = False) -> list[int]:
    """Return ``values``, a list or tuple of ``int`` >= 0 (bools rejected), as a list;
    with ``distinct``, no value may repeat."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of ints >= 0, got "
                        f"{type(values).__name__}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints >= 0, got {type(x).__name__} {x!r} in "
                            f"{list(values)}")
        if x < 0:
            raise ValueError(f"{name} must hold ints >= 0, got {x} in {list(values)}")
    if distinct and len(set(values)) != len(values):
        raise ValueError(f"{name} must not repeat a value, got {list(values)}")
    return list(values)
