"""Tests for sparse selection (issue 28, point 1): block-sparse attention, the Longformer
and BigBird block masks, Reformer's LSH attention and top-k block selection.

Every attention function is compared in float64 with ``softmax_attention`` under the dense
mask its docstring states. ``softmax_attention`` takes only a key padding mask
``(..., n_k)``, the same for every query; a mask per (query, key) pair is given to it by
making each query its own batch element: ``q (..., n_q, 1, d)`` against the keys
``(..., n_q, n_k, d)`` (an expanded view), with ``key_padding_mask = ~visible``. Queries
with no visible key then get zeros, as softmax_attention documents.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import efficient_attention as ea

F64 = torch.float64
ATOL = 1e-12
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _randn(*shape, seed, dtype=F64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def _blocks(n, block_size):
    return -(-n // block_size)


def _masked_reference(q, k, v, visible, causal=False):
    """softmax_attention with query i seeing key j iff visible[..., i, j] (and j <= i when
    causal), one query per batch element."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        visible = visible & torch.ones(n_q, n_k, dtype=torch.bool).tril()
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                   visible.shape[:-2])
    q = q.expand(*batch, n_q, q.shape[-1]).unsqueeze(-2)  # (..., n_q, 1, d)
    k = k.expand(*batch, n_k, k.shape[-1]).unsqueeze(-3).expand(*batch, n_q, n_k, -1)
    v = v.expand(*batch, n_k, v.shape[-1]).unsqueeze(-3).expand(*batch, n_q, n_k, -1)
    out = ea.softmax_attention(q, k, v, key_padding_mask=~visible.expand(*batch, n_q, n_k))
    return out.squeeze(-2)


def _token_mask(block_mask, n_q, n_k, block_size):
    """block_mask[..., i // B, j // B], written out independently of the library."""
    rows = torch.arange(n_q) // block_size
    cols = torch.arange(n_k) // block_size
    return block_mask[..., rows, :][..., cols]


def _random_block_mask(*shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) < density


# --- block_sparse_attention --------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, block_size", [(37, 8), (64, 16), (5, 8), (48, 48), (33, 1)])
def test_block_sparse_equals_masked_softmax_attention(causal, n, block_size):
    q, k, v = (_randn(2, 3, n, e, seed=s) for s, e in ((1, 5), (2, 5), (3, 4)))
    nb = _blocks(n, block_size)
    block_mask = _random_block_mask(2, 1, nb, nb, density=0.4, seed=4)  # broadcast over heads
    padding = _random_block_mask(2, 1, n, density=0.2, seed=5)
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=block_size, causal=causal,
                                    key_padding_mask=padding)
    visible = _token_mask(block_mask, n, n, block_size) & ~padding.unsqueeze(-2)
    torch.testing.assert_close(out, _masked_reference(q, k, v, visible, causal), atol=ATOL,
                               rtol=0)


def test_block_sparse_cross_attention_and_shared_mask():
    q, k, v = _randn(2, 11, 4, seed=6), _randn(2, 29, 4, seed=7), _randn(1, 29, 3, seed=8)
    block_mask = _random_block_mask(_blocks(11, 4), _blocks(29, 4), density=0.5, seed=9)
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=4)
    expected = _masked_reference(q, k, v, _token_mask(block_mask, 11, 29, 4))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    # the library's own expansion agrees with the one written here
    assert torch.equal(ea.block_mask_to_token_mask(block_mask, 11, 29, block_size=4),
                       _token_mask(block_mask, 11, 29, 4))


def test_all_blocks_selected_is_exact_attention():
    q, k, v = (_randn(3, 50, 6, seed=s) for s in (10, 11, 12))
    every = torch.ones(_blocks(50, 16), _blocks(50, 16), dtype=torch.bool)
    for causal in (False, True):
        torch.testing.assert_close(
            ea.block_sparse_attention(q, k, v, every, block_size=16, causal=causal),
            ea.softmax_attention(q, k, v, causal=causal), atol=ATOL, rtol=0)


