"""Submissions of ring_attention that are numerically right but break the statement.

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
"""

CASES = [
    {
        # Part 3 gathered: the blocks go round the ring (the right messages and bytes), every
        # rank keeps each block it receives, and attends once to the whole sequence at the end.
        # Exact, but a rank holds every block (ring.held) and attends to n keys at once
        # (ring.widest): the memory checks fail, the output test passes.
        "name": "gather-then-attend-part3",
        "cell": "part3-ring-solution",
        "source": '''def ring_attention(q_shards, k_shards, v_shards, ring):
    """Every block passed round the ring and kept; each rank attends once to all of them."""
    p = ring.size
    kept = [[(k_shards[rank], v_shards[rank])] for rank in range(p)]
    blocks = [(k_shards[rank], v_shards[rank]) for rank in range(p)]
    for _ in range(p - 1):
        for rank in range(p):
            ring.send(rank, blocks[rank])
        blocks = [ring.recv(rank) for rank in range(p)]
        for rank in range(p):
            kept[rank].append(blocks[rank])
    outs = []
    for rank in range(p):
        k_all = torch.cat([k for k, _ in kept[rank]], dim=-2)     # the whole sequence
        v_all = torch.cat([v for _, v in kept[rank]], dim=-2)
        out, _ = ring.attend(rank, q_shards[rank], k_all, v_all)
        outs.append(out)
    return outs''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Part 3 deferred: every block kept and attended one at a time at the end, merged.
        # Blocks of m keys, the right pairs and messages; only "one received block at a
        # time" (ring.held) catches it.
        "name": "keep-every-block-part3",
        "cell": "part3-ring-solution",
        "source": '''def ring_attention(q_shards, k_shards, v_shards, ring):
    """The blocks passed round the ring and kept; each rank attends to them at the end."""
    p = ring.size
    kept = [[(k_shards[rank], v_shards[rank])] for rank in range(p)]
    blocks = [(k_shards[rank], v_shards[rank]) for rank in range(p)]
    for _ in range(p - 1):
        for rank in range(p):
            ring.send(rank, blocks[rank])
        blocks = [ring.recv(rank) for rank in range(p)]
        for rank in range(p):
            kept[rank].append(blocks[rank])
    outs = []
    for rank in range(p):
        out, lse = ring.attend(rank, q_shards[rank], *kept[rank][0])
        for k, v in kept[rank][1:]:
            out, lse = merge_partials(out, lse, *ring.attend(rank, q_shards[rank], k, v))
        outs.append(out)
    return outs''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Part 3 with a message too many per rank: the block is passed on at the last step
        # too, and received by nobody (p^2 messages).
        "name": "send-at-last-step-part3",
        "cell": "part3-ring-solution",
        "source": '''def ring_attention(q_shards, k_shards, v_shards, ring):
    """The ring of Part 3, but every step passes the block on, the last one too."""
    p = ring.size
    outs = [q_shards[rank].new_zeros(*q_shards[rank].shape[:-1], v_shards[rank].shape[-1])
            for rank in range(p)]
    lses = [torch.full(q.shape[:-1], -math.inf, dtype=q.dtype) for q in q_shards]
    blocks = [(k_shards[rank], v_shards[rank]) for rank in range(p)]
    for step in range(p):
        for rank in range(p):
            outs[rank], lses[rank] = ring_step(ring, rank, q_shards[rank], blocks[rank],
                                               outs[rank], lses[rank])
        if step < p - 1:
            blocks = [ring.recv(rank) for rank in range(p)]
    return outs''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Part 3 by PyTorch's fused attention on the whole sequence, which the assignment
        # forbids: the integrity check rejects the cell, so both tests of Part 3 fail.
        "name": "sdpa-whole-sequence-part3",
        "cell": "part3-ring-solution",
        "source": '''def ring_attention(q_shards, k_shards, v_shards, ring):
    """The whole sequence gathered and handed to scaled_dot_product_attention."""
    q, k, v = (torch.cat(list(x), dim=-2) for x in (q_shards, k_shards, v_shards))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return list(out.split(q_shards[0].shape[-2], dim=-2))''',
        "must_fail": {"part3-ring-test", "part3-cost-test"},
    },
    {
        # Part 1 without the shift by the maximum: e^lse overflows for log-sum-exps of 1e4
        # (inf / inf = NaN). Fine for the moderate scores of Parts 2 to 4, which keep their
        # points.
        "name": "unstable-merge-part1",
        "cell": "part1-merge-solution",
        "source": '''def merge_partials(out_a, lse_a, out_b, lse_b):
    """The merge computed with e^lse directly."""
    weight_a = torch.exp(lse_a)
    weight_b = torch.exp(lse_b)
    total = weight_a + weight_b
    out = (weight_a.unsqueeze(-1) * out_a + weight_b.unsqueeze(-1) * out_b) / total.unsqueeze(-1)
    return out, torch.log(total)''',
        "must_fail": {"part1-merge-test"},
    },
    {
        # Part 4 in the contiguous layout: rank r holds tokens r m, ..., (r + 1) m - 1, skips
        # the blocks of later ranks, attends fully to those of earlier ones. Exact (its own
        # shard and unshard are consistent), but rank r computes (r + 1) m^2 pairs: the
        # balance test fails, the output test passes.
        "name": "contiguous-layout-part4",
        "cell": "part4-causal-solution",
        "source": '''def zigzag_shard(x, p):
    """Contiguous shards (not the zigzag layout)."""
    return list(x.chunk(p, dim=-2))


def zigzag_unshard(shards):
    return torch.cat(list(shards), dim=-2)


def causal_ring_attention(q_shards, k_shards, v_shards, ring):
    """Causal ring attention for contiguous shards: future blocks skipped, past ones full."""
    p = ring.size
    outs, lses = [], []
    for rank in range(p):
        out, lse = ring.attend(rank, q_shards[rank], k_shards[rank], v_shards[rank],
                               causal=True)
        outs.append(out)
        lses.append(lse)
        if p > 1:
            ring.send(rank, (k_shards[rank], v_shards[rank]))
    for step in range(1, p):
        blocks = [ring.recv(rank) for rank in range(p)]
        for rank in range(p):
            if (rank - step) % p < rank:                # a block from the past: every pair
                k, v = blocks[rank]
                out, lse = ring.attend(rank, q_shards[rank], k, v)
                outs[rank], lses[rank] = merge_partials(outs[rank], lses[rank], out, lse)
            if step < p - 1:
                ring.send(rank, blocks[rank])
    return outs''',
        "must_fail": {"part4-balance-test"},
    },
]
