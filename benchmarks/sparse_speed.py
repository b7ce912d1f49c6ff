"""Block-sparse and top-k block attention against fused SDPA and FlexAttention: time and peak
extra memory against n, for several block masks and densities; LSH attention against
reformer-pytorch's.

Run from the repository root::

    .venv/bin/python benchmarks/sparse_speed.py          # full run (n up to 32768: long)
    .venv/bin/python benchmarks/sparse_speed.py --quick  # smoke test, small n, ~30 s

Setting: ``q, k, v`` of shape ``(1, 8, n, 64)`` float32, CPU, 2 threads, blocks of
``B = 128`` tokens (32 in the quick run). Block masks (``nb = n / B`` blocks a side), at
densities 1/4, 1/8 and 1/16 of the ``nb x nb`` blocks:

- ``window d``: ``ea.longformer_block_mask(n, block_size=B, window=w)``, the sliding window
  of ``2 w + 1`` blocks, with the ``w`` whose density (edges included) is nearest ``d``;
- ``random d``: ``ea.bigbird_block_mask(..., window=0, num_global=0, num_random=k - 1)``:
  the query block's own block and ``k - 1`` random ones, ``k = nb d`` blocks per row.

Methods (the density or mask in brackets):

- ``SDPA``: ``F.scaled_dot_product_attention(q, k, v)`` on the 4-D tensors (the fused CPU
  kernel; the script stops if the profiler shows the unfused one);
- ``SDPA + token mask (mask)``: the same with the equivalent ``(n, n)`` bool mask
  (``ea.block_mask_to_token_mask``), which the fused kernel applies without skipping any
  block: every mask costs the same, so it is timed for every mask only up to
  ``MASKED_ALL_MAX_N`` and for ``window 1/8`` up to ``MASKED_MAX_N``; the dense training
  step (``SDPA``, ``train``) only up to ``DENSE_TRAIN_MAX_N``;
- ``block-sparse (mask)``: ``ea.block_sparse_attention(q, k, v, mask, block_size=B)``;
- ``FlexAttention (mask)``: ``torch.compile(flex_attention, dynamic=False)`` with a
  ``BlockMask`` of the same blocks (``BlockMask.from_kv_blocks``, every selected block a
  full block; checked equal to ``create_block_mask``'s at the smallest n, and its output
  to block-sparse's), forward only: FlexAttention has no backward on CPU (the message is
  recorded); ``FlexAttention eager (window 1/8)``: the uncompiled call (it materialises the
  scores), up to ``FLEX_EAGER_MAX_N``;
- ``top-k (d)``: ``ea.topk_block_attention(q, k, v, block_size=B, top_k=nb d)`` (each query
  block keeps the ``nb d`` key blocks of highest mean-query x mean-key score);
- ``LSH (ours)``, ``LSH (ours, duplicates counted)``: ``ea.lsh_attention(q, v, ...)`` with
  4 hash rounds, chunks of 64, ``n / 64`` buckets (``deduplicate`` True, False), and
  ``LSH (reformer-pytorch)``: ``reformer_pytorch.LSHAttention(bucket_size=64, n_hashes=4)``
  on the same ``q`` (shared query-key) and ``v``, when it can be imported (see README);
  up to ``LSH_MAX_N``.

Two workloads: ``forward`` (one call under ``torch.inference_mode``) and ``train`` (forward
and backward of a fixed random output gradient, ``q, k, v`` requiring gradients). Time:
``_timing.time_in_turns``, every method of one n and workload taking turns call by call
after a warm-up; ratios are ``_timing.paired_ratio`` (median over rounds of the ratio of the
two calls of one round). In the forward workload up to ``PAIRED_MAX_N`` every call is timed
in every round (no fewer rounds for slow calls), so that the ratios there are paired.
Memory: for each n a fresh subprocess warms every method up on a small input, then for each
(workload, method) returns freed memory to the OS, resets the peak-RSS mark, runs it once
and reads ``VmHWM`` (the probe of ``attention_speed.py``): peak extra resident memory.

Writes ``sparse_speed.json``, ``.md`` and ``.png`` (``benchmarks/results/`` or ``--out``).
JSON keys (``<n>`` a length as a string, ``<workload>`` ``forward`` or ``train``)::

    benchmark, preliminary, quick, conditions   as in the other scripts
    setting      shape, dtype, threads, sizes, block_size, repeats, densities, patterns,
                 limits (masked_all_max_n, masked_max_n, flex_eager_max_n, lsh_max_n,
                 paired_max_n, dense_train_max_n), lsh settings, flex_compiled
    sdpa_ops     {"dense": [...], "token mask": [...]}: ATen ops SDPA reached (profiler)
    masks        {<n>: {<mask>: {"pattern", "target_density", "density", "blocks",
                 "window" or "blocks_per_row"}}}
    flex         {"eager_forward", "compiled_forward", "backward": what happened (live),
                  "block_mask_equal_to_create_block_mask": {<mask>: bool} (smallest n),
                  "max_abs_diff_vs_block_sparse": {<mask>: float} (smallest n)}
    peers        {"reformer-pytorch LSH": "timed" | "skipped: <why>"}
    time         {<n>: {<workload>: {<method>: {"median_ms", "times_ms"} | {"skipped"}}}}
    ratios       {<n>: {<workload>: {<label>: float}}}
    memory_mib   {<n>: {<workload>: {<method>: float}}}  (missing if the probe failed:
                 memory_errors)
    nxn_mib      {<n>: float}  one n x n float32 matrix per head (8 heads), for scale
    targets      {"block-sparse (<pattern> 1/8) / SDPA, <workload>, n=16384": {"measured",
                  "limit": 0.3, "met", "flex_attention": FlexAttention's ratio or None}}
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Timing, paired_ratio, prefer_passive_wait_policy, time_in_turns  # noqa: E402

prefer_passive_wait_policy()  # before torch starts OpenMP (see _timing.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _results import (  # noqa: E402
    add_output_arguments,
    output_folder,
    pyplot,
    run_conditions,
    write_results,
)
from attention_speed import peak_extra_rss, run_once  # noqa: E402

import efficient_attention as ea  # noqa: E402

THREADS = 2
HEADS = 8
HEAD_DIM = 64
WORKLOADS = ("forward", "train")
DENSITIES = {"1/4": 4, "1/8": 8, "1/16": 16}  # label: 1 / density
PATTERNS = ("window", "random")
FULL = {"sizes": [4096, 8192, 16384, 32768], "block_size": 128, "repeats": 3}
QUICK = {"sizes": [128, 256], "block_size": 32, "repeats": 2}
MASKED_ALL_MAX_N = 4096  # SDPA + token mask for every mask up to here (it costs the same)
MASKED_MAX_N = 16384  # ... and for window 1/8 only up to here (a 1 GiB bool mask at 32768)
MASKED_WIDE = "window 1/8"
FLEX_EAGER_MAX_N = 4096  # eager FlexAttention materialises the n x n scores of every head
FLEX_EAGER_MASK = "window 1/8"
LSH_MAX_N = 8192  # slower than SDPA below it (a training step of 30 s per call here)
LSH = {"num_hashes": 4, "chunk_size": 64}
PAIRED_MAX_N = 16384  # forward: every call in every round up to here (paired ratios)
DENSE_TRAIN_MAX_N = 16384  # a dense training step at 32768: 8 minutes a call on this machine
TARGET_N = 16384
TARGET_DENSITY = "1/8"
TARGET_LIMIT = 0.3
REFORMER = "LSH (reformer-pytorch)"
LSH_OURS = "LSH (ours)"
LSH_OURS_DUP = "LSH (ours, duplicates counted)"


# --- masks ----------------------------------------------------------------------------------

def window_density(nb: int, w: int) -> float:
    """Fraction of the ``nb x nb`` blocks a sliding window of ``w`` blocks each side selects."""
    return sum(min(nb - 1, i + w) - max(0, i - w) + 1 for i in range(nb)) / nb**2


def nearest_window(nb: int, target: float) -> int:
    """The window ``w`` whose density is nearest ``target`` (the smaller one on a tie)."""
    return min(range(nb), key=lambda w: (abs(window_density(nb, w) - target), w))


def make_masks(n: int, block_size: int) -> tuple[dict, dict]:
    """``({mask: bool (nb, nb)}, {mask: description})`` for every pattern and density."""
    nb = -(-n // block_size)
    masks, info = {}, {}
    for pattern in PATTERNS:
        for label, inverse in DENSITIES.items():
            name = f"{pattern} {label}"
            entry = {"pattern": pattern, "target_density": 1 / inverse}
            if pattern == "window":
                w = nearest_window(nb, 1 / inverse)
                mask = ea.longformer_block_mask(n, block_size=block_size, window=w)
                entry["window"] = w
            else:
                k = max(1, round(nb / inverse))
                g = torch.Generator().manual_seed(1000 * n + k)
                mask = ea.bigbird_block_mask(n, block_size=block_size, window=0, num_global=0,
                                             num_random=k - 1, generator=g)
                entry["blocks_per_row"] = k
            entry["blocks"] = int(mask.sum())
            entry["density"] = entry["blocks"] / nb**2
            masks[name], info[name] = mask, entry
    return masks, info


def top_k_blocks(n: int, block_size: int, label: str) -> int:
    return max(1, round(-(-n // block_size) / DENSITIES[label]))


# --- FlexAttention ---------------------------------------------------------------------------

def token_mask_mod(mask: torch.Tensor, block_size: int):
    """The mask function of a block mask: query ``i`` sees key ``j`` iff
    ``mask[i // B, j // B]``."""
    def mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx // block_size, kv_idx // block_size]

    return mask_mod


def flex_block_mask(mask: torch.Tensor, n: int, block_size: int, with_mask_mod: bool = False):
    """A FlexAttention ``BlockMask`` of the blocks of ``mask (nb, nb)``, every one a *full*
    block, as ``create_block_mask`` finds them for a block-aligned mask: the compiled kernel
    visits exactly these blocks and never calls the mask function, so the default (no-op) one
    serves every mask and one compiled kernel serves every mask of one n. The eager
    implementation ignores the blocks and applies the mask function to all n x n scores:
    ``with_mask_mod`` attaches the mask's own (``token_mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask

    counts = mask.sum(-1).to(torch.int32)[None, None]  # (1, 1, nb)
    order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    order = order[None, None]  # selected blocks first, increasing
    return BlockMask.from_kv_blocks(
        torch.zeros_like(counts), torch.zeros_like(order), counts, order, BLOCK_SIZE=block_size,
        mask_mod=token_mask_mod(mask, block_size) if with_mask_mod else None,
        seq_lengths=(n, n))


def same_as_create_block_mask(mask: torch.Tensor, n: int, block_size: int) -> bool:
    """Whether ``flex_block_mask`` equals what ``create_block_mask`` builds from the token
    mask ``M[q // B, k // B]`` (no partial block, the same full blocks in the same order)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ours = flex_block_mask(mask, n, block_size)
    theirs = create_block_mask(token_mask_mod(mask, block_size), None, None, n, n, device="cpu",
                               BLOCK_SIZE=block_size)
    if int(theirs.kv_num_blocks.sum()) != 0 or theirs.full_kv_num_blocks is None:
        return False
    counts = ours.full_kv_num_blocks
    if not torch.equal(counts, theirs.full_kv_num_blocks):
        return False
    slots = torch.arange(ours.full_kv_indices.shape[-1]) < counts.unsqueeze(-1)
    return torch.equal(ours.full_kv_indices[slots], theirs.full_kv_indices[slots].to(torch.int32))


@functools.cache
def compiled_flex():
    """``torch.compile(flex_attention)``, static shapes: one kernel per n (as a user with a
    fixed context length compiles it)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def eager_flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": recorded once
        return flex_attention(q, k, v, block_mask=block_mask)


def flex_support(block_size: int) -> dict:
    """What FlexAttention does on this CPU, tried live on a small input: eager forward
    (and its warning), backward (raises in this torch), compiled forward (filled in later)."""
    from torch.nn.attention.flex_attention import flex_attention

    n = 4 * block_size
    mask = ea.longformer_block_mask(n, block_size=block_size, window=1)
    block_mask = flex_block_mask(mask, n, block_size, with_mask_mod=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, HEAD_DIM, generator=g) for _ in range(3))
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = flex_attention(q, k, v, block_mask=block_mask)
            error = (got - ea.block_sparse_attention(q, k, v, mask, block_size=block_size))
            out["eager_forward"] = f"runs (max abs diff to block-sparse {error.abs().max():.1e})"
        except Exception as exc:  # noqa: BLE001  (recorded, not raised)
            out["eager_forward"] = f"fails: {type(exc).__name__}: {exc}"
    messages = [str(w.message).strip().splitlines()[0] for w in caught]
    out["eager_warning"] = messages[0] if messages else None
    try:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flex_attention(*leaves, block_mask=block_mask).sum().backward()
        out["backward"] = "runs"
    except Exception as exc:  # noqa: BLE001
        out["backward"] = f"fails: {type(exc).__name__}: {exc}"
    out["compiled_forward"] = "not tried"
    return out


# --- reformer-pytorch -------------------------------------------------------------------------

def reformer_lsh():
    """``(module, note)``: reformer-pytorch's ``LSHAttention`` (eval mode, 4 rounds, buckets of
    64), or ``(None, why)`` when it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from reformer_pytorch import LSHAttention
    except ImportError as exc:
        return None, (f"skipped: reformer_pytorch is not importable ({exc}); install it into a "
                      "scratch folder on PYTHONPATH (benchmarks/README.md)")
    module = LSHAttention(bucket_size=LSH["chunk_size"], n_hashes=LSH["num_hashes"],
                          causal=False).eval()
    return module, "timed"


# --- methods ----------------------------------------------------------------------------------

def make_inputs(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    shape = (1, HEADS, n, HEAD_DIM)
    x = {name: torch.randn(shape, generator=g) for name in ("q", "k", "v", "grad_out")}
    for name in ("q", "k", "v"):
        x[name + "_plain"] = x[name]  # FlexAttention refuses inputs that require gradients
        x[name] = x[name].clone().requires_grad_()
    return x


def sdpa(x, mask=None):
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=mask)


def lsh_ours(x, n, deduplicate):
    g = torch.Generator().manual_seed(0)
    return ea.lsh_attention(x["q"], x["v"], num_hashes=LSH["num_hashes"],
                            num_buckets=max(2, n // LSH["chunk_size"]),
                            chunk_size=LSH["chunk_size"], generator=g, deduplicate=deduplicate)


def lsh_reformer(x, module):
    n = x["q"].shape[-2]
    qk, v = x["q"].reshape(HEADS, n, HEAD_DIM), x["v"].reshape(HEADS, n, HEAD_DIM)
    return module(qk, v)[0].reshape(1, HEADS, n, HEAD_DIM)


def plan(n: int, block_size: int, masks: dict, reformer, flex_compiled: bool) -> dict:
    """``{workload: {method: callable(x) or skip reason (str)}}`` at ``n``."""
    calls: dict[str, dict] = {w: {} for w in WORKLOADS}
    calls["forward"]["SDPA"] = calls["train"]["SDPA"] = sdpa
    if n > DENSE_TRAIN_MAX_N:
        calls["train"]["SDPA"] = (f"n > {DENSE_TRAIN_MAX_N}: a dense training step takes "
                                  "minutes per call here (forward timed)")
    flex_masks = {name: flex_block_mask(mask, n, block_size) for name, mask in masks.items()}
    train_reason = "FlexAttention has no backward on CPU (see flex.backward)"
    for name, mask in masks.items():
        sparse = functools.partial(lambda m, x: ea.block_sparse_attention(
            x["q"], x["k"], x["v"], m, block_size=block_size), mask)
        masked = f"SDPA + token mask ({name})"
        if n <= MASKED_ALL_MAX_N or (name == MASKED_WIDE and n <= MASKED_MAX_N):
            token = ea.block_mask_to_token_mask(mask, n, n, block_size=block_size)
            call = functools.partial(lambda t, x: sdpa(x, t), token)
        else:
            call = (f"n > {MASKED_ALL_MAX_N}: the token mask costs every mask the same "
                    f"(timed for {MASKED_WIDE} up to n = {MASKED_MAX_N})")
        for workload in WORKLOADS:
            calls[workload][f"block-sparse ({name})"] = sparse
            calls[workload][masked] = call
        flex = f"FlexAttention ({name})"
        if flex_compiled:
            calls["forward"][flex] = functools.partial(
                lambda bm, x: compiled_flex()(x["q_plain"], x["k_plain"], x["v_plain"],
                                              block_mask=bm), flex_masks[name])
        else:
            calls["forward"][flex] = "quick run: torch.compile takes minutes here"
        calls["train"][flex] = train_reason
    eager = f"FlexAttention eager ({FLEX_EAGER_MASK})"
    if n <= FLEX_EAGER_MAX_N:
        bm = flex_block_mask(masks[FLEX_EAGER_MASK], n, block_size, with_mask_mod=True)
        calls["forward"][eager] = lambda x: eager_flex(x["q_plain"], x["k_plain"], x["v_plain"],
                                                       bm)
    else:
        calls["forward"][eager] = f"n > {FLEX_EAGER_MAX_N}: materialises the n x n scores"
    calls["train"][eager] = train_reason
    for label in DENSITIES:
        top_k = top_k_blocks(n, block_size, label)
        topk = functools.partial(lambda t, x: ea.topk_block_attention(
            x["q"], x["k"], x["v"], block_size=block_size, top_k=t), top_k)
        for workload in WORKLOADS:
            calls[workload][f"top-k ({label})"] = topk
    lsh = {LSH_OURS: functools.partial(lsh_ours, n=n, deduplicate=True),
           LSH_OURS_DUP: functools.partial(lsh_ours, n=n, deduplicate=False)}
    lsh[REFORMER] = (functools.partial(lsh_reformer, module=reformer[0]) if reformer[0]
                     is not None else reformer[1])
    for name, call in lsh.items():
        for workload in WORKLOADS:
            calls[workload][name] = call if n <= LSH_MAX_N else f"n > {LSH_MAX_N}"
    return calls


# --- time -------------------------------------------------------------------------------------

def time_workload(calls: dict, x: dict, workload: str, repeats: int, paired: bool) -> dict:
    """Timings of every runnable method, taking turns; ``paired``: every call every round."""
    runnable = {name: functools.partial(run_once, workload, call, x)
                for name, call in calls.items() if callable(call)}
    return time_in_turns(runnable, repeats, fewer_rounds_when_slow=not paired)


def ratio_pairs(masks) -> dict:
    pairs = {}
    for name in masks:
        sparse, flex = f"block-sparse ({name})", f"FlexAttention ({name})"
        masked = f"SDPA + token mask ({name})"
        pairs[f"{sparse} / SDPA"] = (sparse, "SDPA")
        pairs[f"{flex} / SDPA"] = (flex, "SDPA")
        pairs[f"{sparse} / {flex}"] = (sparse, flex)
        pairs[f"{sparse} / {masked}"] = (sparse, masked)
        pairs[f"{masked} / SDPA"] = (masked, "SDPA")
    for label in DENSITIES:
        pairs[f"top-k ({label}) / SDPA"] = (f"top-k ({label})", "SDPA")
        pairs[f"top-k ({label}) / block-sparse (random {label})"] = (
            f"top-k ({label})", f"block-sparse (random {label})")
    eager = f"FlexAttention eager ({FLEX_EAGER_MASK})"
    pairs[f"{eager} / FlexAttention ({FLEX_EAGER_MASK})"] = (eager,
                                                             f"FlexAttention ({FLEX_EAGER_MASK})")
    pairs[f"{LSH_OURS} / {REFORMER}"] = (LSH_OURS, REFORMER)
    pairs[f"{LSH_OURS_DUP} / {REFORMER}"] = (LSH_OURS_DUP, REFORMER)
    pairs[f"{LSH_OURS} / SDPA"] = (LSH_OURS, "SDPA")
    return pairs


def ratios(timings: dict[str, Timing], pairs: dict) -> dict:
    return {label: paired_ratio(timings[a], timings[b]) for label, (a, b) in pairs.items()
            if a in timings and b in timings}


# --- memory -----------------------------------------------------------------------------------

def memory_probe(n: int, block_size: int, keys: list[str]) -> None:
    """Subprocess entry: print ``{workload: {method: bytes}}``, the peak extra RSS of one call
    of each ``workload|method`` key at ``n`` (methods warmed up on a small input first;
    compiled FlexAttention at ``n`` itself, so that compiling is not counted)."""
    torch.set_num_threads(THREADS)
    pairs = [key.split("|", 1) for key in keys]
    reformer = reformer_lsh()
    tiny_n = min(n, 4 * max(block_size, 2 * LSH["chunk_size"]))  # at most n (a quick run's)
    tiny = plan(tiny_n, block_size, make_masks(tiny_n, block_size)[0], reformer, False)
    x_tiny = make_inputs(tiny_n)
    for workload, name in pairs:
        if callable(tiny[workload].get(name)):
            run_once(workload, tiny[workload][name], x_tiny)
    del x_tiny
    calls = plan(n, block_size, make_masks(n, block_size)[0], reformer, True)
    x = make_inputs(n)
    for workload, name in pairs:
        if name.startswith("FlexAttention ("):
            run_once(workload, calls[workload][name], x)  # compile for this n
    extra: dict[str, dict[str, int]] = {w: {} for w in WORKLOADS}
    for workload, name in pairs:
        extra[workload][name] = peak_extra_rss(
            functools.partial(run_once, workload, calls[workload][name], x),
            (x["q"], x["k"], x["v"]))
    print(json.dumps(extra))


def measure_memory(n: int, block_size: int, timed: dict) -> tuple[dict, str | None]:
    """Peak extra MiB of every timed (workload, method) at ``n``, from one fresh process."""
    keys = [f"{w}|{name}" for w in WORKLOADS for name, entry in timed[w].items()
            if "median_ms" in entry]
    command = [sys.executable, __file__, "--memory-probe", str(n), str(block_size), *keys]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {}, (done.stderr.strip().splitlines() or ["failed"])[-1]
    extra = json.loads(done.stdout.strip().splitlines()[-1])
    return {w: {name: b / 2**20 for name, b in extra[w].items()} for w in WORKLOADS}, None


# --- checks -----------------------------------------------------------------------------------

def sdpa_ops(block_size: int) -> dict:
    """ATen ops of SDPA, dense and with a token mask, on the benchmark's 4-D layout (training
    step); stop if either is the unfused math kernel."""
    from torch.profiler import ProfilerActivity, profile

    n = 4 * block_size
    x = make_inputs(n)
    token = ea.block_mask_to_token_mask(ea.longformer_block_mask(n, block_size=block_size,
                                                                 window=1),
                                        n, n, block_size=block_size)
    found = {}
    for label, mask in (("dense", None), ("token mask", token)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_once("train", functools.partial(sdpa, mask=mask), x)
        ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
        if not any("flash" in op for op in ops) or any("_math" in op for op in ops):
            raise SystemExit(f"SDPA ({label}) did not take a fused kernel (ops: {ops})")
        found[label] = ops
    return found


def flex_checks(n: int, block_size: int, masks: dict, compiled: bool) -> dict:
    """At ``n``: our BlockMask against ``create_block_mask``'s, and FlexAttention's output
    (compiled, or eager in a quick run) against block-sparse's, for every mask."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
    equal, diff = {}, {}
    for name, mask in masks.items():
        equal[name] = same_as_create_block_mask(mask, n, block_size)
        bm = flex_block_mask(mask, n, block_size, with_mask_mod=not compiled)
        with torch.inference_mode():
            got = compiled_flex()(q, k, v, block_mask=bm) if compiled else eager_flex(q, k, v, bm)
            want = ea.block_sparse_attention(q, k, v, mask, block_size=block_size)
        diff[name] = float((got - want).abs().max())
        if not diff[name] < 1e-3:  # every FlexAttention ratio would compare another function
            raise SystemExit(f"FlexAttention ({name}, {'compiled' if compiled else 'eager'}) "
                             f"differs from block-sparse by {diff[name]:.2e} at n = {n}")
    return {"n": n, "kernel": "compiled" if compiled else "eager",
            "block_mask_equal_to_create_block_mask": equal, "max_abs_diff_vs_block_sparse": diff}


def check_targets(report: dict) -> dict:
    """Block-sparse at density 1/8, n = 16384, against SDPA (limit 0.3), FlexAttention beside."""
    row = report["ratios"].get(str(TARGET_N))
    if row is None:
        return {}
    targets = {}
    for pattern in PATTERNS:
        mask = f"{pattern} {TARGET_DENSITY}"
        for workload in WORKLOADS:
            value = row[workload].get(f"block-sparse ({mask}) / SDPA")
            if value is None:
                continue
            targets[f"block-sparse ({mask}) / SDPA, {workload}, n={TARGET_N}"] = {
                "measured": value, "limit": TARGET_LIMIT, "met": value <= TARGET_LIMIT,
                "flex_attention": row[workload].get(f"FlexAttention ({mask}) / SDPA")}
    return targets


# --- report -----------------------------------------------------------------------------------

def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    cond, setting = report["conditions"], report["setting"]
    sizes = [str(n) for n in setting["sizes"]]
    lines = ["# Block-sparse attention against SDPA and FlexAttention: time and memory", ""]
    if report["preliminary"]:
        lines += ["**PRELIMINARY: measured on a shared, loaded 2-core CPU machine (load average "
                  f"{cond['load_average_start']} at the start, {cond.get('load_average_end')} "
                  "at the end); no GPU was available. Compare the paired ratios, not the "
                  "absolute times; rerun on an idle machine "
                  "(`.venv/bin/python benchmarks/sparse_speed.py`).**", ""]
    lines += [f"q, k, v (1, {HEADS}, n, {HEAD_DIM}) float32, {THREADS} threads, blocks of "
              f"{setting['block_size']} tokens, torch {cond['torch']}. SDPA ops: dense "
              f"{', '.join(report['sdpa_ops']['dense'])}; with a token mask "
              f"{', '.join(report['sdpa_ops']['token mask'])}.", ""]
    if report["targets"]:
        lines += ["## Target: block-sparse at density 1/8, n = 16384, at most 0.3x fused SDPA",
                  "", "| quantity | measured | limit | met | FlexAttention / SDPA |",
                  "|---|---|---|---|---|"]
        for label, entry in report["targets"].items():
            flex = entry["flex_attention"]
            lines.append(f"| {label} | {entry['measured']:.3f} | <= {entry['limit']} | "
                         f"{'yes' if entry['met'] else 'NO'} | "
                         f"{'n/a (no backward on CPU)' if flex is None else f'{flex:.3f}'} |")
        lines.append("")
    lines += ["## Masks", "", "| n | mask | window w / blocks per row | selected blocks | "
              "density |", "|---|---|---|---|---|"]
    for n, masks in report["masks"].items():
        for name, entry in masks.items():
            shape = (f"w = {entry['window']}" if "window" in entry
                     else f"{entry['blocks_per_row']} per row")
            lines.append(f"| {n} | {name} | {shape} | {entry['blocks']} | "
                         f"{entry['density']:.4f} |")
    lines.append("")
    for workload in WORKLOADS:
        names = list(dict.fromkeys(name for n in sizes
                                   for name in report["time"][n][workload]))
        lines += [f"## Median time, {workload} (ms)", "", "| method | " + " | ".join(sizes) + " |",
                  "|---" * (len(sizes) + 1) + "|"]
        for name in names:
            cells = []
            for n in sizes:
                entry = report["time"][n][workload].get(name, {})
                cells.append(f"{entry['median_ms']:.1f}" if "median_ms" in entry else "-")
            if any(cell != "-" for cell in cells):
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        labels = list(dict.fromkeys(label for n in sizes
                                    for label in report["ratios"][n][workload]))
        lines += ["", f"## Ratios of times, {workload} (paired: median over rounds of the "
                  "ratio of two calls of one round)", "",
                  "| ratio | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for label in labels:
            cells = [_fmt(report["ratios"][n][workload].get(label), 3) for n in sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if report["memory_mib"]:
            lines += ["", f"## Peak extra memory of one call, {workload} (MiB)", "",
                      "| method | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
            for name in names:
                cells = [_fmt(report["memory_mib"].get(n, {}).get(workload, {}).get(name))
                         for n in sizes]
                if any(cell != "-" for cell in cells):
                    lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("| one n x n float32 matrix, 8 heads | " + " | ".join(
                f"{report['nxn_mib'][n]:.0f}" for n in sizes) + " |")
        lines.append("")
    skipped = sorted({f"{name}: {entry['skipped']}" for n in sizes for w in WORKLOADS
                      for name, entry in report["time"][n][w].items() if "skipped" in entry})
    flex = report["flex"]
    lines += ["## FlexAttention on this CPU (tried live)", "",
              f"- eager forward: {flex['eager_forward']}",
              f"- eager warning: {flex.get('eager_warning')}",
              f"- compiled forward (torch.compile): {flex['compiled_forward']}",
              f"- backward (eager or compiled): {flex['backward']}"]
    checks = flex.get("checks")
    if checks:
        lines.append(f"- at n = {checks['n']} ({checks['kernel']}): BlockMask equal to "
                     "create_block_mask's: " + ", ".join(
                         f"{m} {'yes' if ok else 'NO'}"
                         for m, ok in checks["block_mask_equal_to_create_block_mask"].items())
                     + "; max abs diff to block-sparse: " + ", ".join(
                         f"{m} {d:.1e}" for m, d in checks["max_abs_diff_vs_block_sparse"].items()))
    lines += ["", "## Public implementations", ""]
    lines += [f"- {name}: {note}" for name, note in report["peers"].items()]
    if report.get("memory_errors"):
        lines += ["", "Memory probes that failed:", ""]
        lines += [f"- n = {n}: {error}" for n, error in report["memory_errors"].items()]
    lines += ["", "Not run:", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines) + "\n"


def plot(report: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(21, 5))
    sizes = [str(n) for n in report["setting"]["sizes"]]

    def series(workload, name):
        points = [(int(n), report["time"][n][workload][name]["median_ms"]) for n in sizes
                  if "median_ms" in report["time"][n][workload].get(name, {})]
        return zip(*points, strict=True) if points else None

    for ax, workload in zip(axes[:2], WORKLOADS, strict=True):
        names = ["SDPA", f"SDPA + token mask ({MASKED_WIDE})"]
        names += [f"block-sparse (window {d})" for d in DENSITIES]
        names += [f"FlexAttention (window {d})" for d in DENSITIES]
        names += [f"top-k ({TARGET_DENSITY})", LSH_OURS, REFORMER]
        for name in names:
            xy = series(workload, name)
            if xy:
                style = "--" if name.startswith("SDPA") else ":" if "Flex" in name else "-"
                ax.loglog(*xy, style, marker="o", ms=3, label=name)
        ax.set(xlabel="sequence length n", ylabel="median time (ms)",
               title=f"{workload}, (1, {HEADS}, n, {HEAD_DIM}), {THREADS} threads")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax = axes[2]
    for workload, style in (("forward", "-"), ("train", "--")):
        for pattern in PATTERNS:
            for method in ("block-sparse", "FlexAttention"):
                label = f"{method} ({pattern} {TARGET_DENSITY}) / SDPA"
                points = [(int(n), report["ratios"][n][workload][label]) for n in sizes
                          if label in report["ratios"][n][workload]]
                if points:
                    ax.semilogx(*zip(*points, strict=True), style, marker="o", ms=3,
                                label=f"{label}, {workload}")
    ax.axhline(TARGET_LIMIT, color="grey", lw=0.8, label=f"target {TARGET_LIMIT}")
    ax.set(xlabel="sequence length n", ylabel="time / SDPA (paired)",
           title=f"density {TARGET_DENSITY} against fused SDPA")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    ax = axes[3]
    for name in ("SDPA", f"SDPA + token mask ({MASKED_WIDE})", f"block-sparse ({MASKED_WIDE})",
                 f"block-sparse (random {TARGET_DENSITY})", f"top-k ({TARGET_DENSITY})",
                 LSH_OURS, REFORMER):
        points = [(int(n), report["memory_mib"][n]["train"][name]) for n in sizes
                  if name in report["memory_mib"].get(n, {}).get("train", {})]
        if points:
            ax.loglog(*zip(*points, strict=True), marker="o", ms=3, label=name)
    ax.loglog([int(n) for n in sizes], [report["nxn_mib"][n] for n in sizes], color="grey",
              lw=0.8, label="one n x n matrix (8 heads)")
    ax.set(xlabel="sequence length n", ylabel="peak extra RSS (MiB)",
           title="training step, peak extra memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


# --- main -------------------------------------------------------------------------------------

def joined_by_other_work(load_average_end: list[float] | None, threads: int) -> bool:
    """Whether other work ran beside the run at its end: the 1- or 5-minute load average then
    exceeds the run's own ``threads`` (which it counts too) by more than one core."""
    return max((load_average_end or [0.0, 0.0])[:2]) - threads > 1.0


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the results preliminary whatever the load")
    parser.add_argument("--memory-probe", nargs="+", help=argparse.SUPPRESS)  # N B KEY...
    args = parser.parse_args(argv)
    if args.memory_probe:
        memory_probe(int(args.memory_probe[0]), int(args.memory_probe[1]), args.memory_probe[2:])
        return None
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(THREADS)
    setting = dict(QUICK if args.quick else FULL)
    if args.sizes:
        setting["sizes"] = args.sizes
    block_size, repeats = setting["block_size"], setting["repeats"]
    compiled = not args.quick
    conditions = run_conditions()
    began = time.perf_counter()
    reformer = reformer_lsh()
    report = {
        "benchmark": "sparse_speed",
        "preliminary": bool(args.preliminary or (conditions["load_average_start"] or [0])[0]
                            > 1.0),
        "quick": args.quick,
        "conditions": conditions,
        "setting": {"shape": [1, HEADS, "n", HEAD_DIM], "dtype": "float32", "threads": THREADS,
                    "sizes": setting["sizes"], "block_size": block_size, "repeats": repeats,
                    "densities": list(DENSITIES), "patterns": list(PATTERNS),
                    "masked_all_max_n": MASKED_ALL_MAX_N, "masked_max_n": MASKED_MAX_N,
                    "flex_eager_max_n": FLEX_EAGER_MAX_N, "lsh_max_n": LSH_MAX_N,
                    "paired_max_n": PAIRED_MAX_N, "dense_train_max_n": DENSE_TRAIN_MAX_N,
                    "lsh": dict(LSH),
                    "flex_compiled": compiled},
        "sdpa_ops": sdpa_ops(block_size),
        "flex": flex_support(block_size),
        "peers": {REFORMER: reformer[1]},
        "masks": {}, "time": {}, "ratios": {}, "memory_mib": {}, "nxn_mib": {},
    }
    for i, n in enumerate(setting["sizes"]):
        key = str(n)
        masks, report["masks"][key] = make_masks(n, block_size)
        if i == 0:
            print(f"n = {n}: FlexAttention checks ...", flush=True)
            try:
                report["flex"]["checks"] = flex_checks(n, block_size, masks, compiled)
                if compiled:
                    report["flex"]["compiled_forward"] = "runs"
            except Exception as exc:  # noqa: BLE001  (recorded; the compiled column is dropped)
                report["flex"]["compiled_forward"] = (
                    f"fails: {type(exc).__name__}: {exc}".splitlines()[0])
                traceback.print_exc()
                compiled = False
        calls = plan(n, block_size, masks, reformer, compiled)
        if not compiled and not args.quick:
            for name in calls["forward"]:
                if name.startswith("FlexAttention ("):
                    calls["forward"][name] = report["flex"]["compiled_forward"]
        x = make_inputs(n)
        pairs = ratio_pairs(masks)
        report["time"][key], report["ratios"][key] = {}, {}
        for workload in WORKLOADS:
            print(f"n = {n}: {workload} ...", flush=True)
            if compiled and workload == "forward":  # compile outside the timed warm-up
                for name, call in calls[workload].items():
                    if name.startswith("FlexAttention (") and callable(call):
                        run_once(workload, call, x)
            paired = workload == "forward" and n <= PAIRED_MAX_N
            timings = time_workload(calls[workload], x, workload, repeats, paired)
            report["time"][key][workload] = {
                name: timings[name].summary("ms") if name in timings else {"skipped": call}
                for name, call in calls[workload].items()}
            report["ratios"][key][workload] = ratios(timings, pairs)
            for label in (f"block-sparse ({p} {TARGET_DENSITY}) / SDPA" for p in PATTERNS):
                value = report["ratios"][key][workload].get(label)
                if value is not None:
                    print(f"    {label}: {value:.3f}", flush=True)
        del x
        report["nxn_mib"][key] = HEADS * n * n * 4 / 2**20
        if not args.no_memory and (not args.quick or n == setting["sizes"][-1]):
            print(f"n = {n}: memory ...", flush=True)
            memory, error = measure_memory(n, block_size, report["time"][key])
            if error is None:
                report["memory_mib"][key] = memory
            else:
                report.setdefault("memory_errors", {})[key] = error
                print(f"    memory probe failed: {error}", flush=True)
    report["targets"] = check_targets(report)
    report["conditions"].update(run_conditions(end=True))
    # a run that other work joined is as preliminary as one that began beside it
    report["preliminary"] = bool(report["preliminary"] or joined_by_other_work(
        report["conditions"].get("load_average_end"), report["setting"]["threads"]))
    report["wall_s"] = time.perf_counter() - began
    for label, entry in report["targets"].items():
        flex = entry["flex_attention"]
        print(f"target {label}: {entry['measured']:.3f} (<= {entry['limit']}): "
              f"{'met' if entry['met'] else 'MISSED'}; FlexAttention / SDPA: "
              f"{'n/a' if flex is None else f'{flex:.3f}'}")
    written = write_results("sparse_speed", report, out=out, markdown=markdown(report),
                            figure=plot(report))
    print(f"wrote {', '.join(str(p) for p in written.values())} in {report['wall_s']:.0f} s")
    return report


if __name__ == "__main__":
    main()
