"""Input validation shared by every module.

Each helper raises ``TypeError`` or ``ValueError`` with a message that names the
argument, what it got and what was expected, so that a student who passes the
wrong thing learns what to fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_tensor",
    "check_same_last_dim",
    "check_qkv",
    "check_positive_int",
    "check_nonnegative_int",
    "check_positive_float",
    "check_key_padding_mask",
    "check_generator",
]


def check_tensor(
    x: object,
    name: str,
    *,
    min_dim: int = 1,
    floating: bool = True,
) -> torch.Tensor:
    """Return ``x`` if it is a tensor with at least ``min_dim`` dimensions.

    Raises ``TypeError`` for a non-tensor (or a non-floating tensor when
    ``floating``) and ``ValueError`` for too few dimensions.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
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

    Checks types, rank (at least 2), matching ``d`` of q and k, matching ``n_k`` of
    k and v, broadcastable batch dimensions, one dtype and one device.
    """
    q = check_tensor(q, "q", min_dim=2)
    k = check_tensor(k, "k", min_dim=2)
    v = check_tensor(v, "v", min_dim=2)
    check_same_last_dim(q, k, "q", "k")
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


def check_positive_float(value: object, name: str) -> float:
    """Return ``float(value)`` if it is a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


def check_key_padding_mask(
    mask: object, key_shape: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """Validate a key padding mask against keys of shape ``(..., n_k, d)``.

    The mask is a bool tensor broadcastable to ``key_shape[:-1]`` (that is
    ``(..., n_k)``) and ``True`` where the key is padding. Returns the mask
    broadcast to ``key_shape[:-1]``, or ``None`` when no mask was given.
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
    n_k = target[-1]
    if mask.dim() == 0 or mask.shape[-1] != n_k:
        raise ValueError(
            f"key_padding_mask must be broadcastable to {target} (..., n_k) with n_k={n_k}, "
            f"got shape {tuple(mask.shape)}"
        )
    try:
        out = torch.broadcast_to(mask, target)
    except RuntimeError as err:
        raise ValueError(
            f"key_padding_mask must be broadcastable to {target} (..., n_k), "
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
