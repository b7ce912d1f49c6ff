"""Tensors: attention inputs, masks, block masks, a module's inputs, the compute dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "HALF_DTYPES",
    "compute_dtype",
    "check_tensor",
    "check_same_last_dim",
    "check_qkv",
    "check_shared_qk",
    "check_causal_lengths",
    "check_key_padding_mask",
    "check_block_mask",
    "check_module_input",
    "broadcast_shapes",
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


def broadcast_shapes(*shapes: tuple[int, ...] | torch.Size) -> torch.Size:
    """The shape the given shapes broadcast to (NumPy's rules), as ``torch.broadcast_shapes``.

    In plain Python: ``torch.broadcast_shapes`` imports sympy on its first call (about a
    second of CPU in every process that validates an input: each chapter's kernel, each
    rank of a distributed test). Raises ``RuntimeError`` (as torch does) when a dimension
    differs and neither is 1.
    """
    width = max((len(shape) for shape in shapes), default=0)
    result = [1] * width
    for shape in shapes:
        for axis, size in enumerate(shape, start=width - len(shape)):
            if size != 1:
                if result[axis] not in (1, size):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast: "
                                       f"{result[axis]} against {size} in dimension {axis}")
                result[axis] = size
    return torch.Size(result)


def _joined(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


def _check_together(tensors: dict[str, torch.Tensor]) -> None:
    """The inputs of one attention call, ``{name: (..., n, d)}``: broadcastable batch
    dimensions, one dtype, one device (the messages name every input)."""
    names = _joined(list(tensors))
    try:
        broadcast_shapes(*(t.shape[:-2] for t in tensors.values()))
    except RuntimeError as err:
        shapes = _joined([f"{n}.shape={tuple(t.shape)}" for n, t in tensors.items()])
        raise ValueError(
            f"{names} must have broadcastable batch dimensions (...), got {shapes}"
        ) from err
    if len({t.dtype for t in tensors.values()}) > 1:
        dtypes = _joined([str(t.dtype) for t in tensors.values()])
        raise TypeError(f"{names} must share one dtype, got {dtypes}")
    if len({t.device for t in tensors.values()}) > 1:
        devices = _joined([str(t.device) for t in tensors.values()])
        raise ValueError(f"{names} must be on one device, got {devices}")


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
    _check_together({"q": q, "k": k, "v": v})
    return q, k, v


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
    _check_together({"qk": qk, "v": v})
    return qk, v


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