def test_queries_without_keys_get_zeros_and_padding_never_leaks():
    q, k, v = (_randn(2, 24, 4, seed=s) for s in (13, 14, 15))
    block_mask = torch.zeros(2, 3, 3, dtype=torch.bool)
    block_mask[0, 1, 2] = True  # one block for one row of one batch element
    block_mask[1, 0, 0] = True
    padding = torch.zeros(2, 24, dtype=torch.bool)
    padding[1, :8] = True  # batch 1 row 0's only block is all padding
    k[1, :8] = float("nan")
    v[1, :8] = float("inf")
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=8, key_padding_mask=padding)
    assert torch.isfinite(out).all()
    assert out[0, 8:16].abs().sum() > 0  # row 1 of batch 0 sees block 2
    out[0, 8:16] = 0
    assert torch.equal(out, torch.zeros_like(out))  # everything else sees nothing: zeros


def test_uneven_rows_global_blocks_and_many_steps(monkeypatch):
    """Rows selecting very different numbers of blocks (a global row sees everything),
    processed in several steps, equal the reference."""
    import efficient_attention.sparse.block_sparse as block_sparse

    monkeypatch.setattr(block_sparse, "_SCORES_PER_STEP", 64)  # one row per step
    monkeypatch.setattr(block_sparse, "_MASKED_SCORES_PER_STEP", 64)
    n, block = 70, 8
    q, k, v = (_randn(2, n, 4, seed=s) for s in (16, 17, 18))
    block_mask = ea.longformer_block_mask(n, block_size=block, window=1, num_global=1)
    for causal in (False, True):
        out = ea.block_sparse_attention(q, k, v, block_mask, block_size=block, causal=causal)
        expected = _masked_reference(q, k, v, _token_mask(block_mask, n, n, block), causal)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_gradcheck(causal):
    q, k, v = (_randn(2, 7, 2, seed=s, requires_grad=True) for s in (19, 20, 21))
    block_mask = _random_block_mask(2, 3, 3, density=0.6, seed=22)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, 3] = True
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.block_sparse_attention(q, k, v, block_mask, block_size=3,
                                                  causal=causal, key_padding_mask=padding),
        (q, k, v))
    assert block_mask.sum(-1).tolist() == [[2, 2, 0], [0, 2, 1]]  # uneven and empty rows


def test_block_sparse_gradients_equal_the_reference_and_are_finite_for_empty_rows():
    q, k, v = (_randn(2, 12, 3, seed=s, requires_grad=True) for s in (23, 24, 25))
    block_mask = _random_block_mask(2, 3, 3, density=0.4, seed=26)
    block_mask[0, 0] = False  # a row that sees nothing
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=4)  # the autograd path
    visible = _token_mask(block_mask, 12, 12, 4)
    reference = _masked_reference(q, k, v, visible)
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sparse_half_and_single_precision(dtype):
    q, k, v = (_randn(2, 40, 8, seed=s) for s in (27, 28, 29))
    block_mask = _random_block_mask(5, 5, density=0.5, seed=30) | torch.eye(5, dtype=torch.bool)
    expected = ea.block_sparse_attention(q, k, v, block_mask, block_size=8, causal=True)
    out = ea.block_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_mask,
                                    block_size=8, causal=True)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.to(F64), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape_q, shape_k, d_v", [
    ((2, 0, 4), (2, 0, 4), 3),   # n = 0
    ((0, 6, 4), (0, 6, 4), 3),   # batch 0
    ((2, 6, 4), (2, 0, 4), 3),   # no key
    ((2, 6, 4), (2, 6, 4), 0),   # no value feature
])
def test_block_sparse_empty_sizes(shape_q, shape_k, d_v):
    q = _randn(*shape_q, seed=31, requires_grad=True)
    k = _randn(*shape_k, seed=32, requires_grad=True)
    v = _randn(*shape_k[:-1], d_v, seed=33, requires_grad=True)
    block_mask = torch.ones(_blocks(shape_q[-2], 4), _blocks(shape_k[-2], 4), dtype=torch.bool)
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=4)
    assert out.shape == (*shape_q[:-1], d_v) and not out.abs().sum()
    out.sum().backward()  # part of the graph, zero gradients
    assert not q.grad.abs().sum()


