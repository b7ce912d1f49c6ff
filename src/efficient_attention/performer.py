"""Performer attention: FAVOR+ (Fast Attention Via positive Orthogonal Random features).

Softmax attention ``softmax(q k^T / sqrt(d)) v`` weighs key ``j`` by
``exp(q~_i^T k~_j)`` with ``q~ = d^-1/4 q`` and ``k~ = d^-1/4 k``. Random features give
``exp(q~^T k~) ~ phi(q~)^T phi(k~)``, and then attention is linear in ``n``:

    out = D^-1 phi(Q~) (phi(K~)^T V),   D = diag(phi(Q~) phi(K~)^T 1).

Stabilisation. The features contain exponentials that overflow or underflow for
large inputs. Write the weight of key ``j`` for query ``i`` as
``W_ij = sum_l exp(a_il + b_jl)`` (positive features: ``a_il = w_l^T q~_i``,
``b_jl = w_l^T k~_j - |k~_j|^2 / 2``; the row constants of the queries are dropped).
:func:`favor_attention` computes, in the log domain,

    phi_k(k_j)_l = exp(b_jl - c_l),             one constant c_l per feature,
    phi_q(q_i)_l = softmax_l(a_il + c_l),       i.e. exp(a_il + c_l - M_i),

so that ``phi_q(q_i)^T phi_k(k_j) = exp(-M_i) W_ij``: one factor per query, which cancels
between numerator and denominator, whatever the constants. They are chosen so that
nothing is lost: ``c_l`` never exceeds the largest ``b_jl`` among the keys a query
sees (unpadded, and ``j <= i`` when causal), so each query's largest term is at least
``1 / m`` (no 0 / 0, whatever the norms), and no sum of key features overflows. It
starts at the first key's ``b_j`` and is raised only when a block of keys would
overflow (the running sums are then rescaled feature by feature, ``S_l <-
exp(c_l^old - c_l^new) S_l``, as in online softmax; causal blocks take the raise from
their first key, and are split in two when that is not enough). The constants are
folded into the products that make ``a`` and ``b`` (an extra column each), so
stabilising costs no pass over the features. These are identities, so the result does
not depend on ``block_size`` or ``chunk_size`` beyond rounding. A key constant that
depended on ``j`` would reweigh the keys; one that included keys a query may not see
(future keys) could flush every term of that query to 0 -- both are avoided. Details
in :mod:`efficient_attention._stabilised`.

Reference: Choromanski et al., "Rethinking Attention with Performers", ICLR 2021.
"""

from __future__ import annotations

import torch
from torch import nn

from ._blockwise import check_block_sizes, default_block_size, flatten_batch
from ._checks import (
    check_bool,
    check_causal_lengths,
    check_generator,
    check_key_padding_mask,
    check_nonnegative_int,
    check_positive_int,
    check_qkv,
    check_tensor,
    compute_dtype,
)
from ._stabilised import LN2, LOG2E, stabilised_attention
from ._workspace import Scratch
from .random_features import gaussian_random_matrix

__all__ = ["favor_attention", "FavorAttention"]

FEATURE_KINDS = ("positive", "trig", "hyperbolic")


def _check_features(features: object) -> str:
    if features not in FEATURE_KINDS:
        raise ValueError(f"features must be one of {FEATURE_KINDS}, got {features!r}")
    return features  # type: ignore[return-value]


def _check_w(w: object, d: int, device: torch.device) -> torch.Tensor:
    w = check_tensor(w, "w", min_dim=2)
    if w.dim() != 2 or w.shape[-1] != d or w.shape[0] == 0:
        raise ValueError(
            f"w must have shape (m, d) with m >= 1 and d={d} like q and k, got {tuple(w.shape)}"
        )
    if w.device != device:
        raise ValueError(f"w must be on the device of q ({device}), got {w.device}")
    return w


