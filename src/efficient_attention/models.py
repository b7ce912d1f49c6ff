"""A small Transformer with pluggable attention, and synthetic tasks to train it on.

The model is the standard pre-LayerNorm Transformer: token embedding plus
sinusoidal positions, then ``num_layers`` blocks of

    x = x + MultiHeadAttention(LayerNorm(x));  x = x + MLP(LayerNorm(x)),

and a linear read-out. Only the attention inside :class:`MultiHeadAttention`
changes between models, chosen by name with :func:`make_attention`, so that the
methods of this package can be compared on equal terms.

The tasks need information from far away in the sequence, which is what
efficient attention must preserve:

- :class:`AssociativeRecall`: a list of (key, value) facts and a query key -> the
  value stored with that key (Ba et al. 2016; Zoology, Arora et al. 2023).
- :class:`CopyTask`: ``x1 .. xL SEP _ .. _`` -> ``x1 .. xL`` at the blanks.

Targets are ``-100`` (ignored) except where a prediction is asked for, and every
target depends only on inputs at or before its position, so the tasks suit both
encoder (bidirectional) and causal models.

Reference: Vaswani et al., "Attention is all you need", NeurIPS 2017; Xiong et al.,
"On layer normalization in the Transformer architecture", ICML 2020 (pre-LN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_bool, check_generator, check_key_padding_mask, check_positive_int
from .attention import MultiHeadAttention, softmax_attention
from .delta_rule import DeltaRuleAttention
from .embeddings import sinusoidal_positional_encoding
from .fmm import FMMAttention
from .kv_cache import KVCache
from .linearized import elu_feature_map, linear_attention
from .nystrom import NystromAttention
from .performer import FavorAttention
from .recurrent import GatedLinearAttention

__all__ = [
    "ATTENTION_KINDS",
    "IGNORE_INDEX",
    "make_attention",
    "TransformerBlock",
    "TinyTransformer",
    "AssociativeRecall",
    "CopyTask",
    "train_model",
    "evaluate_model",
]

ATTENTION_KINDS = ("softmax", "linear", "performer", "nystrom", "fmm", "gated", "delta")
IGNORE_INDEX = -100  # targets with this value are not scored (PyTorch's cross-entropy default)

_DEFAULTS: dict[str, dict[str, object]] = {
    "softmax": {},
    "linear": {"feature_map": elu_feature_map},
    "performer": {"num_features": 32, "redraw_interval": 100, "seed": None},
    "nystrom": {"num_landmarks": 8, "pinv_iterations": 6},
    "fmm": {"bandwidth": 2, "feature_maps": None},
    "gated": {"per_channel": False},
    "delta": {"gated": False},
}


def make_attention(
    name: str, dim_head: int, *, causal: bool = False, **options: object
) -> Callable[..., torch.Tensor]:
    """An attention function or module for ``MultiHeadAttention(attention=...)``.

    ``name`` is one of ``ATTENTION_KINDS``; ``options`` override the defaults:

    - ``"softmax"``: exact :func:`~efficient_attention.softmax_attention` (no options).
    - ``"linear"``: :func:`~efficient_attention.linear_attention`, ``feature_map``.
    - ``"performer"``: :class:`~efficient_attention.FavorAttention`, ``num_features``
      (32), ``redraw_interval`` (100), ``seed``.
    - ``"nystrom"``: :class:`~efficient_attention.NystromAttention`, ``num_landmarks``
      (8), ``pinv_iterations`` (6). Not causal: ``causal=True`` raises ``ValueError``.
    - ``"fmm"``: :class:`~efficient_attention.FMMAttention`, ``bandwidth`` (2),
      ``feature_maps``.
    - ``"gated"``, ``"delta"``: :class:`~efficient_attention.GatedLinearAttention`
      (``per_channel``), :class:`~efficient_attention.DeltaRuleAttention` (``gated``).
      Causal recurrences: ``causal=False`` raises ``ValueError``.

    ``causal`` says whether the model will ask for causal attention; it only serves
    to reject a combination that cannot work.
    """
    if name not in ATTENTION_KINDS:
        raise ValueError(f"name must be one of {ATTENTION_KINDS}, got {name!r}")
    check_bool(causal, "causal")
    check_positive_int(dim_head, "dim_head")
    unknown = set(options) - set(_DEFAULTS[name])
    if unknown:
        raise TypeError(
            f"unexpected option(s) {sorted(unknown)} for {name!r} attention; "
            f"allowed: {sorted(_DEFAULTS[name])}"
        )
    settings = {**_DEFAULTS[name], **options}
    if name == "softmax":
        return softmax_attention
    if name == "linear":
        return functools.partial(linear_attention, feature_map=settings["feature_map"])
    if name == "performer":
        return FavorAttention(dim_head, settings["num_features"],
                              redraw_interval=settings["redraw_interval"], seed=settings["seed"])
    if name == "nystrom":
        if causal:
            raise ValueError(
                "nystrom attention has no causal form (its landmarks average past and "
                "future positions); use it with causal=False"
            )
        return NystromAttention(settings["num_landmarks"], settings["pinv_iterations"])
    if name in ("gated", "delta"):
        if not causal:
            raise ValueError(f"{name} attention is a causal recurrence; use it with causal=True")
        recurrence = GatedLinearAttention if name == "gated" else DeltaRuleAttention
        return recurrence(dim_head, **settings)
    return FMMAttention(settings["bandwidth"], settings["feature_maps"])


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(LN(x))`` then ``x + MLP(LN(x))``; shapes ``(B, n, d_model)``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        attention: Callable[..., torch.Tensor],
        *,
        mlp_ratio: int = 4,
    ) -> None:
        super().__init__()
        self.norm_attention = nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, num_heads, attention=attention)
        self.norm_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
        )

    def forward(
        self, x: torch.Tensor, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attention(
            self.norm_attention(x), causal=causal, key_padding_mask=key_padding_mask
        )
        return x + self.mlp(self.norm_mlp(x))

    def decode(self, x: torch.Tensor, cache: KVCache,
               key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block on ``t`` new tokens ``(B, t, d_model)``, attending through ``cache``
        (:meth:`MultiHeadAttention.decode`): the rows of the causal ``forward``."""
        x = x + self.attention.decode(self.norm_attention(x), cache,
                                      key_padding_mask=key_padding_mask)
        return x + self.mlp(self.norm_mlp(x))


