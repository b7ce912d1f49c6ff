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

from . import distributed, tensors, values
from .distributed import *  # noqa: F403
from .tensors import *  # noqa: F403
from .values import *  # noqa: F403
from .values import _check_number  # noqa: F401

__all__ = [*values.__all__, *tensors.__all__, *distributed.__all__]