def test_block_sparse_nothing_selected_backward_works():
    q, k, v = (_randn(1, 9, 2, seed=s, requires_grad=True) for s in (34, 35, 36))
    out = ea.block_sparse_attention(q, k, v, torch.zeros(3, 3, dtype=torch.bool), block_size=3)
    assert torch.equal(out, torch.zeros(1, 9, 2, dtype=F64))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_block_sparse_bad_inputs():
    q, k, v = (_randn(2, 10, 4, seed=s) for s in (37, 38, 39))
    good = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"block_mask must have dtype torch.bool.*float"):
        ea.block_sparse_attention(q, k, v, good.double(), block_size=4)
    with pytest.raises(TypeError, match="block_mask must be a bool torch.Tensor, got list"):
        ea.block_sparse_attention(q, k, v, [[True]], block_size=4)
    with pytest.raises(ValueError, match=r"block_mask must have shape \(\.\.\., 3, 3\).*\(2, 3\)"):
        ea.block_sparse_attention(q, k, v, good[:2], block_size=4)
    with pytest.raises(ValueError, match=r"block_mask must be broadcastable to \(2, 3, 3\)"):
        ea.block_sparse_attention(q, k, v, torch.ones(3, 3, 3, dtype=torch.bool), block_size=4)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        ea.block_sparse_attention(q, k, v, good, block_size=0)
    with pytest.raises(TypeError, match="block_size must be a positive int, got bool"):
        ea.block_sparse_attention(q, k, v, good, block_size=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ea.block_sparse_attention(q, k, v, good, block_size=4, causal=1)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        ea.block_sparse_attention(q, k[:, :8], v[:, :8], good[:, :2], block_size=4,
                                  causal=True)
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        ea.block_sparse_attention(q, k, v, good, block_size=4,
                                  key_padding_mask=torch.zeros(2, 10))
    with pytest.raises(TypeError, match="q must be a real floating-point tensor"):
        ea.block_sparse_attention(q.long(), k, v, good, block_size=4)


# --- Longformer and BigBird block masks --------------------------------------------------


def test_longformer_mask_is_window_plus_global():
    mask = ea.longformer_block_mask(70, block_size=8, window=1, num_global=2)
    nb = 9
    assert mask.shape == (nb, nb) and mask.dtype == torch.bool
    for i in range(nb):
        for j in range(nb):
            assert bool(mask[i, j]) == (abs(i - j) <= 1 or i < 2 or j < 2), (i, j)
    causal = ea.longformer_block_mask(70, block_size=8, window=1, num_global=2, causal=True)
    assert torch.equal(causal, mask.tril())
    assert torch.equal(ea.longformer_block_mask(64, block_size=8, window=0),
                       torch.eye(8, dtype=torch.bool))


@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_mask_adds_random_blocks_to_longformer(causal):
    kw = dict(block_size=4, window=1, num_global=1, causal=causal)
    base = ea.longformer_block_mask(64, **kw)
    mask = ea.bigbird_block_mask(64, num_random=3, generator=torch.Generator().manual_seed(0),
                                 **kw)
    assert torch.equal(mask & base, base)  # the window and global blocks are all kept
    free = ~base & (base.new_ones(16, 16).tril() if causal else base.new_ones(16, 16))
    extra = mask & ~base
    assert not (extra & ~free).any()  # random blocks only where free (never future)
    assert torch.equal(extra.sum(-1), free.sum(-1).clamp(max=3))  # r per row, or all left
    again = ea.bigbird_block_mask(64, num_random=3,
                                  generator=torch.Generator().manual_seed(0), **kw)
    other = ea.bigbird_block_mask(64, num_random=3,
                                  generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(mask, again) and not torch.equal(mask, other)


def test_bigbird_attention_equals_reference():
    n, block = 45, 4
    q, k, v = (_randn(2, 2, n, 4, seed=s) for s in (40, 41, 42))
    mask = ea.bigbird_block_mask(n, block_size=block, window=1, num_global=1, num_random=2,
                                 generator=torch.Generator().manual_seed(3))
    out = ea.block_sparse_attention(q, k, v, mask, block_size=block, causal=True)
    expected = _masked_reference(q, k, v, _token_mask(mask, n, n, block), causal=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_pattern_bad_inputs_and_empty():
    with pytest.raises(ValueError, match="window must be a non-negative int, got -1"):
        ea.longformer_block_mask(10, block_size=2, window=-1)
    with pytest.raises(TypeError, match="num_random must be a non-negative int, got float"):
        ea.bigbird_block_mask(10, block_size=2, window=1, num_global=0, num_random=1.0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None"):
        ea.bigbird_block_mask(10, block_size=2, window=1, num_global=0, num_random=1,
                              generator=0)
    assert ea.bigbird_block_mask(0, block_size=2, window=1, num_global=1,
                                 num_random=2).shape == (0, 0)


# --- LSH attention -----------------------------------------------------------------------


def _lsh_windows(buckets, chunk_size):
    """(..., H, n, n) bool: j in i's window in round r, from the buckets, written out."""
    n = buckets.shape[-1]
    ranks = torch.argsort(buckets * n + torch.arange(n), dim=-1).argsort(dim=-1)
    chunk = ranks // chunk_size
    lag = chunk.unsqueeze(-1) - chunk.unsqueeze(-2)  # c(i) - c(j)
    return (lag == 0) | (lag == 1)


def _lsh_reference(qk, v, windows, causal, deduplicate):
    """softmax_attention against the keys qk / |qk| under the LSH mask. Without
    deduplication the keys are repeated once per round, copy r visible where round r's
    window holds the key: a key in m windows then counts m times."""
    n, hashes = qk.shape[-2], windows.shape[-3]
    keys = F.normalize(qk, dim=-1)
    itself = torch.eye(n, dtype=torch.bool)
    rounds = windows & ~itself  # (..., H, n, n)
    if causal:
        rounds = rounds & torch.ones(n, n, dtype=torch.bool).tril()
    alone = itself & ~rounds.any(-3).any(-1, keepdim=True)  # nobody else anywhere: itself
    if deduplicate:
        return _masked_reference(qk, keys, v, rounds.any(-3) | alone)
    copies = [rounds[..., r, :, :] for r in range(hashes)]
    copies[0] = copies[0] | alone
    return _masked_reference(qk, torch.cat([keys] * hashes, -2), torch.cat([v] * hashes, -2),
                             torch.cat(copies, -1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deduplicate", [True, False])
def test_lsh_equals_masked_attention_for_its_hashes(causal, deduplicate):
    n, hashes, chunk = 23, 3, 4
    qk, v = _randn(2, 2, n, 6, seed=43), _randn(2, 2, n, 3, seed=44)
    kw = dict(num_hashes=hashes, num_buckets=4)
    out = ea.lsh_attention(qk, v, chunk_size=chunk, causal=causal,
                           generator=torch.Generator().manual_seed(5),
                           deduplicate=deduplicate, **kw)
    buckets = ea.lsh_buckets(qk, generator=torch.Generator().manual_seed(5), **kw)
    assert buckets.shape == (2, 2, hashes, n) and 0 <= buckets.min() <= buckets.max() < 4
    expected = _lsh_reference(qk, v, _lsh_windows(buckets, chunk), causal, deduplicate)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_lsh_rounds_that_repeat_a_key_count_it_once_only_when_deduplicated():
    """Identical rounds (one bucket each way) put the same keys in every window: dedup
    gives one round's result, the plain merge too (every key counted H times cancels),
    while a single round with a wider window differs."""
    qk, v = _randn(1, 12, 4, seed=45), _randn(1, 12, 2, seed=46)
    one = ea.lsh_attention(qk, v, num_hashes=1, num_buckets=2, chunk_size=12)
    many = ea.lsh_attention(qk, v, num_hashes=4, num_buckets=2, chunk_size=12)
    plain = ea.lsh_attention(qk, v, num_hashes=4, num_buckets=2, chunk_size=12,
                             deduplicate=False)
    torch.testing.assert_close(many, one, atol=ATOL, rtol=0)
    torch.testing.assert_close(plain, one, atol=ATOL, rtol=0)
    # with several chunks the rounds overlap partly: counting duplicates changes the result
    kw = dict(num_hashes=3, num_buckets=4, chunk_size=3)
    dedup = ea.lsh_attention(qk, v, generator=torch.Generator().manual_seed(2), **kw)
    plain = ea.lsh_attention(qk, v, generator=torch.Generator().manual_seed(2),
                             deduplicate=False, **kw)
    assert (dedup - plain).abs().max() > 1e-3


def test_lsh_one_chunk_is_full_attention_without_self():
    n = 9
    qk, v = _randn(3, n, 5, seed=47), _randn(3, n, 2, seed=48)
    not_self = ~torch.eye(n, dtype=torch.bool)
    for causal in (False, True):
        out = ea.lsh_attention(qk, v, num_hashes=2, num_buckets=6, chunk_size=n,
                               causal=causal, generator=torch.Generator().manual_seed(0))
        expected = _masked_reference(qk, F.normalize(qk, dim=-1), v, not_self, causal)
        if causal:  # token 0 has nobody before it: it attends to itself
            expected[:, 0] = v[:, 0]
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_lsh_buckets_are_the_argmax_over_plus_minus_rotations():
    qk = _randn(2, 7, 3, seed=49)
    rotations = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(8), dtype=F64)
    projected = torch.einsum("bnd,hdk->bhnk", qk, rotations)
    expected = torch.cat([projected, -projected], -1).argmax(-1)
    got = ea.lsh_buckets(qk, num_hashes=2, num_buckets=6,
                         generator=torch.Generator().manual_seed(8))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("deduplicate", [True, False])
def test_lsh_gradcheck(deduplicate):
    qk, v = _randn(1, 7, 3, seed=50, requires_grad=True), _randn(1, 7, 2, seed=51,
                                                                   requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda qk, v: ea.lsh_attention(qk, v, num_hashes=2, num_buckets=2, chunk_size=2,
                                       causal=True, generator=torch.Generator().manual_seed(1),
                                       deduplicate=deduplicate), (qk, v))


def test_lsh_empty_and_bad_inputs():
    for shape in ((2, 0, 3), (0, 5, 3)):
        qk = _randn(*shape, seed=52, requires_grad=True)
        out = ea.lsh_attention(qk, _randn(*shape[:-1], 2, seed=53), num_hashes=1,
                               num_buckets=2, chunk_size=2)
        assert out.shape == (*shape[:-1], 2)
        out.sum().backward()
    qk, v = _randn(6, 4, seed=54), _randn(6, 2, seed=55)
    with pytest.raises(ValueError, match="num_buckets must be a positive even int, got 3"):
        ea.lsh_attention(qk, v, num_hashes=1, num_buckets=3, chunk_size=2)
    with pytest.raises(ValueError, match="num_hashes must be a positive int, got 0"):
        ea.lsh_attention(qk, v, num_hashes=0, num_buckets=2, chunk_size=2)
    with pytest.raises(ValueError, match=r"qk and v must have the same sequence length n.*"
                                         r"\(5, 2\)"):
        ea.lsh_attention(qk, v[:5], num_hashes=1, num_buckets=2, chunk_size=2)
    with pytest.raises(TypeError, match="qk and v must share one dtype"):
        ea.lsh_attention(qk, v.float(), num_hashes=1, num_buckets=2, chunk_size=2)
    with pytest.raises(ValueError, match=r"qk must have at least one feature.*\(6, 0\)"):
        ea.lsh_attention(qk[:, :0], v, num_hashes=1, num_buckets=2, chunk_size=2)
    with pytest.raises(TypeError, match="deduplicate must be a bool"):
        ea.lsh_attention(qk, v, num_hashes=1, num_buckets=2, chunk_size=2, deduplicate=None)


# --- top-k block selection ---------------------------------------------------------------


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_selection_keeps_the_best_mean_key_blocks(causal, per_query):
    n, block, top_k = 30, 4, 3
    q, k = _randn(2, n, 5, seed=56), _randn(2, n, 5, seed=57)
    nb = _blocks(n, block)
    selected = ea.topk_block_mask(q, k, block_size=block, top_k=top_k, causal=causal,
                                  per_query=per_query)
    means = torch.stack([k[:, j * block:(j + 1) * block].mean(1) for j in range(nb)], 1)
    queries = q if per_query else torch.stack(
        [q[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1)
    assert selected.shape == (2, queries.shape[1], nb)
    scores = queries @ means.transpose(-2, -1)
    own = (torch.arange(n) // block if per_query else torch.arange(nb)).unsqueeze(-1)
    blocks = torch.arange(nb)
    allowed = blocks <= own if causal else torch.ones(len(own), nb, dtype=torch.bool)
    assert not (selected & ~allowed).any()  # never a future block
    assert torch.equal(selected.sum(-1), allowed.sum(-1).clamp(max=top_k).expand(2, -1))
    if causal:
        assert selected[..., blocks == own].all()  # the own block, always
        scores = scores.masked_fill(blocks == own, float("inf"))
    # every selected allowed block scores at least as high as every unselected one
    low = scores.masked_fill(~selected, float("inf")).amin(-1)
    high = scores.masked_fill(selected | ~allowed, float("-inf")).amax(-1)
    assert (low >= high).all()


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_attention_equals_masked_softmax_attention(causal, per_query):
    n, block = 27, 4
    q, k, v = (_randn(2, 3, n, e, seed=s) for s, e in ((58, 4), (59, 4), (60, 3)))
    out = ea.topk_block_attention(q, k, v, block_size=block, top_k=2, causal=causal,
                                  per_query=per_query)
    selected = ea.topk_block_mask(q, k, block_size=block, top_k=2, causal=causal,
                                  per_query=per_query)
    cols = torch.arange(n) // block
    visible = selected[..., cols] if per_query else _token_mask(selected, n, n, block)
    torch.testing.assert_close(out, _masked_reference(q, k, v, visible, causal), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("per_query", [False, True])
def test_topk_gradcheck(per_query):
    q, k, v = (_randn(1, 8, 2, seed=s, requires_grad=True) for s in (61, 62, 63))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ea.topk_block_attention(q, k, v, block_size=3, top_k=2, causal=True,
                                                per_query=per_query), (q, k, v))


def test_topk_edge_cases_and_bad_inputs():
    q, k, v = (_randn(2, 10, 4, seed=s) for s in (64, 65, 66))
    zero = ea.topk_block_attention(q, k, v, block_size=4, top_k=0)
    assert torch.equal(zero, torch.zeros_like(zero))
    everything = ea.topk_block_attention(q, k, v, block_size=4, top_k=99, per_query=True)
    torch.testing.assert_close(everything, ea.softmax_attention(q, k, v), atol=ATOL, rtol=0)
    empty = ea.topk_block_attention(q[:, :0], k[:, :0], v[:, :0], block_size=4, top_k=2,
                                    causal=True)
    assert empty.shape == (2, 0, 4)
    with pytest.raises(ValueError, match="top_k must be a non-negative int, got -1"):
        ea.topk_block_attention(q, k, v, block_size=4, top_k=-1)
    with pytest.raises(TypeError, match="per_query must be a bool"):
        ea.topk_block_mask(q, k, block_size=4, top_k=1, per_query="yes")
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        ea.topk_block_attention(q, k[:, :9], v[:, :9], block_size=4, top_k=1, causal=True)


# --- hypothesis: shapes and masks --------------------------------------------------------


@st.composite
def block_problems(draw):
    batch = draw(st.lists(st.integers(0, 2), min_size=0, max_size=2))
    n_k = draw(st.integers(0, 13))
    causal = draw(st.booleans())
    n_q = n_k if causal else draw(st.integers(0, 13))
    block = draw(st.integers(1, 6))
    d, d_v = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shapes = [[b if draw(st.booleans()) else 1 for b in batch] for _ in range(4)]
    q = torch.randn(*shapes[0], n_q, d, generator=g, dtype=F64)
    k = torch.randn(*shapes[1], n_k, d, generator=g, dtype=F64)
    v = torch.randn(*shapes[2], n_k, d_v, generator=g, dtype=F64)
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    block_mask = torch.rand(*shapes[3], _blocks(n_q, block), _blocks(n_k, block),
                            generator=g) < density
    padding = None
    if draw(st.booleans()):
        padding = torch.rand(*shapes[1], n_k, generator=g) < 0.3
    return q, k, v, block_mask, block, causal, padding


@SETTINGS
@given(block_problems())
def test_property_block_sparse_equals_reference(problem):
    q, k, v, block_mask, block, causal, padding = problem
    out = ea.block_sparse_attention(q, k, v, block_mask, block_size=block, causal=causal,
                                    key_padding_mask=padding)
    visible = _token_mask(block_mask, q.shape[-2], k.shape[-2], block)
    if padding is not None:
        visible = visible & ~padding.unsqueeze(-2)
    torch.testing.assert_close(out, _masked_reference(q, k, v, visible, causal), atol=ATOL,
                               rtol=0)


@SETTINGS
@given(block_problems(), st.integers(0, 4), st.booleans())
def test_property_topk_equals_reference(problem, top_k, per_query):
    q, k, v, _, block, causal, _ = problem
    out = ea.topk_block_attention(q, k, v, block_size=block, top_k=top_k, causal=causal,
                                  per_query=per_query)
    selected = ea.topk_block_mask(q, k, block_size=block, top_k=top_k, causal=causal,
                                  per_query=per_query)
    cols = torch.arange(k.shape[-2]) // block
    visible = (selected[..., cols] if per_query
               else _token_mask(selected, q.shape[-2], k.shape[-2], block))
    torch.testing.assert_close(out, _masked_reference(q, k, v, visible, causal), atol=ATOL,
                               rtol=0)


@SETTINGS
@given(st.integers(1, 14), st.integers(1, 3), st.sampled_from([2, 4, 6]), st.integers(1, 5),
       st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_property_lsh_equals_reference(n, hashes, buckets, chunk, causal, deduplicate, seed):
    qk, v = _randn(2, n, 3, seed=seed), _randn(1, n, 2, seed=seed + 1)
    kw = dict(num_hashes=hashes, num_buckets=buckets)
    out = ea.lsh_attention(qk, v, chunk_size=chunk, causal=causal, deduplicate=deduplicate,
                           generator=torch.Generator().manual_seed(seed), **kw)
    windows = _lsh_windows(ea.lsh_buckets(qk, generator=torch.Generator().manual_seed(seed),
                                          **kw), chunk)
    expected = _lsh_reference(qk, v.expand(2, n, 2), windows, causal, deduplicate)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


# --- memory: nothing n x n ---------------------------------------------------------------


class _LargestStorage(TorchDispatchMode):
    """Largest new storage (in elements) any operator creates inside the block: outputs
    that share no storage with an input (views and in-place results are free)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    @classmethod
    def _should_skip_dynamo(cls):  # not importing torch._dynamo saves a second or more
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                self.largest = max(self.largest, storage.nbytes() // t.element_size())
        return out


def _largest(fn, grad=False):
    with torch.set_grad_enabled(grad), _LargestStorage() as record:
        fn()
    return record.largest


def test_sparse_functions_never_allocate_n_by_n():
    """At n = 4096 with 1/8 of the blocks selected, no storage reaches n^2 / 4 elements,
    forward or backward (the scores are never stored, the gathered keys hold N B d numbers
    for N selected block pairs, a causal mask N B^2 booleans, and a global row costs its
    own keys, not every row's): a dense implementation allocates n^2, and so does one that
    pads every row to the longest (the Longformer mask has a global row), so the test
    tells them apart."""
    n, d, block = 4096, 16, 64
    q, k, v = (_randn(1, n, d, seed=s, dtype=torch.float32) for s in (67, 68, 69))
    nb = n // block
    block_mask = torch.zeros(nb, nb, dtype=torch.bool)
    noise = torch.rand(nb, nb, generator=torch.Generator().manual_seed(70))
    block_mask.scatter_(-1, noise.topk(nb // 8, -1).indices, True)
    bound = n * n // 4
    sparse = _largest(lambda: ea.block_sparse_attention(q, k, v, block_mask, block_size=block,
                                                        causal=True))
    longformer = ea.longformer_block_mask(n, block_size=block, window=3, num_global=1)
    with_global = _largest(lambda: ea.block_sparse_attention(q, k, v, longformer,
                                                             block_size=block))
    topk = _largest(lambda: ea.topk_block_attention(q, k, v, block_size=block, top_k=nb // 8,
                                                    causal=True, per_query=True))
    lsh = _largest(lambda: ea.lsh_attention(q, v, num_hashes=2, num_buckets=64,
                                            chunk_size=64))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    training = _largest(lambda: ea.block_sparse_attention(
        *leaves, block_mask, block_size=block).sum().backward(), grad=True)
    sizes = dict(sparse=sparse, with_global=with_global, topk=topk, lsh=lsh, training=training)
    assert max(sizes.values()) < bound, sizes
    dense = _largest(lambda: ea.softmax_attention(q, k, v, causal=True))  # an n x n one
    assert dense >= n * n >= 4 * bound


# --- CUDA --------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_cpu(causal):
    """Float64 on both devices, so the top-k choices and the hashes agree exactly."""
    n, block = 300, 32
    q, k, v = (_randn(2, 3, n, 16, seed=s) for s in (71, 72, 73))
    nb = _blocks(n, block)
    block_mask = ea.bigbird_block_mask(n, block_size=block, window=1, num_global=1,
                                       num_random=2, generator=torch.Generator().manual_seed(0))
    padding = _random_block_mask(2, 1, n, density=0.2, seed=74)
    cuda = [x.cuda().requires_grad_() for x in (q, k, v)]
    pairs = [
        (ea.block_sparse_attention(q, k, v, block_mask, block_size=block, causal=causal,
                                   key_padding_mask=padding),
         ea.block_sparse_attention(*cuda, block_mask.cuda(), block_size=block, causal=causal,
                                   key_padding_mask=padding.cuda())),
        (ea.topk_block_attention(q, k, v, block_size=block, top_k=3, causal=causal,
                                 per_query=True),
         ea.topk_block_attention(*cuda, block_size=block, top_k=3, causal=causal,
                                 per_query=True)),
        (ea.lsh_attention(q, v, num_hashes=2, num_buckets=8, chunk_size=16, causal=causal,
                          generator=torch.Generator().manual_seed(1)),
         ea.lsh_attention(cuda[0], cuda[2], num_hashes=2, num_buckets=8, chunk_size=16,
                          causal=causal, generator=torch.Generator().manual_seed(1))),
    ]
    assert nb == block_mask.shape[0]
    for expected, out in pairs:
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-9, atol=1e-9)
        out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in cuda)


# --- exports -----------------------------------------------------------------------------


def test_exported_from_the_package():
    import efficient_attention.sparse as sparse

    names = {"block_sparse_attention", "block_mask_to_token_mask", "longformer_block_mask",
             "bigbird_block_mask", "lsh_attention", "lsh_buckets", "topk_block_attention",
             "topk_block_mask"}
    assert names <= set(ea.__all__) and set(sparse.__all__) == names
    assert ea.sparse is sparse and ea.block_sparse_attention is sparse.block_sparse_attention
