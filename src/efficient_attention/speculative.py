"""Speculative decoding: a small draft model proposes, the target model verifies at once.

Decoding one token at a time with a large model is memory bound: each step reads all of
the weights and the KV cache to compute one token. Verifying ``T`` proposed tokens costs
the target about the same as one step (one ``T + 1``-token block of
:meth:`~efficient_attention.models.TinyTransformer.decode`, the weights read once), so
a cheap **draft** model that guesses right often saves target steps (Leviathan et al.
2023; Chen et al. 2023). Greedy form, each step, with ``x`` the tokens so far:

1. the draft proposes ``d_1 .. d_T`` one token at a time (its own greedy decoding);
2. the target reads ``x_last, d_1 .. d_T`` in one call, which gives its greedy choices
   ``g_1 .. g_{T+1}`` after ``x``, ``x d_1``, .., ``x d_1 .. d_T``;
3. with ``a`` the length of the longest prefix where ``d_i = g_i``, the tokens
   ``d_1 .. d_a, g_{a+1}`` are appended (``a + 1`` tokens, between 1 and ``T + 1``), and
   both KV caches are truncated to the tokens kept (the rejected draft tokens' keys are
   forgotten: :meth:`~efficient_attention.kv_cache.KVCache.truncate`).

Every appended token is the target's greedy choice after the tokens before it, so the
output is that of :func:`greedy_generate` with the target, whatever the draft (up to ties
of the argmax, which a different summation order may break otherwise: the tests use
float64). The draft only changes how many target calls it takes: ``num_tokens /
(mean(a) + 1)``. Memory: both models' KV caches for ``n + num_tokens`` positions
(``cache_bytes_per_token`` of each model times that); the rejected tokens' entries are
overwritten, never allocated anew.

References: Leviathan, Kalman and Matias, "Fast Inference from Transformers via
Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_nonnegative_int, check_positive_int
from .models import TinyTransformer

__all__ = ["SpeculativeStats", "greedy_generate", "speculative_generate"]


@dataclass(frozen=True)
class SpeculativeStats:
    """What happened in :func:`speculative_generate`, one entry per target call.

    ``proposed[s]``: draft tokens verified at step ``s`` (``draft_length``, fewer at the
    end so as not to pass ``num_tokens``); ``accepted[s]``: how many of them the target
    agreed with (``a`` above; ``a + 1`` tokens were appended).
    """

    accepted: tuple[int, ...]
    proposed: tuple[int, ...]

    @property
    def steps(self) -> int:
        """Target calls after the prefill."""
        return len(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """``sum(accepted) / sum(proposed)``; NaN when nothing was proposed."""
        proposed = sum(self.proposed)
        return sum(self.accepted) / proposed if proposed else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens appended per target call, ``mean(accepted) + 1``; NaN without steps."""
        return (sum(self.accepted) / self.steps + 1) if self.steps else float("nan")


def _check_model(model: object, name: str) -> TinyTransformer:
    if not isinstance(model, TinyTransformer):
        raise TypeError(f"{name} must be a TinyTransformer, got {type(model).__name__}")
    if not model.causal:
        raise ValueError(f"{name} must be a causal model (TinyTransformer(..., causal=True))")
    return model


def _check_prompt(prompt: object, model: TinyTransformer, num_tokens: int) -> torch.Tensor:
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        got = (f"shape {tuple(prompt.shape)}, dtype {prompt.dtype}"
               if isinstance(prompt, torch.Tensor) else type(prompt).__name__)
        raise TypeError(f"prompt must be an integer tensor (batch, n) of token indices, "
                        f"got {got}")
    if prompt.shape[1] == 0:
        raise ValueError("prompt must hold at least one token, got shape "
                         f"{tuple(prompt.shape)}")
    check_nonnegative_int(num_tokens, "num_tokens")
    max_len = model.positions.shape[0]
    if prompt.shape[1] + num_tokens - 1 > max_len:  # the last token is never fed back
        raise ValueError(f"prompt length {prompt.shape[1]} plus num_tokens={num_tokens} "
                         f"passes the model's max_len={max_len} (+1 for the last token)")
    return prompt


