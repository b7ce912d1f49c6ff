"""Submissions of chunkwise_linear_attention that break the statement or get a detail wrong.

Each case replaces the source of one answer cell (``cell``, a grade_id) of the source
notebook; the test cells in ``must_fail`` must score 0 and every other test cell full points.
(tests/cheats/common.py puts cases on different cells into one student; the cases below are
ordered so that the one calling the student's recurrence meets an honest Part 1.)
"""

CASES = [
    {
        # Part 3 asks for chunks: right values from the parallel form over the whole sequence
        # (the n x n matrix). The largest tensor and the work give it away.
        "name": "quadratic-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """((Q K^T) o L) V over the whole sequence: an n x n matrix."""
    n = log_decay.shape[-1]
    prefix = torch.cumsum(log_decay, dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = torch.exp((prefix.unsqueeze(-1) - prefix.unsqueeze(-2)).masked_fill(~causal, -math.inf))
    return ((q @ k.transpose(-2, -1)) * mask) @ v''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Chunks of queries, each against every earlier key: tensors of C x n numbers (within
        # the memory bound) but Theta(n^2) work, which the work count catches.
        "name": "blocked-quadratic-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """A chunk of queries at a time, each against all keys up to the end of the chunk."""
    prefix = torch.cumsum(log_decay, dim=-1)                          # (..., n)
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        stop = min(start + chunk_size, q.shape[-2])
        rows = torch.arange(start, stop, device=q.device)[:, None]
        cols = torch.arange(stop, device=q.device)[None, :]
        exponent = prefix[..., start:stop, None] - prefix[..., None, :stop]   # (..., C, stop)
        weights = torch.exp(exponent.masked_fill(cols > rows, -math.inf))
        scores = q[..., start:stop, :] @ k[..., :stop, :].transpose(-2, -1)
        outputs.append((scores * weights) @ v[..., :stop, :])
    return torch.cat(outputs, dim=-2)''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # A few queries at a time against every earlier key without any matrix product:
        # broadcasting and .sum(-1) for q_i . k_j and for the sum over the values. Tensors of
        # (C / 4) x n x d numbers (within the memory bound) and few operators per token, but
        # Theta(n^2) work: a count of matrix-product FLOPs alone saw nothing.
        "name": "broadcast-sum-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """A few queries at a time against every earlier key, by broadcasting and sums (no @)."""
    n, rows = q.shape[-2], max(1, chunk_size // 4)
    prefix = torch.cumsum(log_decay, dim=-1)                          # c_i: (..., n)
    position = torch.arange(n, device=q.device)
    outputs = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        later = position[:stop] > position[start:stop, None]          # j > i: (rows, stop)
        scores = (q[..., start:stop, None, :] * k[..., None, :stop, :]).sum(-1)
        exponent = prefix[..., start:stop, None] - prefix[..., None, :stop]
        weights = torch.exp(exponent.masked_fill(later, -math.inf)) * scores
        outputs.append((weights.unsqueeze(-1) * v[..., None, :stop, :]).sum(-2))
    return torch.cat(outputs, dim=-2)''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Each chunk of queries against every earlier key, the causal mask made by a cumsum
        # over a C x n block of ones and the products one feature at a time (no matrix
        # product): C x n tensors, Theta(n^2) work.
        "name": "cumsum-mask-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """Each chunk of queries against every earlier key: the causal mask from a cumsum over a
    block of ones, the products one feature at a time (no @)."""
    n = q.shape[-2]
    prefix = torch.cumsum(log_decay, dim=-1)
    outputs = []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        rows = torch.arange(start + 1, stop + 1, dtype=q.dtype, device=q.device)[:, None]
        ones = torch.ones(stop - start, stop, dtype=q.dtype, device=q.device)
        causal = torch.cumsum(ones, dim=-1) <= rows                    # j + 1 <= i + 1
        exponent = prefix[..., start:stop, None] - prefix[..., None, :stop]
        weights = torch.exp(exponent.masked_fill(~causal, -math.inf))
        scores = 0
        for q_f, k_f in zip(q[..., start:stop, :].unbind(-1), k[..., :stop, :].unbind(-1)):
            scores = scores + q_f[..., :, None] * k_f[..., None, :]
        weights = weights * scores
        outputs.append(torch.stack([(weights * v_e[..., None, :])
                                    .sum(-1) for v_e in v[..., :stop, :].unbind(-1)], dim=-1))
    return torch.cat(outputs, dim=-2)''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # The student's own recurrence of Part 1 in place of the chunkwise form: right values,
        # linear memory and no matrix-product work to speak of, but a loop over the tokens;
        # the count of PyTorch operations catches it.
        "name": "recurrence-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """The recurrence of Part 1, whatever the chunk size."""
    return decay_recurrence(q, k, v, log_decay)''',
        "must_fail": {"part3-cost-test"},
    },
    {
        # Off by one in the state update: key j carried to the end of its chunk with its own
        # decay a_j as well (exp(b_end - b_{j-1}) instead of exp(b_end - b_j)). Part 4 calls
        # this function, so it is wrong too.
        "name": "off-by-one-part3",
        "cell": "part3-chunkwise-solution",
        "source": '''def chunkwise_decay_attention(q, k, v, log_decay, chunk_size=64):
    """Chunkwise, with the keys decayed by a_j too when the state moves to the chunk's end."""
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        chunk = slice(start, start + chunk_size)
        q_c, k_c, v_c = q[..., chunk, :], k[..., chunk, :], v[..., chunk, :]
        local = torch.cumsum(log_decay[..., chunk], dim=-1)
        size = local.shape[-1]
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        segment = (local.unsqueeze(-1) - local.unsqueeze(-2)).masked_fill(~causal, -math.inf)
        intra = ((q_c @ k_c.transpose(-2, -1)) * torch.exp(segment)) @ v_c
        inter = (q_c * torch.exp(local).unsqueeze(-1)) @ state
        outputs.append(intra + inter)
        to_end = torch.exp(local[..., -1:] - local + log_decay[..., chunk]).unsqueeze(-1)
        state = (torch.exp(local[..., -1:]).unsqueeze(-1) * state
                 + (k_c * to_end).transpose(-2, -1) @ v_c)
    return torch.cat(outputs, dim=-2)''',
        "must_fail": {"part3-chunkwise-test", "part3-cost-test", "part4-state-test"},
    },
    {
        # The naive parallel form: L_ij = e^{c_i} / e^{c_j} from the prefix sums. Right for
        # mild decays; for log decays near -50, e^{c_i} underflows to 0 and 0 / 0 is NaN.
        "name": "naive-exp-part2",
        "cell": "part2-parallel-solution",
        "source": '''def decay_mask(log_decay):
    """L_ij = exp(c_i) / exp(c_j) below the diagonal."""
    prefix = torch.exp(torch.cumsum(log_decay, dim=-1))
    return (prefix.unsqueeze(-1) / prefix.unsqueeze(-2)).tril()


def parallel_decay_attention(q, k, v, log_decay):
    """((Q K^T) o L) V."""
    return ((q @ k.transpose(-2, -1)) * decay_mask(log_decay)) @ v''',
        "must_fail": {"part2-parallel-test"},
    },
    {
        # exp of every c_i - c_j, then the mask: the values are right (torch.where picks 0
        # where exp overflowed), but the gradient is 0 * inf = NaN for strong decays.
        "name": "exp-then-mask-part2",
        "cell": "part2-parallel-solution",
        "source": '''def decay_mask(log_decay):
    """exp(c_i - c_j) for every pair, then 0 above the diagonal."""
    n = log_decay.shape[-1]
    prefix = torch.cumsum(log_decay, dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=log_decay.device).tril()
    weights = torch.exp(prefix.unsqueeze(-1) - prefix.unsqueeze(-2))
    return torch.where(causal, weights, torch.zeros_like(weights))


def parallel_decay_attention(q, k, v, log_decay):
    """((Q K^T) o L) V."""
    return ((q @ k.transpose(-2, -1)) * decay_mask(log_decay)) @ v''',
        "must_fail": {"part2-parallel-test"},
    },
    {
        # The exponents as differences c_i - c_j of prefix sums over the whole sequence (the
        # model solution before issue 27): right in float64, but in float32 with strong decays
        # c_i reaches -6e4, where floats are 0.004 apart, and L_ij is off by up to 0.4%. The
        # hidden float32 test (bound: float32 rounding of a directly summed exponent) fails it.
        "name": "prefix-difference-part2",
        "cell": "part2-parallel-solution",
        "source": '''def decay_mask(log_decay):
    """exp(c_i - c_j), masked to -inf above the diagonal before exp."""
    n = log_decay.shape[-1]
    prefix = torch.cumsum(log_decay, dim=-1)
    segment = prefix.unsqueeze(-1) - prefix.unsqueeze(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=log_decay.device).tril()
    return torch.exp(segment.masked_fill(~causal, -math.inf))


def parallel_decay_attention(q, k, v, log_decay):
    """((Q K^T) o L) V."""
    return ((q @ k.transpose(-2, -1)) * decay_mask(log_decay)) @ v''',
        "must_fail": {"part2-parallel-test"},
    },
    {
        # Off by one: L_ij = exp(sum_{j <= s <= i} log a_s), the decay of token j included.
        "name": "off-by-one-part2",
        "cell": "part2-parallel-solution",
        "source": '''def decay_mask(log_decay):
    """exp of the log decays summed over j <= s <= i (one too many)."""
    n = log_decay.shape[-1]
    prefix = torch.cumsum(log_decay, dim=-1)
    before = prefix - log_decay                                       # c_{j-1}
    causal = torch.ones(n, n, dtype=torch.bool, device=log_decay.device).tril()
    segment = prefix.unsqueeze(-1) - before.unsqueeze(-2)
    return torch.exp(segment.masked_fill(~causal, -math.inf))


def parallel_decay_attention(q, k, v, log_decay):
    """((Q K^T) o L) V."""
    return ((q @ k.transpose(-2, -1)) * decay_mask(log_decay)) @ v''',
        "must_fail": {"part2-parallel-test"},
    },
    {
        # Off by one in the recurrence: S_t = a_t (S_{t-1} + k_t v_t^T), the same mistake.
        "name": "off-by-one-part1",
        "cell": "part1-recurrence-solution",
        "source": '''def decay_recurrence(q, k, v, log_decay):
    """S_t = a_t (S_{t-1} + k_t v_t^T): the new key decays at once."""
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    decay = torch.exp(log_decay)
    outputs = []
    for t in range(q.shape[-2]):
        outer = k[..., t, :].unsqueeze(-1) * v[..., t, :].unsqueeze(-2)
        state = decay[..., t, None, None] * (state + outer)
        outputs.append((q[..., t, :].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outputs, dim=-2)''',
        "must_fail": {"part1-recurrence-test"},
    },
    {
        # Answers the visible tests only: the two limits in closed form, and the hand example
        # hard-coded. It passes every visible assert; the hidden inputs catch it.
        "name": "hardcoded-part1",
        "cell": "part1-recurrence-solution",
        "source": '''def decay_recurrence(q, k, v, log_decay):
    """The visible examples, without the recurrence."""
    if bool((log_decay == 0).all()):                  # no decay: causal prefix sums
        states = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)
        return (q.unsqueeze(-2) @ states).squeeze(-2)
    if bool((log_decay < -500).all()):                # everything forgotten at once
        return (q * k).sum(-1, keepdim=True) * v
    return torch.tensor([[1.0], [2.5], [5.25]], dtype=q.dtype)''',
        "must_fail": {"part1-recurrence-test"},
    },
    {
        # Part 4 with the initial state decayed by a_1 ... a_{t-1} only (e^{c_{t-1}}): the
        # query at t reads S_0 before a_t is applied (the rest as the model solution).
        "name": "state-decay-off-by-one-part4",
        "cell": "part4-state-solution",
        "source": '''def decay_attention_with_state(q, k, v, log_decay, initial_state=None,
                               chunk_size=64):
    """(outputs, S_n) from S_0, with S_0 decayed one token too little in the outputs."""
    if initial_state is None:
        initial_state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    out = chunkwise_decay_attention(q, k, v, log_decay, chunk_size)
    prefix = torch.cumsum(log_decay, dim=-1)
    out = out + (q * torch.exp(prefix - log_decay).unsqueeze(-1)) @ initial_state
    suffix = torch.cumsum(log_decay.flip(-1), dim=-1).flip(-1)
    after = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)
    to_end = torch.exp(after).unsqueeze(-1)
    final_state = (torch.exp(prefix[..., -1:]).unsqueeze(-1) * initial_state
                   + (k * to_end).transpose(-2, -1) @ v)
    return out, final_state''',
        "must_fail": {"part4-state-test"},
    },
]
