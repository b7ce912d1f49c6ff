"""Tests for efficient_attention.word2vec: vocabulary, skip-gram, training on Python's docs."""

import math

import pytest
import torch

import efficient_attention as ea
from efficient_attention.word2vec import _skipgram_pairs

# Related word pairs from the vocabulary of Python's documentation. They were chosen
# BEFORE any model was trained (only checking that each word occurs in the corpus), and
# have not been changed after looking at results.
RELATED_PAIRS = [
    ("true", "false"),
    ("key", "value"),
    ("list", "tuple"),
    ("integer", "float"),
    ("class", "instance"),
    ("positional", "keyword"),
    ("break", "continue"),
    ("left", "right"),
    ("first", "last"),
    ("start", "end"),
    ("module", "import"),
    ("exception", "error"),
    ("argument", "parameter"),
    ("method", "function"),
    ("int", "str"),
    ("binary", "decimal"),
]


@pytest.fixture(autouse=True)
def _one_thread():
    # Small batches: threads only add overhead, and on a loaded machine every OpenMP
    # barrier can cost milliseconds. Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tokenize():
    assert ea.tokenize("The list's items: x1, Y_2 and don't!") == [
        "the", "list's", "items", "x", "y", "and", "don't",
    ]


def test_vocabulary_counts_order_and_unknown():
    tokens = "b a c a b a d".split()
    vocab = ea.Vocabulary(tokens, min_count=2)
    assert vocab.itos == ["<unk>", "a", "b"]  # most frequent first; c and d dropped
    assert vocab.counts == [2, 3, 2]  # <unk> counts the two dropped occurrences
    assert len(vocab) == 3 and "a" in vocab and "c" not in vocab and "<unk>" not in vocab
    assert vocab.index("c") == 0 and vocab.index("b") == 2
    assert vocab.decode(vocab.encode(["a", "b", "zzz"])) == ["a", "b", "<unk>"]
    torch.testing.assert_close(vocab.frequencies().sum(), torch.tensor(1.0, dtype=torch.float64))
    capped = ea.Vocabulary("b a c a b".split(), max_size=2, unknown=None)
    assert capped.itos == ["a", "b"]  # ties broken alphabetically
    with pytest.raises(KeyError, match="'c' is not in the vocabulary"):
        capped.index("c")


def test_pydoc_corpus_is_english_prose_about_python():
    tokens = ea.load_pydoc_corpus()
    assert len(tokens) > 50_000
    assert all(t.islower() for t in tokens[:1000])
    counts = ea.Vocabulary(tokens).counts
    assert max(counts) == counts[1]  # index 1: the most frequent word
    documents = ea.load_pydoc_corpus(documents=True)
    assert len(documents) > 50 and sum(map(len, documents)) == len(tokens)


def test_pairs_stay_in_their_window_and_document():
    ids = torch.arange(10)
    doc = torch.tensor([0] * 6 + [1] * 4)
    centers, contexts = _skipgram_pairs(ids, doc, 2, torch.Generator().manual_seed(0))
    assert len(centers) > 0
    distance = (centers - contexts).abs()
    assert ((distance >= 1) & (distance <= 2)).all()
    assert (doc[centers] == doc[contexts]).all()
    # Every center has at least its nearest neighbours (window size drawn in 1..2).
    for i in range(10):
        expected = {j for j in (i - 1, i + 1) if 0 <= j < 10 and doc[j] == doc[i]}
        assert expected <= set(contexts[centers == i].tolist())


def test_skipgram_loss_at_initialisation_is_k_plus_one_log_two():
    # Output vectors start at zero, so every score is 0 and each of the K + 1 terms is log 2.
    model = ea.SkipGram(20, 8)
    centers = torch.tensor([1, 2, 3])
    loss = model(centers, torch.tensor([4, 5, 6]), torch.randint(20, (3, 5)))
    torch.testing.assert_close(loss, torch.tensor(6 * math.log(2)))
    assert model.embeddings.shape == (20, 8)


