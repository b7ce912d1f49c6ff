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
    linear_attention,
    lowrank,
    models,
    nystrom,
    performer,
    purification,
    random_features,
)
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

__version__ = "0.1.0"

__all__ = sorted(
    set(
        attention.__all__
        + embeddings.__all__
        + fmm.__all__
        + kernels.__all__
        + linear_attention.__all__
        + lowrank.__all__
        + models.__all__
        + nystrom.__all__
        + performer.__all__
        + purification.__all__
        + random_features.__all__
    )
)
