"""efficient_attention: exact and efficient attention in PyTorch, for the course.

Everything is importable from the top level::

    import efficient_attention as ea
    out = ea.softmax_attention(q, k, v, causal=True)
"""

from . import (
    attention,
    embeddings,
    fmm,
    kernels,
    linearized,
    lowrank,
    memory,
    models,
    nystrom,
    performer,
    purification,
    random_features,
    tiling,
)
from .attention import *  # noqa: F403
from .embeddings import *  # noqa: F403
from .fmm import *  # noqa: F403
from .kernels import *  # noqa: F403
from .linearized import *  # noqa: F403
from .lowrank import *  # noqa: F403
from .memory import *  # noqa: F403
from .models import *  # noqa: F403
from .nystrom import *  # noqa: F403
from .performer import *  # noqa: F403
from .purification import *  # noqa: F403
from .random_features import *  # noqa: F403
from .tiling import *  # noqa: F403

__version__ = "0.1.0"

# No module shares its name with a function it exports, so every package attribute
# named after a module is that module (``import efficient_attention.linearized as m``).
__all__ = sorted(
    {
        name
        for module in (
            attention,
            embeddings,
            fmm,
            kernels,
            linearized,
            lowrank,
            memory,
            models,
            nystrom,
            performer,
            purification,
            random_features,
            tiling,
        )
        for name in module.__all__
    }
)