@torch.inference_mode()
def greedy_generate(model: TinyTransformer, prompt: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Greedy decoding with a KV cache: ``(batch, n + num_tokens)`` tokens.

    ``prompt (batch, n)``, ``n >= 1``: the prefill runs ``model.decode`` on the prompt,
    then each new token is the argmax of the last logits and is fed back alone (one
    ``t = 1`` step per token, ``num_tokens`` model calls in all). The model must be
    causal, with softmax attention.
    """
    model = _check_model(model, "model")
    prompt = _check_prompt(prompt, model, num_tokens)
    caches = model.new_caches(prompt.shape[1] + num_tokens)
    out, feed = [prompt], prompt
    for _ in range(num_tokens):
        feed = model.decode(feed, caches)[:, -1:].argmax(dim=-1)  # (batch, 1)
        out.append(feed)
    return torch.cat(out, dim=1)


@torch.inference_mode()
def speculative_generate(
    target: TinyTransformer,
    draft: TinyTransformer,
    prompt: torch.Tensor,
    num_tokens: int,
    *,
    draft_length: int,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """Greedy speculative decoding (module docstring): ``(tokens, stats)``.

    Args:
        target: the model whose greedy output is produced.
        draft: the proposing model (causal, softmax attention, the target's vocabulary).
        prompt: ``(1, n)`` token indices, ``n >= 1`` (one sequence: each has its own
            number of accepted tokens, hence its own cache length).
        num_tokens: tokens to generate.
        draft_length: ``T >= 1``, tokens the draft proposes per step.

    Returns ``tokens (1, n + num_tokens)``, equal to ``greedy_generate(target, prompt,
    num_tokens)``, and :class:`SpeculativeStats`. Cost per step: ``T`` draft calls of one
    token (two tokens for the first when the last step accepted all) and one target call
    of ``T + 1`` tokens.
    """
    target = _check_model(target, "target")
    draft = _check_model(draft, "draft")
    prompt = _check_prompt(prompt, target, num_tokens)
    _check_prompt(prompt, draft, num_tokens)
    check_positive_int(draft_length, "draft_length")
    if prompt.shape[0] != 1:
        raise ValueError(f"prompt must be one sequence, shape (1, n), got {tuple(prompt.shape)}")
    if draft.head.out_features != target.head.out_features:
        raise ValueError(f"draft and target must share a vocabulary, got vocab_size="
                         f"{draft.head.out_features} and {target.head.out_features}")
    total = prompt.shape[1] + num_tokens
    target_caches, draft_caches = target.new_caches(total), draft.new_caches(total)
    tokens = prompt[0].tolist()
    accepted: list[int] = []
    proposed: list[int] = []
    if num_tokens:  # the caches hold every token but the last, which is fed next
        target.decode(prompt[:, :-1], target_caches)
        draft.decode(prompt[:, :-1], draft_caches)

    def as_tensor(ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=prompt.dtype, device=prompt.device)

    while len(tokens) < total:
        length = min(draft_length, total - len(tokens) - 1)  # never past num_tokens
        guesses: list[int] = []
        feed = tokens[draft_caches[0].length :]  # what the draft has not read yet
        for _ in range(length):
            guesses.append(int(draft.decode(as_tensor(feed), draft_caches)[0, -1].argmax()))
            feed = guesses[-1:]
        # g_1 .. g_{T+1}: the target's choices after tokens, tokens d_1, .., tokens d_1..d_T
        choices = target.decode(as_tensor(tokens[-1:] + guesses), target_caches)[0]
        choices = choices.argmax(dim=-1).tolist()
        agreed = 0
        while agreed < length and guesses[agreed] == choices[agreed]:
            agreed += 1
        tokens += guesses[:agreed] + [choices[agreed]]
        accepted.append(agreed)
        proposed.append(length)
        kept = len(tokens) - 1  # the caches' tokens that agree with the new sequence
        for cache in target_caches:
            cache.truncate(kept)
        for cache in draft_caches:
            cache.truncate(min(cache.length, kept))
    return as_tensor(tokens), SpeculativeStats(tuple(accepted), tuple(proposed))