class _LogFeatures:
    """The log-features of one call, as :mod:`._stabilised` takes them.

    ``w`` are the frequencies already multiplied by ``d^-1/4`` (in the compute dtype):
    ``w^T x~ = (d^-1/4 w)^T x``. Hyperbolic features use ``[w; -w]``. Each block's
    log-features, the per-feature constant ``c`` included, are one product with no pass
    of their own, on rows with extra columns: ``[q, 1] [w, c]^T = q w^T + c`` and, in
    base 2 (``_stabilised`` takes the key logs in base 2, the constants ``c' = log2 e
    c`` too), ``[k, |k|^2, 1] [log2 e w, -log2 e d^-1/2 / 2, -c']^T = log2 e (w^T k~ -
    |k~|^2 / 2 - c)``. The rows are made once per call (:meth:`rows`: one pass each, not
    one per block); without autograd they and each block's products are written into
    buffers reused from block to block and from call to call (``_workspace.Scratch``).
    """

    def __init__(self, w: torch.Tensor, kind: str, scale: float, recording: bool) -> None:
        self.kind, self.recording = kind, recording  # recording: autograd records this call
        w = torch.cat([w, -w]) if kind == "hyperbolic" else w  # (w', d)
        self.w_t = w.transpose(-2, -1).contiguous()  # (d, w')
        zero = torch.zeros_like(self.w_t[:1])
        self.query_weights = torch.cat([self.w_t, zero])  # (d + 1, w'): rows [q, 1]
        self.key_weights = LOG2E * torch.cat(
            [self.w_t, zero - 0.5 * scale**2, zero])  # (d + 2, w'): rows [k, |k|^2, 1]
        self.half_scale_sq_log2 = LOG2E * 0.5 * scale**2
        self._buffers: dict[str, torch.Tensor] = {}
        self._query_cache: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self.scratch = None if recording else Scratch()

    def _weights(self, name: str, last_row: torch.Tensor) -> torch.Tensor:
        """The weights ``(B, e, w')`` of ``name`` with ``last_row (B, 1, w')`` as last row.
        Without autograd the row is rewritten in a buffer: no new weights per block."""
        base = getattr(self, name)
        if self.recording:
            return torch.cat([base[:-1].expand(last_row.shape[0], -1, -1), last_row], dim=-2)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] != last_row.shape[0]:
            buffer = self._buffers[name] = base.expand(last_row.shape[0], -1, -1).clone()
        buffer[:, -1:].copy_(last_row)
        return buffer

    def rows(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the maps take, made once per call (no pass of their own per block):
        ``[q, 1]`` ``(B, n_q, d + 1)`` and ``[k, |k|^2, 1]`` ``(B, n_k, d + 2)`` for
        positive and hyperbolic features; ``q`` and ``k`` as they are for trig ones."""
        q, k = q.to(self.w_t.dtype), k.to(self.w_t.dtype)
        if self.kind == "trig":
            return q, k
        one = q.new_ones(())
        square_norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True).square()  # |k|^2
        return (self._cat("query rows", [q, one.expand(*q.shape[:-1], 1)]),
                self._cat("key rows", [k, square_norm, one.expand(*k.shape[:-1], 1)]))

    def _cat(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(parts, -1)``, into buffer ``name`` without autograd."""
        if self.scratch is None:
            return torch.cat(parts, dim=-1)
        shape = (*parts[0].shape[:-1], sum(part.shape[-1] for part in parts))
        return torch.cat(parts, dim=-1, out=self.scratch.get(name, shape, parts[0]))

    def _product(self, name: str, rows: torch.Tensor, weights: torch.Tensor):
        """``rows @ weights`` ``(B, b, w')``, into buffer ``name`` without autograd."""
        if self.scratch is None:
            return torch.bmm(rows, weights)
        shape = (rows.shape[0], rows.shape[1], weights.shape[-1])
        return torch.bmm(rows, weights, out=self.scratch.get(name, shape, rows))

    def queries(self, rows: torch.Tensor, constant: torch.Tensor | None):
        """``(log, signed)`` of query rows ``(B, b, .)`` (:meth:`rows`) up to a row
        constant, with ``constant (B, 1, w')`` added. Positive, hyperbolic: ``log = q w^T
        + constant``. Trig: ``signed = [cos, sin](q w^T)`` (its constant is one number per
        batch row, which cancels). ``exp(-|q~|^2 / 2)`` (``exp(|q~|^2 / 2)`` for trig) and
        ``1/sqrt(m)`` are the same for every feature of a row: dropped."""
        if self.kind == "trig":
            proj = rows @ self.w_t  # (B, b, w')
            return None, torch.cat([proj.cos(), proj.sin()], dim=-1)
        if constant is None:
            return rows[..., :-1] @ self.w_t, None
        cached, weights = self._query_cache  # causal blocks that keep their constant
        if constant is not cached or self.recording:  # base-2 constant -> base e
            weights = self._weights("query_weights", LN2 * constant)  # (B, d + 1, w')
            self._query_cache = (constant, weights)
        return self._product("query logs", rows, weights), None  # (B, b, w')

    def keys(self, rows: torch.Tensor, constant: torch.Tensor | None):
        """``(log, signed)`` of key rows ``(B, b, .)`` (:meth:`rows`, up to ``1/sqrt(m)``)
        in base 2, with ``constant`` (base 2) subtracted. Positive, hyperbolic: ``log =
        log2 e (w^T k~ - |k~|^2 / 2) - constant``. Trig: ``log = log2 e |k~|^2 / 2 -
        constant`` (one per key, ``(B, b, 1)``) and ``signed = [cos, sin](w^T k~)``."""
        if self.kind == "trig":
            square_norm = torch.linalg.vector_norm(rows, dim=-1, keepdim=True).square()
            proj = rows @ self.w_t  # (B, b, m)
            log = self.half_scale_sq_log2 * square_norm
            signed = torch.cat([proj.cos(), proj.sin()], dim=-1)
            return (log if constant is None else log - constant), signed
        if constant is None:  # (one key row at a time: no buffer)
            return rows @ self.key_weights, None
        weights = self._weights("key_weights", -constant)  # (B, d + 2, w')
        return self._product("key logs", rows, weights), None


def favor_block_size(batch: int, width: int, n: int, causal: bool = False) -> int:
    """Default rows per block of :func:`favor_attention`: about ``2^20`` numbers (4 MiB
    in float32) per intra-op thread (``torch.get_num_threads()``), half that for the
    causal forward pass (``causal``; :func:`favor_attention` passes it without autograd).

    Each block costs several parallel operations (products, ``exp``, softmax; causal
    blocks fifteen). When idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) each
    of them first wakes a thread, 60-90 microseconds on a two-core virtual machine, so
    fewer blocks pay; with the work split between the threads, each still handles a few
    MiB that stay in cache. Causal blocks also hold their chunk states and prefixes
    (``b m (d_v + 1) / C`` numbers each, as many as the features), so they get half the
    rows.
    Measured with ``benchmarks/attention_speed.py``'s setting (``n = 8192``, 8 heads,
    ``m = 256``, 2 threads): bidirectional, 1024-row blocks were clearly faster than
    512-row ones with sleeping threads and as fast with spinning ones, and 2048-row
    blocks slower with spinning threads; causal forward, 512-row blocks were 5-15 %
    faster than 1024-row ones with spinning threads and about as fast with sleeping
    ones; a causal training step was faster with 1024-row blocks.
    """
    threads = max(1, torch.get_num_threads())
    numbers = 2**20 * threads // (2 if causal else 1)
    return default_block_size(batch, width, n, numbers=numbers)


def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    features: str = "positive",
    chunk_size: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    r"""Random-feature approximation of ``softmax(q k^T / sqrt(d)) v`` (Performer, FAVOR+).

    .. math:: \mathrm{out} = D^{-1} \phi(\tilde Q) (\phi(\tilde K)^\top V), \quad
              D = \mathrm{diag}(\phi(\tilde Q) \phi(\tilde K)^\top 1), \quad
              \tilde Q = d^{-1/4} Q, \ \tilde K = d^{-1/4} K,

    with ``phi`` one of the unbiased estimators of ``exp(x^T y)`` from
    :mod:`efficient_attention.random_features` built on the rows of ``w``. The
    features are stabilised internally by constants that cancel (see the module
    docstring): the output equals the unstabilised formula but nothing overflows, and
    a query with at least one unmasked key never gets a zero row from underflow.
    Padded keys (even holding NaN or inf) are in neither the numerator nor the
    normaliser, nor in any maximum; a query with no unmasked key gets zeros. Other NaN
    inputs give NaN outputs.

    Args:
        q: queries ``(..., n_q, d)``.
        k: keys ``(..., n_k, d)``.
        v: values ``(..., n_k, d_v)``.
        w: random frequencies ``(m, d)`` with ``N(0, I)`` rows, e.g.
            ``gaussian_random_matrix(m, d, orthogonal=True)``.
        causal: query ``i`` sees keys ``j <= i`` (chunked prefix sums, ``n_q == n_k``).
        key_padding_mask: bool, broadcastable to ``(..., n_k)``, ``True`` = padding.
        features: ``"positive"`` (FAVOR+, ``m`` features), ``"hyperbolic"`` (positive,
            ``2m``) or ``"trig"`` (``2m``; can give negative or tiny normalisers).
        chunk_size: chunk length ``C`` of the causal prefix sums (default: the power of
            two ``>= m d_v / (m + d_v)``, at least 16).
        block_size: rows of features computed at a time (default: about ``2^20``
            numbers per block and per intra-op thread, at least 64 rows; see
            :func:`favor_block_size`); changes speed and memory, not the result beyond
            rounding.

    Returns:
        ``(..., n_q, d_v)`` in the dtype of ``q``; half inputs are computed in float32.

    Cost: time ``O(n m (d + d_v))`` (+ ``O(n C (m + d_v))`` causal). Memory without
    autograd: the output, the rows ``[q, 1]`` and ``[k, |k|^2, 1]`` (the size of ``q``
    and ``k``) and one block of features, ``O(n (d + d_v) + b m)`` (on the CPU these
    buffers, up to 64 MiB per thread, are kept for the next call:
    ``_workspace.release_workspace`` frees them); with autograd the features ``O(n m)``
    and, when causal, one ``m x d_v`` state per chunk.
    """
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    mask = check_key_padding_mask(key_padding_mask, k.shape, k.device)
    w = _check_w(w, q.shape[-1], q.device)
    kind = _check_features(features)
    if causal:
        check_causal_lengths(q.shape[-2], k.shape[-2])
    check_block_sizes(chunk_size, block_size)
    dtype = compute_dtype(q, w)
    scale = q.shape[-1] ** -0.25
    w = w.to(dtype) * scale  # (m, d): (d^-1/4 x) w^T = x (d^-1/4 w)^T, no copy of q or k
    batch, (q3, k3, v3, mask2) = flatten_batch(q, k, v, mask)
    width = w.shape[0] * (1 if kind == "positive" else 2)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w))
    size = block_size or favor_block_size(q3.shape[0], width, q.shape[-2],
                                          causal and not recording)
    features_of = _LogFeatures(w, kind, scale, recording)
    q_rows, k_rows = features_of.rows(q3, k3)
    out = stabilised_attention(
        q_rows,
        k_rows,
        v3.to(dtype),
        features_of.queries,
        features_of.keys,
        causal=causal,
        mask=mask2,
        block_size=size,
        chunk_size=chunk_size,
        recording=recording,
    )
    return out.reshape(*batch, q.shape[-2], v.shape[-1]).to(q.dtype)


