"""Plain values: flags, sizes, real parameters, choices, dtypes, generators."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "check_bool",
    "check_positive_int",
    "check_nonnegative_int",
    "check_even_positive_int",
    "check_nonnegative_ints",
    "check_real",
    "check_positive_float",
    "check_nonnegative_float",
    "check_fraction",
    "check_representable",
    "check_generator",
    "check_choice",
    "check_dtype",
    "check_optional_instance",
    "check_dim",
]


def _check_number(value: object, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return float(value)


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a ``bool`` (``"yes"``, ``1``, ``None`` are rejected)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return value


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


def check_even_positive_int(value: object, name: str) -> int:
    """Return ``value`` if it is a positive even ``int`` (bools rejected)."""
    value = check_positive_int(value, name)
    if value % 2:
        raise ValueError(f"{name} must be a positive even int, got {value}")
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


def check_representable(value: float, name: str, dtype: torch.dtype) -> float:
    """Return ``value`` if it is finite and within the range of the floating ``dtype``."""
    limit = torch.finfo(dtype).max
    if not (math.isfinite(value) and abs(value) <= limit):
        raise ValueError(
            f"{name} must be finite and within the range of {dtype} (|x| <= {limit:.3g}), "
            f"got {value:.6g}"
        )
    return value


def check_generator(generator: object) -> torch.Generator | None:
    """Return ``generator`` if it is ``None`` or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    return generator


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
