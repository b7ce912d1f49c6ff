"""Tests for efficient_attention.models: attention by name, synthetic tasks, training."""

import functools

import pytest
import torch

import efficient_attention as ea

CAUSAL_KINDS = [kind for kind in ea.ATTENTION_KINDS if kind != "nystrom"]
RECURRENT_KINDS = ("gated", "delta")  # causal recurrences: no encoder (bidirectional) form
ENCODER_KINDS = [kind for kind in ea.ATTENTION_KINDS if kind not in RECURRENT_KINDS]


@pytest.fixture(autouse=True)
def _one_thread():
    # Small models: threads only add overhead, and on a loaded machine every OpenMP
    # barrier can cost milliseconds. Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_make_attention_by_name():
    assert ea.make_attention("softmax", 8) is ea.softmax_attention
    linear = ea.make_attention("linear", 8)
    assert isinstance(linear, functools.partial) and linear.func is ea.linear_attention
    assert isinstance(ea.make_attention("performer", 8, num_features=16), ea.FavorAttention)
    nystrom = ea.make_attention("nystrom", 8, num_landmarks=3)
    assert isinstance(nystrom, ea.NystromAttention) and nystrom.num_landmarks == 3
    fmm = ea.make_attention("fmm", 8, bandwidth=5)
    assert isinstance(fmm, ea.FMMAttention) and fmm.bandwidth == 5
    q, k, v = torch.randn(3, 2, 2, 12, 8).unbind(0)
    for kind in ENCODER_KINDS:
        out = ea.make_attention(kind, 8)(q, k, v)
        assert out.shape == (2, 2, 12, 8) and torch.isfinite(out).all()
    assert isinstance(ea.make_attention("gated", 8, causal=True), ea.GatedLinearAttention)
    assert isinstance(ea.make_attention("delta", 8, causal=True), ea.DeltaRuleAttention)
    for kind in CAUSAL_KINDS:
        out = ea.make_attention(kind, 8, causal=True)(q, k, v, causal=True)
        assert out.shape == (2, 2, 12, 8) and torch.isfinite(out).all()


def test_make_attention_errors():
    with pytest.raises(ValueError, match="name must be one of .*got 'flash'"):
        ea.make_attention("flash", 8)
    with pytest.raises(TypeError, match="unexpected option\\(s\\) \\['bandwidth'\\] for 'nystrom'"):
        ea.make_attention("nystrom", 8, bandwidth=3)
    with pytest.raises(ValueError, match="nystrom attention has no causal form"):
        ea.make_attention("nystrom", 8, causal=True)
    with pytest.raises(ValueError, match="nystrom attention has no causal form"):
        ea.TinyTransformer(10, attention="nystrom", causal=True)
    for kind in RECURRENT_KINDS:
        with pytest.raises(ValueError, match=f"{kind} attention is a causal recurrence"):
            ea.make_attention(kind, 8)


