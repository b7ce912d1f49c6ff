r"""Word embeddings learned from context: skip-gram with negative sampling (word2vec).

A word is described by the company it keeps. Skip-gram gives every word ``w`` an
input vector ``v_w`` and an output vector ``u_w`` and trains them so that a word
predicts the words around it. For a (center ``c``, context ``o``) pair seen in
the text and ``K`` *negative* words ``n_1..n_K`` drawn from the noise distribution
``P(w) ~ count(w)^{3/4}``, the loss is

.. math::
    -\log \sigma(u_o^\top v_c) - \sum_{k=1}^{K} \log \sigma(-u_{n_k}^\top v_c),

a logistic regression that tells real pairs from random ones. Words used in similar
contexts end up with similar input vectors, measured by cosine similarity.

Frequent words ("the", "a") carry little information; each occurrence of a word
with frequency ``f`` is kept with probability ``min(1, sqrt(t / f) + t / f)``
(subsampling, ``t ~ 1e-3``), which also widens the effective window.

Reference: T. Mikolov, I. Sutskever, K. Chen, G. Corrado and J. Dean, "Distributed
representations of words and phrases and their compositionality", NeurIPS 2013.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    check_bool,
    check_generator,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "tokenize",
    "load_pydoc_corpus",
    "Vocabulary",
    "SkipGram",
    "train_word2vec",
    "most_similar",
    "cosine_similarity_matrix",
]

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and split it into words (runs of letters, with an apostrophe)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _WORD.findall(text.lower())


def load_pydoc_corpus(*, documents: bool = False) -> list[str] | list[list[str]]:
    """The documentation bundled with Python (``pydoc_data.topics``), tokenised.

    About 80 topics (the language reference behind ``help('if')`` and friends), some
    65 000 words of English prose about Python, available offline in every install.
    Returns one flat list of tokens, or one list per topic when ``documents``.
    """
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)]
    tokenised = [tokenize(text) for text in texts]
    if documents:
        return tokenised
    return [token for document in tokenised for token in document]


class Vocabulary:
    """Map between tokens and indices ``0..len-1``, most frequent first.

    Args:
        tokens: the corpus (an iterable of strings).
        min_count: keep tokens seen at least this often.
        max_size: keep at most this many tokens (the most frequent; ties broken
            alphabetically), not counting the unknown token.
        unknown: the token that stands for every dropped or unseen token, at index 0
            with the count of all dropped occurrences; ``None`` for no unknown token
            (then :meth:`index` raises ``KeyError`` for an unknown token).

    Attributes: ``itos`` (list of tokens), ``stoi`` (dict token -> index), ``counts``
    (list of counts, aligned with ``itos``).
    """

    def __init__(
        self,
        tokens: Iterable[str],
        *,
        min_count: int = 1,
        max_size: int | None = None,
        unknown: str | None = "<unk>",
    ) -> None:
        if isinstance(tokens, str):
            raise TypeError("tokens must be an iterable of str tokens, got one str; tokenize it")
        check_positive_int(min_count, "min_count")
        if max_size is not None:
            check_positive_int(max_size, "max_size")
        counter = Counter(tokens)
        for token in counter:
            if not isinstance(token, str):
                raise TypeError(f"tokens must be strings, got {type(token).__name__} {token!r}")
        if unknown is not None and unknown in counter:
            raise ValueError(f"unknown={unknown!r} also occurs as a token in the corpus")
        ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
        kept = [(token, count) for token, count in ranked if count >= min_count]
        if max_size is not None:
            kept = kept[:max_size]
        self.unknown = unknown
        self.itos: list[str] = []
        self.counts: list[int] = []
        if unknown is not None:
            self.itos.append(unknown)
            self.counts.append(sum(counter.values()) - sum(count for _, count in kept))
        self.itos += [token for token, _ in kept]
        self.counts += [count for _, count in kept]
        self.stoi: dict[str, int] = {token: i for i, token in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: object) -> bool:
        return token in self.stoi and token != self.unknown

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)}, unknown={self.unknown!r})"

    def index(self, token: str) -> int:
        """Index of ``token``; the unknown token's index if it is not in the vocabulary."""
        if token in self.stoi:
            return self.stoi[token]
        if self.unknown is None:
            raise KeyError(f"token {token!r} is not in the vocabulary (and unknown=None)")
        return self.stoi[self.unknown]

    def token(self, index: int) -> str:
        """Token at ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index must lie in [0, {len(self)}), got {index}")
        return self.itos[index]

    def encode(self, tokens: Iterable[str]) -> torch.Tensor:
        """Tokens -> ``int64`` tensor of indices (unknown tokens -> the unknown index)."""
        return torch.tensor([self.index(token) for token in tokens], dtype=torch.long)

    def decode(self, indices: Iterable[int] | torch.Tensor) -> list[str]:
        """Indices -> tokens."""
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        return [self.token(int(i)) for i in indices]

    def frequencies(self) -> torch.Tensor:
        """Relative frequencies ``count / total`` as a float64 tensor ``(len,)``."""
        counts = torch.tensor(self.counts, dtype=torch.float64)
        return counts / counts.sum().clamp_min(1)


class SkipGram(nn.Module):
    """Skip-gram model: input (word) and output (context) embeddings of size ``dim``.

    ``forward(centers (B,), contexts (B,), negatives (B, K))`` returns the mean
    negative-sampling loss ``-log s(u_o . v_c) - sum_k log s(-u_nk . v_c)``.
    Input vectors start uniform in ``[-0.5/dim, 0.5/dim]`` (drawn with ``generator``),
    output vectors at zero (as in the original word2vec). Cost per batch ``O(B K dim)``.
    """

    def __init__(
        self, vocab_size: int, dim: int, *, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size")
        check_positive_int(dim, "dim")
        generator = check_generator(generator)
        self.input_embeddings = nn.Embedding(vocab_size, dim)
        self.output_embeddings = nn.Embedding(vocab_size, dim)
        nn.init.uniform_(
            self.input_embeddings.weight, -0.5 / dim, 0.5 / dim, generator=generator
        )
        nn.init.zeros_(self.output_embeddings.weight)

    @property
    def embeddings(self) -> torch.Tensor:
        """The word vectors ``(vocab_size, dim)`` (input embeddings, detached)."""
        return self.input_embeddings.weight.detach()

    def forward(
        self, centers: torch.Tensor, contexts: torch.Tensor, negatives: torch.Tensor
    ) -> torch.Tensor:
        v = self.input_embeddings(centers)  # (B, dim)
        u_pos = self.output_embeddings(contexts)  # (B, dim)
        u_neg = self.output_embeddings(negatives)  # (B, K, dim)
        positive = F.logsigmoid((u_pos * v).sum(dim=-1))  # (B,)
        negative = F.logsigmoid(-(u_neg @ v.unsqueeze(-1)).squeeze(-1)).sum(dim=-1)  # (B,)
        return -(positive + negative).mean()


def _as_documents(corpus: object) -> list[list[str]]:
    if isinstance(corpus, str):
        return [tokenize(corpus)]
    if not isinstance(corpus, Sequence) or len(corpus) == 0:
        raise TypeError(
            "corpus must be a str, a non-empty list of tokens or a list of token lists, "
            f"got {type(corpus).__name__}"
        )
    if all(isinstance(item, str) for item in corpus):
        return [list(corpus)]
    if all(isinstance(item, Sequence) and not isinstance(item, str) for item in corpus):
        return [list(document) for document in corpus]
    raise TypeError("corpus must hold either only str tokens or only lists of str tokens")


def _skipgram_pairs(
    ids: torch.Tensor, doc: torch.Tensor, window: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, context) pairs within a random window ``1..window`` of each center.

    ``ids``, ``doc`` ``(T,)``: token indices and document ids. Pairs never cross
    documents. Drawing the window size per center, as word2vec does, weighs near
    neighbours more than far ones.
    """
    span = torch.randint(1, window + 1, ids.shape, generator=generator)  # (T,)
    centers, contexts = [ids[:0]], [ids[:0]]
    for offset in range(1, min(window, len(ids) - 1) + 1):  # offsets within the corpus
        for sign in (1, -1):
            shift = sign * offset
            left = slice(max(0, -shift), len(ids) - max(0, shift))
            right = slice(max(0, shift), len(ids) - max(0, -shift))
            ok = (doc[left] == doc[right]) & (span[left] >= offset)
            centers.append(ids[left][ok])
            contexts.append(ids[right][ok])
    return torch.cat(centers), torch.cat(contexts)


