"""Tests for efficient_attention.speculative: greedy speculative decoding with a draft model.

The reference is plain greedy decoding of the target, itself checked against the argmax of
the full forward pass recomputed for every token (no cache). The models run in float64, so
that the target's logits from a verification block and from one-token steps (the same sums
in another order, ~1e-15 apart) cannot pick different argmaxes.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import efficient_attention as ea

VOCAB = 11


def model(seed, *, d_model=16, num_layers=2, vocab=VOCAB, causal=True, max_len=64):
    torch.manual_seed(seed)
    net = ea.TinyTransformer(vocab, d_model=d_model, num_heads=2, num_layers=num_layers,
                             max_len=max_len, causal=causal)
    return net.double().eval()


def prompt(n, seed=0, batch=1):
    return torch.randint(VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy_without_cache(net, tokens, num_tokens):
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens = torch.cat([tokens, net(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


def test_greedy_generate_equals_the_full_forward_each_step():
    target = model(0)
    tokens = prompt(5, batch=3)
    out = ea.greedy_generate(target, tokens, 12)
    assert out.shape == (3, 17) and out.dtype == tokens.dtype
    assert torch.equal(out, greedy_without_cache(target, tokens, 12))
    assert torch.equal(ea.greedy_generate(target, tokens, 0), tokens)


@pytest.mark.parametrize("draft_length", [1, 3, 8])
@pytest.mark.parametrize("n, num_tokens", [(1, 10), (6, 20), (4, 1)])
def test_the_target_as_its_own_draft_accepts_everything(draft_length, n, num_tokens):
    target = model(0)
    tokens = prompt(n, seed=n)
    out, stats = ea.speculative_generate(target, target, tokens, num_tokens,
                                         draft_length=draft_length)
    assert torch.equal(out, ea.greedy_generate(target, tokens, num_tokens))
    assert stats.accepted == stats.proposed  # every proposal is the target's own choice
    assert all(p <= draft_length for p in stats.proposed)
    assert sum(stats.accepted) + stats.steps == num_tokens  # a + 1 tokens per step
    assert stats.steps == -(-num_tokens // (draft_length + 1))  # ceil: the fewest calls
    if sum(stats.proposed):
        assert stats.acceptance_rate == 1.0
    assert stats.tokens_per_step == num_tokens / stats.steps


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(0, 16), st.integers(1, 5), st.integers(0, 3))
def test_any_draft_gives_the_targets_greedy_output(n, num_tokens, draft_length, seed):
    target = model(seed)
    draft = model(100 + seed, d_model=8, num_layers=1)  # another, smaller random model
    tokens = prompt(n, seed=seed)
    out, stats = ea.speculative_generate(target, draft, tokens, num_tokens,
                                         draft_length=draft_length)
    assert torch.equal(out, ea.greedy_generate(target, tokens, num_tokens))
    assert sum(stats.accepted) + stats.steps == num_tokens
    assert all(0 <= a <= p <= draft_length for a, p in
               zip(stats.accepted, stats.proposed, strict=True))


def test_a_close_draft_accepts_part_of_its_proposals():
    target = model(0, vocab=5)
    draft = model(0, vocab=5)
    with torch.no_grad():  # the target, perturbed: it agrees often, not always
        for p in draft.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()),
                                     dtype=p.dtype))
    tokens = torch.randint(5, (1, 3), generator=torch.Generator().manual_seed(4))
    out, stats = ea.speculative_generate(target, draft, tokens, 40, draft_length=4)
    assert torch.equal(out, ea.greedy_generate(target, tokens, 40))
    assert 0 < stats.acceptance_rate < 1
    assert stats.acceptance_rate == sum(stats.accepted) / sum(stats.proposed)
    assert 1 < stats.tokens_per_step < 5 and stats.steps < 40  # fewer target calls


def test_stats_without_steps():
    out, stats = ea.speculative_generate(model(0), model(1), prompt(3), 0, draft_length=2)
    assert torch.equal(out, prompt(3)) and stats.steps == 0
    assert stats.accepted == stats.proposed == ()
    for value in (stats.acceptance_rate, stats.tokens_per_step):
        assert value != value  # NaN: nothing was proposed
    _, one = ea.speculative_generate(model(0), model(1), prompt(3), 1, draft_length=2)
    assert one.proposed == (0,) and one.accepted == (0,)  # the last token needs no draft


def test_bad_input():
    target = model(0)
    with pytest.raises(ValueError, match=r"one sequence, shape \(1, n\), got \(2, 3\)"):
        ea.speculative_generate(target, target, prompt(3, batch=2), 4, draft_length=2)
    with pytest.raises(ValueError, match="share a vocabulary, got vocab_size=7 and 11"):
        ea.speculative_generate(target, model(1, vocab=7), prompt(3), 4, draft_length=2)
    with pytest.raises(ValueError, match="draft must be a causal model"):
        ea.speculative_generate(target, model(1, causal=False), prompt(3), 4, draft_length=2)
    with pytest.raises(TypeError, match="target must be a TinyTransformer, got Linear"):
        ea.speculative_generate(torch.nn.Linear(2, 2), target, prompt(3), 4, draft_length=2)
    with pytest.raises(ValueError, match="draft_length must be a positive int, got 0"):
        ea.speculative_generate(target, target, prompt(3), 4, draft_length=0)
    with pytest.raises(TypeError, match="num_tokens must be a non-negative int"):
        ea.greedy_generate(target, prompt(3), 2.0)
    with pytest.raises(ValueError, match=r"prompt length 60 plus num_tokens=6 passes the "
                                         r"model's max_len=64"):
        ea.greedy_generate(target, prompt(60), 6)
    assert ea.greedy_generate(target, prompt(60), 5).shape == (1, 65)  # 64 positions fed
    with pytest.raises(TypeError, match="prompt must be an integer tensor"):
        ea.greedy_generate(target, prompt(3).double(), 2)
    with pytest.raises(ValueError, match="at least one token"):
        ea.greedy_generate(target, prompt(0), 2)