class FavorAttention(nn.Module):
    """Performer attention with its random matrix held as a buffer and redrawn in training.

    Args:
        dim_head: ``d``, the size of each head's queries and keys.
        num_features: ``m``, the number of random frequencies.
        orthogonal: draw orthogonal blocks (lower variance, Performers' Theorem 2).
        redraw_interval: in training mode, draw a new ``w`` every ``redraw_interval``
            forward calls (calls ``0..r-1`` use the first draw, calls ``r..2r-1`` the
            second, ...); ``None`` or ``0`` never redraws. In eval mode ``w`` never
            changes, so evaluation is deterministic.
        features: ``"positive"``, ``"hyperbolic"`` or ``"trig"``, see
            :func:`favor_attention`.
        generator: a CPU ``torch.Generator`` for the draws; or
        seed: an int to seed a private generator (at most one of the two).

    ``forward(q, k, v, *, causal=False, key_padding_mask=None)`` on ``(..., n, dim_head)``
    tensors returns ``(..., n_q, d_v)``. It has the signature
    :class:`~efficient_attention.MultiHeadAttention` expects of an attention function.
    New draws are made on the generator's device and copied into the buffer ``w``,
    which moves with the module (``.to(device)``).
    """

    def __init__(
        self,
        dim_head: int,
        num_features: int,
        orthogonal: bool = True,
        redraw_interval: int | None = 1000,
        *,
        features: str = "positive",
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.dim_head = check_positive_int(dim_head, "dim_head")
        self.num_features = check_positive_int(num_features, "num_features")
        self.orthogonal = check_bool(orthogonal, "orthogonal")
        if redraw_interval is not None:
            check_nonnegative_int(redraw_interval, "redraw_interval")
        self.redraw_interval = redraw_interval or 0
        self.features = _check_features(features)
        generator = check_generator(generator)
        if seed is not None:
            if generator is not None:
                raise ValueError("give at most one of generator and seed, got both")
            check_nonnegative_int(seed, "seed")
            generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        self.calls_since_redraw = 0
        self.register_buffer("w", self._draw())

    def _draw(self) -> torch.Tensor:
        return gaussian_random_matrix(
            self.num_features, self.dim_head, orthogonal=self.orthogonal, generator=self.generator
        )

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a new random matrix into the buffer ``w`` (same device and dtype)."""
        self.w.copy_(self._draw().to(device=self.w.device, dtype=self.w.dtype))
        self.calls_since_redraw = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = check_tensor(q, "q", min_dim=2)
        if q.shape[-1] != self.dim_head:
            raise ValueError(
                f"q must have last dimension dim_head={self.dim_head}, got shape {tuple(q.shape)}"
            )
        if self.training and self.redraw_interval:
            if self.calls_since_redraw >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
        return favor_attention(
            q, k, v, self.w, causal=causal, key_padding_mask=key_padding_mask,
            features=self.features,
        )

    def extra_repr(self) -> str:
        return (
            f"dim_head={self.dim_head}, num_features={self.num_features}, "
            f"orthogonal={self.orthogonal}, redraw_interval={self.redraw_interval}, "
            f"features={self.features!r}"
        )
