"""Submissions of online_softmax that are numerically right but break the statement.

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
"""

CASES = [
    {
        # Part 4 asks for tiles: right values from the whole n_q x n_k matrix of scores.
        "name": "quadratic-part4",
        "cell": "part4-tiled-solution",
        "source": '''def tiled_attention(q, k, v, block_q=64, block_k=64):
    """Exact attention and row log-sum-exps, from the full matrix of scores."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])        # (..., n_q, n_k)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / total, (row_max + torch.log(total)).squeeze(-1)''',
        "must_fail": {"part4-memory-test"},
    },
    {
        # Tiles of queries only, each against every key: a block_q x n_k row of scores.
        "name": "query-tiles-only-part4",
        "cell": "part4-tiled-solution",
        "source": '''def tiled_attention(q, k, v, block_q=64, block_k=64):
    """Exact attention and row log-sum-exps, block_q queries at a time, all keys at once."""
    outs, lses = [], []
    for i in range(0, q.shape[-2], block_q):
        scores = q[..., i : i + block_q, :] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        row_max = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        outs.append((weights @ v) / total)
        lses.append((row_max + torch.log(total)).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)''',
        "must_fail": {"part4-memory-test"},
    },
    {
        # Tiles, with no running state: at every key tile, the partial result over all the key
        # tiles up to it recomputed from scratch by a Python loop over those key blocks. Tiles
        # of memory only (the memory bound passes), but the work of ceil(n_k / block_k) / 2
        # passes over the tiles.
        "name": "rescan-key-blocks-part4",
        "cell": "part4-tiled-solution",
        "source": '''def tiled_attention(q, k, v, block_q=64, block_k=64):
    """Tiles of queries; for each key tile, the partial result over all key tiles up to it,
    recomputed from scratch by a Python loop over those key blocks (no running state kept)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(q.shape[:-1])
    for i in range(0, n_q, block_q):
        q_tile = q[..., i : i + block_q, :] * scale
        for end in range(block_k, n_k + block_k, block_k):   # keys [0, end), from scratch
            running_max = torch.full(q_tile.shape[:-1], -math.inf, dtype=q.dtype)
            running_sum = torch.zeros_like(running_max)
            acc = q.new_zeros(*q_tile.shape[:-1], v.shape[-1])
            for j in range(0, min(end, n_k), block_k):
                scores = q_tile @ k[..., j : j + block_k, :].transpose(-2, -1)
                new_max = torch.maximum(running_max, scores.amax(dim=-1))
                weights = torch.exp(scores - new_max.unsqueeze(-1))
                rescale = torch.exp(running_max - new_max)
                running_sum = rescale * running_sum + weights.sum(dim=-1)
                acc = rescale.unsqueeze(-1) * acc + weights @ v[..., j : j + block_k, :]
                running_max = new_max
        out[..., i : i + block_q, :] = acc / running_sum.unsqueeze(-1)
        lse[..., i : i + block_q] = running_max + torch.log(running_sum)
    return out, lse''',
        "must_fail": {"part4-memory-test"},
    },
    {
        # Part 1 with the library's softmax and log-sum-exp, which the assignment forbids.
        "name": "library-softmax-part1",
        "cell": "part1-block-solution",
        "source": '''def block_attention(q, k, v):
    """(softmax(q k^T / sqrt(d)) v, logsumexp of the scores), by the library."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)''',
        "must_fail": {"part1-block-test"},
    },
    {
        # Part 2 with torch.logaddexp, which the assignment forbids.
        "name": "library-logaddexp-part2",
        "cell": "part2-merge-solution",
        "source": '''def merge_partials(out_a, lse_a, out_b, lse_b):
    """The partial result over A u B, with torch.logaddexp."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe).unsqueeze(-1)
    weight_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse''',
        "must_fail": {"part2-merge-test"},
    },
    {
        # Part 4 tiled, but each tile's partial result by the library's softmax.
        "name": "library-softmax-part4",
        "cell": "part4-tiled-solution",
        "source": '''def tiled_attention(q, k, v, block_q=64, block_k=64):
    """Tiles merged by merge_partials, each tile by torch.softmax / torch.logsumexp."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for i in range(0, q.shape[-2], block_q):
        q_tile = q[..., i : i + block_q, :] * scale
        out = q.new_zeros(*q_tile.shape[:-1], v.shape[-1])
        lse = torch.full(q_tile.shape[:-1], -math.inf, dtype=q.dtype)
        for j in range(0, k.shape[-2], block_k):
            scores = q_tile @ k[..., j : j + block_k, :].transpose(-2, -1)
            tile_out = torch.softmax(scores, dim=-1) @ v[..., j : j + block_k, :]
            out, lse = merge_partials(out, lse, tile_out, torch.logsumexp(scores, dim=-1))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)''',
        "must_fail": {"part4-tiled-test", "part4-memory-test"},
    },
]