def test_associative_recall_batches_one_token_per_fact():
    task = ea.AssociativeRecall(num_pairs=5, num_keys=7, num_values=6)
    inputs, targets = task(64, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (64, task.seq_len) == (64, 6)
    assert task.vocab_size == 7 * 6 + 7 and 0 <= inputs.min() and inputs.max() < task.vocab_size
    facts, query = inputs[:, :5], inputs[:, 5]
    keys, values = facts // 6, facts % 6
    assert (facts < 42).all() and (query >= 42).all()
    for row in range(64):
        assert len(set(keys[row].tolist())) == 5  # distinct keys
        position = keys[row].tolist().index(query[row].item() - 42)
        assert targets[row, -1] == values[row, position]  # the value stored with the query
    assert (targets[:, :-1] == ea.IGNORE_INDEX).all()
    again = task(64, generator=torch.Generator().manual_seed(0))[0]
    assert torch.equal(inputs, again)


def test_associative_recall_batches_two_tokens_per_fact():
    task = ea.AssociativeRecall(num_pairs=5, num_keys=7, num_values=6, one_token_per_pair=False)
    inputs, targets = task(64, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (64, task.seq_len) == (64, 11)
    assert task.vocab_size == 13 and inputs.max() < 13 and inputs.min() >= 0
    keys, values, query = inputs[:, 0:10:2], inputs[:, 1:10:2], inputs[:, 10]
    assert (keys < 7).all() and (values >= 7).all()
    for row in range(64):
        assert len(set(keys[row].tolist())) == 5
        position = keys[row].tolist().index(query[row].item())
        assert targets[row, -1] == values[row, position]
    assert (targets[:, :-1] == ea.IGNORE_INDEX).all()


def test_copy_task_batches():
    task = ea.CopyTask(length=6, num_symbols=5)
    inputs, targets = task(16, generator=torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (16, 13) and task.vocab_size == 7
    assert torch.equal(targets[:, 7:], inputs[:, :6])  # the answers are the symbols
    assert (inputs[:, 6] == 5).all() and (inputs[:, 7:] == 6).all()  # SEP, then blanks
    assert (targets[:, :7] == ea.IGNORE_INDEX).all()


def test_task_errors():
    with pytest.raises(ValueError, match="num_pairs must be at most num_keys=4"):
        ea.AssociativeRecall(num_pairs=5, num_keys=4)
    with pytest.raises(ValueError, match="length must be a positive int, got 0"):
        ea.CopyTask(length=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        ea.CopyTask()(0)


@pytest.mark.parametrize(
    "kind, causal",
    [(kind, False) for kind in ENCODER_KINDS] + [(kind, True) for kind in CAUSAL_KINDS],
)
def test_every_model_kind_learns(kind, causal):
    # Copying 4 symbols out of 4: chance loss is log 4 = 1.39. Every kind, bidirectional
    # or causal, must cut the loss well below its starting level in a short run.
    task = ea.CopyTask(length=4, num_symbols=4)
    torch.manual_seed(0)
    model = ea.TinyTransformer(task.vocab_size, d_model=32, num_heads=2, num_layers=2,
                               attention=kind, causal=causal)
    history = ea.train_model(model, task, 60, batch_size=32, lr=3e-3, progress=False)
    assert len(history["loss"]) == len(history["accuracy"]) == 60
    start = sum(history["loss"][:10]) / 10
    end = sum(history["loss"][-10:]) / 10
    assert end < 0.8 * start


def test_softmax_transformer_solves_copying():
    task = ea.CopyTask(length=6, num_symbols=6)
    torch.manual_seed(0)
    model = ea.TinyTransformer(task.vocab_size, d_model=64, num_heads=4, num_layers=2)
    ea.train_model(model, task, 150, progress=False)
    # Chance accuracy is 1/6; a model that copies gets (nearly) all 6 x 256 symbols right.
    assert ea.evaluate_model(model, task, batch_size=256)["accuracy"] > 0.95


def test_softmax_transformer_solves_associative_recall():
    task = ea.AssociativeRecall(num_pairs=4, num_keys=8, num_values=8)
    torch.manual_seed(0)
    model = ea.TinyTransformer(task.vocab_size, d_model=64, num_heads=4, num_layers=2)
    ea.train_model(model, task, 200, progress=False)
    # Chance accuracy is 1/8 (about 0.3 when guessing among the values present); looking
    # up the fact with the query's key gets (nearly) all of the 256 queries right.
    assert ea.evaluate_model(model, task, batch_size=256)["accuracy"] > 0.9


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_models_do_not_look_ahead(kind):
    torch.manual_seed(0)
    model = ea.TinyTransformer(12, d_model=16, num_heads=2, attention=kind, causal=True).eval()
    tokens = torch.randint(12, (2, 15), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 12
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :9], model(tokens)[:, :9])


@pytest.mark.parametrize("kind", ["softmax", "linear", "nystrom", "fmm"])
def test_padding_does_not_change_the_kept_positions(kind):
    torch.manual_seed(0)
    options = {"num_landmarks": 4} if kind == "nystrom" else {}
    model = ea.TinyTransformer(12, d_model=16, num_heads=2, attention=kind,
                               attention_options=options).double().eval()
    tokens = torch.randint(12, (1, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 14, dtype=torch.bool)
    mask[:, 10:] = True
    with torch.no_grad():
        padded = model(tokens, key_padding_mask=mask)[:, :10]
        torch.testing.assert_close(padded, model(tokens[:, :10]))


def test_model_bad_input():
    model = ea.TinyTransformer(10, d_model=16, num_heads=2, max_len=8)
    with pytest.raises(TypeError, match="tokens must be integer token indices"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="tokens must have shape \\(batch, n\\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens has length n=9, more than max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="num_heads must divide d_model"):
        ea.TinyTransformer(10, d_model=10, num_heads=4)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        ea.train_model("model", ea.CopyTask(), 1, progress=False)
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        ea.train_model(model, ea.CopyTask(), 0, progress=False)


def test_model_padding_mask_is_checked_before_use():
    """Issue 27: a list as key_padding_mask failed with "'list' object has no attribute
    'shape'" inside the attention layer."""
    model = ea.TinyTransformer(10, d_model=16, num_heads=2, max_len=8)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool torch.Tensor, got list"):
        model(tokens, key_padding_mask=[[False] * 4] * 2)
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        model(tokens, key_padding_mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"key_padding_mask must be broadcastable to the "
                                         r"keys' \(2, 4\).*\(2, 5\)"):
        model(tokens, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    pad = torch.tensor([[False, False, False, True], [False, False, False, False]])
    torch.testing.assert_close(model(tokens, key_padding_mask=pad[1:]),  # (1, n) broadcasts
                               model(tokens, key_padding_mask=pad[1:].expand(2, 4)))


# --- issue 27.4: decoding with one KV cache per layer ----------------------------------------


@pytest.mark.parametrize("chunks", [[9], [1] * 9, [4, 1, 0, 3, 1]])
def test_model_decode_equals_the_causal_forward(chunks):
    torch.manual_seed(0)
    model = ea.TinyTransformer(10, d_model=16, num_heads=2, num_layers=3, max_len=12,
                               causal=True).double()
    tokens = torch.randint(10, (2, 9), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, :2] = True  # a left-padded prompt
    expected = model(tokens, key_padding_mask=pad).detach()
    caches, logits, start = model.new_caches(), [], 0
    assert len(caches) == 3 and caches[0].max_len == 12
    with torch.inference_mode():
        for t in chunks:
            logits.append(model.decode(tokens[:, start:start + t], caches,
                                       key_padding_mask=pad[:, start:start + t]))
            start += t
    decoded = torch.cat(logits, dim=1)
    assert decoded.shape == (2, 9, 10)
    assert (decoded[~pad] - expected[~pad]).abs().max() < 1e-12


def test_model_decode_checks_its_caches():
    model = ea.TinyTransformer(10, d_model=16, num_heads=2, max_len=6, causal=True)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="decode needs a causal model"):
        ea.TinyTransformer(10, d_model=16, num_heads=2).decode(tokens, [])
    with pytest.raises(ValueError, match="caches must be a list of 2 caches.*got 1"):
        model.decode(tokens, model.new_caches()[:1])
    caches = model.new_caches()
    with torch.no_grad():
        caches[0].append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
        with pytest.raises(ValueError, match=r"the same number of tokens, got lengths \[1, 0\]"):
            model.decode(tokens, caches)
        caches = model.new_caches()
        model.decode(tokens, caches)
        with pytest.raises(ValueError, match="length n=3 after 4 cached tokens, more than "
                                             "max_len=6"):
            model.decode(tokens[:, :3], caches)
