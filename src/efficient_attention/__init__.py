"""efficient_attention: exact and efficient attention in PyTorch, for the course.

Everything is importable from the top level::

    import efficient_attention as ea
    out = ea.softmax_attention(q, k, v, causal=True)
"""

import sys as _sys

from .attention import *  # noqa: F403
from .embeddings import *  # noqa: F403
from .fmm import *  # noqa: F403
from .kernels import *  # noqa: F403
from .linear_attention import *  # noqa: F403
from .lowrank import *  # noqa: F403
from .models import *  # noqa: F403
from .nystrom import *  # noqa: F403
from .performer import *  # noqa: F403
from .purification import *  # noqa: F403
from .random_features import *  # noqa: F403
from .tiling import *  # noqa: F403

__version__ = "0.1.0"

_MODULES = (
    "attention",
    "embeddings",
    "fmm",
    "kernels",
    "linear_attention",
    "lowrank",
    "models",
    "nystrom",
    "performer",
    "purification",
    "random_features",
    "tiling",
)

# Some modules share a name with a function they export (``linear_attention``), so the
# star-imports above rebind the package attribute to the function: read each module's
# ``__all__`` from ``sys.modules`` instead.
__all__ = sorted(
    {
        name
        for module in _MODULES
        for name in _sys.modules[f"{__name__}.{module}"].__all__
    }
)