class TinyTransformer(nn.Module):
    """A small Transformer whose attention is chosen by name.

    Args:
        vocab_size: number of input tokens (and of output classes).
        d_model, num_heads, num_layers, mlp_ratio: the usual sizes.
        max_len: longest sequence (length of the positional-encoding table).
        attention: one of ``ATTENTION_KINDS``; each layer gets its own instance.
        causal: decoder mode (position ``i`` sees ``j <= i``) instead of encoder mode.
        attention_options: passed to :func:`make_attention`.

    ``forward(tokens (B, n), key_padding_mask=None) -> logits (B, n, vocab_size)``; the
    mask is bool, broadcastable to ``(B, n)``, ``True`` at padding tokens.
    ``decode(tokens (B, t), caches, key_padding_mask=None) -> logits (B, t, vocab_size)``:
    the next ``t`` tokens of a causal softmax model, one KV cache per layer
    (``new_caches()``); prefill and decoding in any chunks give the rows of ``forward``.
    Cost per layer: ``O(n d_model^2)`` for projections and MLP plus the attention's.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        max_len: int = 256,
        attention: str = "softmax",
        causal: bool = False,
        mlp_ratio: int = 4,
        attention_options: dict[str, object] | None = None,
    ) -> None:
        super().__init__()
        sizes = {"vocab_size": vocab_size, "d_model": d_model, "num_heads": num_heads,
                 "num_layers": num_layers, "max_len": max_len, "mlp_ratio": mlp_ratio}
        for name, value in sizes.items():
            check_positive_int(value, name)
        if d_model % num_heads:
            raise ValueError(
                f"num_heads must divide d_model, got d_model={d_model} and num_heads={num_heads}"
            )
        self.attention_kind = attention
        self.causal = check_bool(causal, "causal")
        dim_head = d_model // num_heads
        options = dict(attention_options or {})
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.register_buffer(
            "positions", sinusoidal_positional_encoding(max_len, d_model), persistent=False
        )
        self.blocks = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                make_attention(attention, dim_head, causal=self.causal, **options),
                mlp_ratio=mlp_ratio,
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def _embed(self, tokens: object, start: int = 0) -> torch.Tensor:
        """Token embeddings plus the positions ``start .. start + n - 1``."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a (batch, n) tensor, got {type(tokens).__name__}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, n), got {tuple(tokens.shape)}")
        if tokens.is_floating_point():
            raise TypeError(f"tokens must be integer token indices, got dtype {tokens.dtype}")
        n, max_len = tokens.shape[1], self.positions.shape[0]
        if start + n > max_len:
            after = f" after {start} cached tokens" if start else ""
            raise ValueError(f"tokens has length n={n}{after}, more than max_len={max_len}")
        positions = self.positions[start : start + n].to(self.token_embedding.weight.dtype)
        return self.token_embedding(tokens) + positions

    def forward(
        self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self._embed(tokens)
        key_padding_mask = check_key_padding_mask(key_padding_mask, (*tokens.shape, 1),
                                                  tokens.device)  # (B, n) or None
        for block in self.blocks:
            x = block(x, causal=self.causal, key_padding_mask=key_padding_mask)  # (B, n, d)
        return self.head(self.norm(x))  # (B, n, vocab_size)

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        """One empty :class:`~efficient_attention.kv_cache.KVCache` per layer, of
        ``max_len`` positions (``None``: the model's ``max_len``), for :meth:`decode`."""
        max_len = self.positions.shape[0] if max_len is None else max_len
        return [KVCache(max_len) for _ in self.blocks]

    def decode(
        self, tokens: torch.Tensor, caches: list[KVCache],
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, t, vocab_size)`` of the ``t`` tokens ``(B, t)`` that follow the
        ``L`` tokens in ``caches`` (one per layer, all of length ``L``; positions ``L ..
        L + t - 1``), whose keys and values are appended. Needs a causal model with
        softmax attention. Cost: ``O(t d_model^2)`` per layer plus attention over ``L + t``
        keys; truncating every cache to ``L'`` rolls the model back to ``L'`` tokens.
        """
        if not self.causal:
            raise ValueError("decode needs a causal model (TinyTransformer(..., causal=True)):"
                             " an encoder's tokens see later tokens, which are not cached")
        if not isinstance(caches, (list, tuple)) or len(caches) != len(self.blocks):
            got = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
            raise ValueError(f"caches must be a list of {len(self.blocks)} caches (one per "
                             f"layer, see new_caches()), got {got}")
        lengths = {getattr(cache, "length", None) for cache in caches}
        if len(lengths) != 1 or None in lengths:
            raise ValueError(f"caches must all hold the same number of tokens, got lengths "
                             f"{[getattr(cache, 'length', None) for cache in caches]}")
        x = self._embed(tokens, start=caches[0].length)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block.decode(x, cache, key_padding_mask)  # (B, t, d)
        return self.head(self.norm(x))  # (B, t, vocab_size)


@dataclass(frozen=True)
class AssociativeRecall:
    """Associative recall: ``P`` (key, value) facts, then a query key -> its value.

    Keys are distinct within a sequence. Two encodings:

    - ``one_token_per_pair=True`` (default): fact ``(k, v)`` is the single token
      ``k * num_values + v``, the query is token ``num_keys * num_values + k``;
      sequence length ``P + 1``. The query must find the one fact with its key,
      wherever it is: a single content-based lookup, learned in a few hundred steps.
    - ``one_token_per_pair=False``: ``k1 v1 k2 v2 ... kP vP q`` with keys ``0..K-1``
      and values ``K..K+V-1``; length ``2P + 1``. The model must also link each value
      to the key before it (an "induction head", two attention layers that compose),
      which typically shows a long plateau at the accuracy of guessing among the
      values present: expect thousands of steps.

    ``task(batch_size, generator=None)`` returns ``inputs, targets`` (int64,
    ``(batch_size, seq_len)``), targets ``IGNORE_INDEX`` except at the last position,
    which holds the value's index ``0..num_values-1`` (one-token form) or its token
    (two-token form). Chance accuracy is ``1 / num_values``.
    """

    num_pairs: int = 8
    num_keys: int = 16
    num_values: int = 8
    one_token_per_pair: bool = True

    def __post_init__(self) -> None:
        check_positive_int(self.num_pairs, "num_pairs")
        check_positive_int(self.num_keys, "num_keys")
        check_positive_int(self.num_values, "num_values")
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs must be at most num_keys={self.num_keys} (keys are distinct), "
                f"got {self.num_pairs}"
            )

    @property
    def vocab_size(self) -> int:
        if self.one_token_per_pair:
            return self.num_keys * self.num_values + self.num_keys
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return self.num_pairs + 1 if self.one_token_per_pair else 2 * self.num_pairs + 1

    def __call__(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_positive_int(batch_size, "batch_size")
        generator = check_generator(generator)
        p = self.num_pairs
        keys = torch.rand(batch_size, self.num_keys, generator=generator).argsort(dim=-1)[:, :p]
        values = torch.randint(self.num_values, (batch_size, p), generator=generator)
        pick = torch.randint(p, (batch_size, 1), generator=generator)  # which fact is asked
        query = keys.gather(1, pick)  # (B, 1)
        answer = values.gather(1, pick).squeeze(1)  # (B,)
        if self.one_token_per_pair:
            facts = keys * self.num_values + values  # (B, P)
            query = query + self.num_keys * self.num_values
        else:
            values = values + self.num_keys
            answer = answer + self.num_keys
            facts = torch.stack([keys, values], dim=-1).reshape(batch_size, 2 * p)  # k1 v1 ..
        inputs = torch.cat([facts, query], dim=1)  # (B, seq_len)
        targets = torch.full_like(inputs, IGNORE_INDEX)
        targets[:, -1] = answer
        return inputs, targets


@dataclass(frozen=True)
class CopyTask:
    """Copying: ``x1 .. xL SEP _ .. _`` -> ``x1 .. xL`` at the ``L`` blanks.

    Symbols are tokens ``0..num_symbols-1``, ``SEP = num_symbols``,
    blank ``= num_symbols + 1``. ``task(batch_size, generator=None)`` returns
    ``inputs, targets`` of shape ``(batch_size, 2 length + 1)``; the answer for
    ``x_i`` sits ``length + 1`` positions after it. Chance accuracy ``1 / num_symbols``.
    """

    length: int = 8
    num_symbols: int = 8

    def __post_init__(self) -> None:
        check_positive_int(self.length, "length")
        check_positive_int(self.num_symbols, "num_symbols")

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + 2

    @property
    def seq_len(self) -> int:
        return 2 * self.length + 1

    def __call__(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_positive_int(batch_size, "batch_size")
        generator = check_generator(generator)
        length = self.length
        symbols = torch.randint(self.num_symbols, (batch_size, length), generator=generator)
        separator = torch.full((batch_size, 1), self.num_symbols)
        blanks = torch.full((batch_size, length), self.num_symbols + 1)
        inputs = torch.cat([symbols, separator, blanks], dim=1)  # (B, 2L + 1)
        ignored = torch.full((batch_size, length + 1), IGNORE_INDEX)
        targets = torch.cat([ignored, symbols], dim=1)  # (B, 2L + 1)
        return inputs, targets


Task = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _loss_and_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    scored = targets != IGNORE_INDEX  # (B, n)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    correct = (logits.argmax(dim=-1) == targets) & scored
    return loss, correct.sum().item() / max(scored.sum().item(), 1)


def train_model(
    model: nn.Module,
    task: Task,
    steps: int,
    *,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Train ``model`` on fresh batches ``task(batch_size, generator)`` with AdamW.

    Cross-entropy on the scored positions (targets not ``IGNORE_INDEX``), gradient
    norm clipped at 1. The batches come from a generator seeded with ``seed`` (CPU)
    and are moved to the model's device. Returns ``{"loss": [...], "accuracy":
    [...]}``, one entry per step (accuracy on the training batch, before the step).
    """
    from tqdm import tqdm  # a text bar: tqdm.auto would use a widget that needs CDN scripts

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(task):
        raise TypeError(f"task must be callable (batch_size, generator), got {type(task).__name__}")
    check_positive_int(steps, "steps")
    check_positive_int(batch_size, "batch_size")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    history: dict[str, list[float]] = {"loss": [], "accuracy": []}
    model.train()
    bar = tqdm(range(steps), desc="training", disable=not progress)
    for _ in bar:
        inputs, targets = task(batch_size, generator=generator)
        inputs, targets = inputs.to(device), targets.to(device)
        loss, accuracy = _loss_and_accuracy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history["loss"].append(loss.item())
        history["accuracy"].append(accuracy)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.2f}")
    return history


@torch.no_grad()
def evaluate_model(
    model: nn.Module, task: Task, *, batch_size: int = 256, seed: int = 1
) -> dict[str, float]:
    """Loss and accuracy of ``model`` (in eval mode) on one fresh batch of ``task``."""
    check_positive_int(batch_size, "batch_size")
    device = next(model.parameters()).device
    inputs, targets = task(batch_size, generator=torch.Generator().manual_seed(seed))
    was_training = model.training
    model.eval()
    loss, accuracy = _loss_and_accuracy(model(inputs.to(device)), targets.to(device))
    model.train(was_training)
    return {"loss": loss.item(), "accuracy": accuracy}
