"""Public implementations timed beside the library's, when they can be imported.

Neither package is a dependency of the project. Install them into a scratch folder (never
into ``.venv``) and put that folder on ``PYTHONPATH`` for the benchmark command only::

    .venv/bin/python -m pip install --no-deps --target /tmp/peers \\
        nystrom-attention==0.0.14 performer-pytorch==1.1.4 einops==0.8.2 \\
        local-attention==1.4.4 axial-positional-embedding==0.3.12
    PYTHONPATH=/tmp/peers .venv/bin/python benchmarks/attention_speed.py

(``performer-pytorch`` imports ``local_attention`` and ``axial_positional_embedding`` at
import time; local-attention 1.4.4 is the last release that needs nothing more.) Each
loader returns ``None`` when its package is missing, so that the benchmark skips the peer
and says so.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch

NYSTROM_PKG = "nystrom-attention pkg core (64)"
PERFORMER_PKG = "performer-pytorch FastAttention"
PERFORMER_PKG_CAUSAL = "performer-pytorch FastAttention causal"


def nystrom_package_core(heads: int, head_dim: int, landmarks: int):
    """The Nystromformer core of the public ``nystrom-attention`` package (lucidrains).

    Its ``NystromAttention`` module projects ``x`` to q, k, v, runs the core (segment-mean
    landmarks, three softmaxes, its iterative pseudo-inverse) and projects back. With
    ``to_qkv`` and ``to_out`` replaced by identities and no residual convolution, one call
    on the packed ``[q | k | v]`` of shape ``(1, n, 3 * heads * d)`` is the core alone: the
    same computation as ``ea.nystrom_attention`` with the same landmarks and iterations.
    """
    try:
        from nystrom_attention import NystromAttention
    except ImportError:
        return None
    module = NystromAttention(dim=heads * head_dim, dim_head=head_dim, heads=heads,
                              num_landmarks=landmarks, pinv_iterations=6, residual=False)
    module.to_qkv = torch.nn.Identity()
    module.to_out = torch.nn.Identity()
    return module.eval()


def pack_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q, k, v (1, heads, n, d)`` as the Nystrom package's input ``(1, n, 3 * heads * d)``."""
    n = q.shape[-2]
    return torch.cat([t.transpose(1, 2).reshape(1, n, -1) for t in (q, k, v)], dim=-1)


def performer_package_attention(w: torch.Tensor, causal: bool):
    """``performer_pytorch.FastAttention`` with the given ``(m, d)`` frequencies, or ``None``.

    The package's softmax kernel is FAVOR+ with positive features (``d^-1/4`` scaling, the
    ``exp(w^T x - |x|^2 / 2)`` features, a max subtracted for stability), called on
    ``(batch, heads, n, d)`` tensors like ``ea.favor_attention``; with our frequencies
    copied into its buffer both compute the same estimate. Without the optional CUDA
    extension its causal form is the package's own prefix-sum fallback (128 chunks, each
    materialising the ``(chunk, m, d)`` running states), which its constructor announces
    on stdout; that message is swallowed here.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its `distutils` version check is deprecated
            from performer_pytorch import FastAttention
    except ImportError:
        return None
    m, d = w.shape
    with contextlib.redirect_stdout(io.StringIO()):
        module = FastAttention(dim_heads=d, nb_features=m, causal=causal)
    module.projection_matrix.copy_(w)
    return module.eval()