def train_word2vec(
    corpus: str | Sequence[str] | Sequence[Sequence[str]],
    *,
    dim: int = 64,
    window: int = 5,
    negatives: int = 5,
    epochs: int = 5,
    lr: float = 0.01,
    batch_size: int = 1024,
    min_count: int = 3,
    max_vocab: int | None = None,
    subsample: float | None = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> tuple[SkipGram, Vocabulary]:
    """Train skip-gram with negative sampling; returns ``(model, vocab)``.

    ``model.embeddings`` are the word vectors, rows indexed by ``vocab``.

    Args:
        corpus: a text (tokenised with :func:`tokenize`), a list of tokens, or a list
            of documents (lists of tokens; context windows stay inside a document).
        dim: embedding size. window: largest distance between center and context.
        negatives: ``K``, negative words per pair, drawn from ``count^{3/4}``.
        epochs, lr, batch_size: Adam optimisation over shuffled pairs.
        min_count, max_vocab: vocabulary size (rarer words are dropped from training).
        subsample: threshold ``t`` of frequent-word subsampling (``None``: off).
        seed: seeds every draw (subsampling, windows, negatives, order, init).
        progress: show a tqdm progress bar.

    An epoch that yields no (center, context) pair (a corpus of a few words, thinned by
    subsampling) makes no update; a corpus with no word kept in the vocabulary raises
    ``ValueError``.

    Cost per epoch: ``O(P (K + 1) dim)`` for ``P ~ 2 * window * T`` pairs of a corpus of
    ``T`` tokens (fewer after subsampling).
    """
    from tqdm import tqdm  # a text bar: tqdm.auto would use a widget that needs CDN scripts

    for name, value in (("dim", dim), ("window", window), ("negatives", negatives)):
        check_positive_int(value, name)
    check_positive_int(epochs, "epochs")
    check_positive_int(batch_size, "batch_size")
    check_positive_float(lr, "lr")
    check_nonnegative_int(seed, "seed")
    check_bool(progress, "progress")
    if subsample is not None:
        check_positive_float(subsample, "subsample")
    documents = _as_documents(corpus)
    vocab = Vocabulary(
        (token for document in documents for token in document),
        min_count=min_count,
        max_size=max_vocab,
    )
    generator = torch.Generator().manual_seed(seed)
    model = SkipGram(len(vocab), dim, generator=generator)

    unknown = vocab.index(vocab.unknown)
    ids = torch.cat([vocab.encode(document) for document in documents])  # (T,)
    doc = torch.cat(
        [torch.full((len(document),), i, dtype=torch.long) for i, document in enumerate(documents)]
    )
    known = ids != unknown
    ids, doc = ids[known], doc[known]
    frequency = vocab.frequencies()
    if subsample is not None:
        ratio = subsample / frequency.clamp_min(1e-12)
        keep_probability = (ratio.sqrt() + ratio).clamp(max=1.0).to(torch.float32)
    noise = torch.tensor(vocab.counts, dtype=torch.float64) ** 0.75
    noise[unknown] = 0.0
    if not bool((noise > 0).any()):
        raise ValueError(
            f"corpus has no word seen at least min_count={min_count} times: nothing to "
            "train on (lower min_count or give a longer corpus)"
        )

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    bar = tqdm(total=epochs, desc="word2vec", disable=not progress)
    for _ in range(epochs):
        if subsample is not None:
            kept = torch.rand(ids.shape, generator=generator) < keep_probability[ids]
            epoch_ids, epoch_doc = ids[kept], doc[kept]
        else:
            epoch_ids, epoch_doc = ids, doc
        centers, contexts = _skipgram_pairs(epoch_ids, epoch_doc, window, generator)
        if len(centers) == 0:  # a tiny corpus (after subsampling) can give no pair at all
            bar.update(1)
            bar.set_postfix(loss="n/a", pairs=0)
            continue
        order = torch.randperm(len(centers), generator=generator)
        centers, contexts = centers[order], contexts[order]
        noise_words = torch.multinomial(
            noise, len(centers) * negatives, replacement=True, generator=generator
        ).view(len(centers), negatives)
        total = 0.0
        for start in range(0, len(centers), batch_size):
            batch = slice(start, start + batch_size)
            loss = model(centers[batch], contexts[batch], noise_words[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(centers[batch])
        bar.update(1)
        bar.set_postfix(loss=f"{total / max(len(centers), 1):.3f}", pairs=len(centers))
    bar.close()
    return model, vocab


def _check_embeddings(embeddings: object) -> None:
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(
            "embeddings must be a 2-D floating tensor (vocab_size, dim), got shape "
            f"{tuple(embeddings.shape)} and dtype {embeddings.dtype}"
        )


def cosine_similarity_matrix(embeddings: torch.Tensor) -> torch.Tensor:
    """Cosine similarities ``(V, V)`` between the rows of ``embeddings (V, dim)``."""
    _check_embeddings(embeddings)
    unit = F.normalize(embeddings, dim=-1)
    return unit @ unit.T


def most_similar(
    word: str, embeddings: torch.Tensor, vocab: Vocabulary, topk: int = 10
) -> list[tuple[str, float]]:
    """The ``topk`` words whose vectors have the largest cosine similarity to ``word``'s.

    ``embeddings (len(vocab), dim)``. The word itself and the unknown token are
    excluded. Returns ``[(token, similarity), ...]``, most similar first. Cost
    ``O(V dim)``.
    """
    _check_embeddings(embeddings)
    if embeddings.shape[0] != len(vocab):
        raise ValueError(
            f"embeddings must have one row per vocabulary entry ({len(vocab)}), "
            f"got {embeddings.shape[0]} rows"
        )
    check_positive_int(topk, "topk")
    if word not in vocab:
        raise KeyError(f"word {word!r} is not in the vocabulary")
    unit = F.normalize(embeddings.detach(), dim=-1)  # (V, dim)
    similarity = unit @ unit[vocab.index(word)]  # (V,)
    similarity[vocab.index(word)] = float("-inf")
    if vocab.unknown is not None:
        similarity[vocab.index(vocab.unknown)] = float("-inf")
    count = min(topk, int(torch.isfinite(similarity).sum()))
    values, indices = similarity.topk(count)
    return [(vocab.token(int(i)), float(s)) for s, i in zip(values, indices, strict=True)]