def _mean_percentile_rank(embeddings, vocab, pairs):
    """For each pair (a, b): the fraction of the vocabulary closer to a than b is.

    0 means b is a's nearest neighbour; for unrelated vectors it is uniform on [0, 1].
    """
    unit = torch.nn.functional.normalize(embeddings, dim=-1)
    ranks = []
    for a, b in pairs:
        i, j = vocab.index(a), vocab.index(b)
        similarity = unit @ unit[i]
        similarity[[i, vocab.index(vocab.unknown)]] = -2.0  # leave out a itself and <unk>
        ranks.append((similarity > similarity[j]).sum().item() / (len(vocab) - 2))
    return sum(ranks) / len(ranks)


def test_word2vec_on_pydoc_puts_related_words_close():
    corpus = ea.load_pydoc_corpus(documents=True)
    model, vocab = ea.train_word2vec(
        corpus, dim=64, window=5, epochs=2, batch_size=2048, lr=0.03, seed=0, progress=False
    )
    assert all(a in vocab and b in vocab for a, b in RELATED_PAIRS)
    trained = _mean_percentile_rank(model.embeddings, vocab, RELATED_PAIRS)
    permutation = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(1))
    shuffled = _mean_percentile_rank(model.embeddings[permutation], vocab, RELATED_PAIRS)
    # With vectors unrelated to the words (shuffled rows), each percentile rank is uniform
    # on [0, 1]: the mean of 16 has mean 0.5 and standard deviation sqrt(1/12)/4 = 0.072.
    # A mean below 0.2 lies more than 4 standard deviations below chance (p < 1e-4), so
    # it shows the embedding learned the relations; the shuffled control must look random.
    assert trained < 0.2
    assert shuffled > 0.3
    neighbours = [word for word, _ in ea.most_similar("true", model.embeddings, vocab, topk=5)]
    assert "true" not in neighbours and len(neighbours) == 5


def test_training_is_seeded():
    corpus = ea.load_pydoc_corpus()[:3000]
    first, _ = ea.train_word2vec(corpus, dim=8, epochs=1, seed=3, progress=False)
    again, _ = ea.train_word2vec(corpus, dim=8, epochs=1, seed=3, progress=False)
    other, _ = ea.train_word2vec(corpus, dim=8, epochs=1, seed=4, progress=False)
    assert torch.equal(first.embeddings, again.embeddings)
    assert not torch.equal(first.embeddings, other.embeddings)


def test_most_similar_orders_by_cosine():
    vocab = ea.Vocabulary("a b c d".split())
    embeddings = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 0.1], [-1.0, 0.0], [0.0, 3.0]])
    result = ea.most_similar("a", embeddings, vocab, topk=3)
    assert [word for word, _ in result] == ["b", "d", "c"]
    assert result[0][1] == pytest.approx(math.cos(math.atan(0.1)))
    assert ea.cosine_similarity_matrix(embeddings[1:]).diagonal().allclose(torch.ones(4))


def test_bad_input():
    vocab = ea.Vocabulary("a b c".split())
    with pytest.raises(KeyError, match="'zzz' is not in the vocabulary"):
        ea.most_similar("zzz", torch.randn(4, 2), vocab)
    with pytest.raises(ValueError, match="embeddings must have one row per vocabulary entry"):
        ea.most_similar("a", torch.randn(3, 2), vocab)
    with pytest.raises(TypeError, match="tokens must be an iterable of str tokens, got one str"):
        ea.Vocabulary("a b c")
    with pytest.raises(ValueError, match="min_count must be a positive int, got 0"):
        ea.Vocabulary(["a"], min_count=0)
    with pytest.raises(TypeError, match="corpus must be a str, a non-empty list"):
        ea.train_word2vec([], progress=False)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        ea.train_word2vec("a b c", window=0, progress=False)


def test_a_corpus_that_gives_no_pair_trains_without_crashing():
    """Issue 14: an epoch with no (center, context) pair crashed. Two one-word documents
    give no pair: the model is returned untouched (output vectors still zero)."""
    model, vocab = ea.train_word2vec([["alpha"], ["alpha"]], dim=4, min_count=1,
                                     subsample=None, epochs=2, progress=False)
    assert "alpha" in vocab
    assert torch.equal(model.output_embeddings.weight, torch.zeros_like(
        model.output_embeddings.weight))
    with pytest.raises(ValueError, match="no word seen at least min_count=5"):
        ea.train_word2vec("a b c", min_count=5, progress=False)
    with pytest.raises(TypeError, match="progress must be a bool"):
        ea.train_word2vec("a b c a b c", min_count=1, progress="no")
