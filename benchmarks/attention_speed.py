"""Time and peak extra memory of attention methods against the sequence length n.

Run from the repository root::

    .venv/bin/python benchmarks/attention_speed.py          # full run (a few minutes)
    .venv/bin/python benchmarks/attention_speed.py --quick  # small sizes, under a minute

Setting: inputs ``(batch, heads, n, d) = (1, 8, n, 64)``, the layout users pass to
PyTorch's ``scaled_dot_product_attention`` (SDPA), float32, CPU, 2 threads, m = 256 random
features. Two workloads per method: one **forward** call (under ``torch.inference_mode``),
and one **training step**: forward and backward with ``requires_grad`` inputs and a fixed
random gradient of the output, what a user training a model pays. Methods: naive softmax
attention (``ea.softmax_attention``, which builds the n x n matrix), fused SDPA
(bidirectional, and ``SDPA causal`` with ``is_causal=True``: the exact baseline of every
causal comparison), linear attention (elu + 1), FAVOR+ (bidirectional and causal), Nystrom
and banded attention, the
"floor" of FAVOR+ (its two ``(n x m) @ (m x d)`` products on ready-made features; forward
only), and, when they can be imported, the public ``nystrom-attention`` and
``performer-pytorch`` implementations (see ``_peers.py``).

The script checks that SDPA takes a fused kernel, bidirectional and causal: the profiler
must show a fused ATen op (on this CPU ``aten::_scaled_dot_product_flash_attention_for_cpu``
and its backward), and the measured peak extra memory of SDPA and SDPA causal must stay far
below one float32 n x n matrix per head. It stops with an error otherwise, because every
ratio against SDPA would then compare with PyTorch's unfused fallback (what a 3-D input
gets), not with what users run.

Time: median over several calls after one warm-up call, every (workload, method) of one n
taking turns (round robin), so that ratios compare calls made under the same load: a ratio
is the median over rounds of the ratio of the two calls of one round (``_timing.py``).
Memory: for each n a fresh subprocess warms every method up on a tiny input, allocates
the inputs, and then for each workload and method in turn releases freed memory to the
OS, resets the kernel's peak-RSS mark, runs it once and reads the peak resident set size
(VmHWM in /proc/self/status); peak minus the RSS just before is the peak extra memory.

Writes benchmarks/results/attention_speed.{json,md,png} (or the folder given by --out; a
``--quick`` run without ``--out`` writes to a temporary folder) through ``_results.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _peers, _results, also by path
from _timing import (  # noqa: E402
    Timing,
    paired_ratio,
    prefer_passive_wait_policy,
    time_in_turns,
)

# Threads that sleep while waiting (instead of spinning) keep a shared, oversubscribed
# machine from turning every parallel region into a wait for a descheduled thread.
prefer_passive_wait_policy()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _peers import (  # noqa: E402
    NYSTROM_PKG,
    PERFORMER_PKG,
    PERFORMER_PKG_CAUSAL,
    nystrom_package_core,
    pack_heads,
    performer_package_attention,
)
from _results import (  # noqa: E402
    add_output_arguments,
    machine_info,
    output_folder,
    pyplot,
    run_conditions,
    write_results,
)

import efficient_attention as ea  # noqa: E402

THREADS = 2
BATCH = 1
HEADS = 8
HEAD_DIM = 64
NUM_FEATURES = 256
LANDMARKS = 64
BANDWIDTH = 32
MODES = ("forward", "train")
QUADRATIC_LIMIT_BYTES = 8 * 2**30  # skip a call whose n x n buffers would pass ~8 GiB
SLOW_CALL_S = 60.0  # a call slower than this at one n is not run at larger n
FULL_SIZES = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_SIZES = [256, 512, 1024]
FLOOR = "floor (2 matmuls)"
FORWARD_ONLY = {FLOOR}  # no parameters, nothing to differentiate


@functools.cache
def frequencies() -> torch.Tensor:
    """The ``(m, d)`` orthogonal FAVOR+ frequencies, shared with the performer-pytorch peer."""
    g = torch.Generator().manual_seed(0)
    return ea.gaussian_random_matrix(NUM_FEATURES, HEAD_DIM, orthogonal=True, generator=g)


def make_inputs(n: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Seeded inputs for one n: leaf q, k, v ``(1, 8, n, 64)`` with ``requires_grad``, the
    gradient of the output, the frequencies and the floor's operands.

    ``packed`` adds ``[q | k | v]`` laid out for the public Nystrom package (its own leaf).
    """
    g = torch.Generator().manual_seed(n)
    shape = (BATCH, HEADS, n, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    inputs = {
        "q": q, "k": k, "v": v,
        "grad_out": torch.randn(shape, generator=g),
        "w": frequencies(),
        "features": torch.rand(BATCH, HEADS, n, NUM_FEATURES, generator=g),
        "state": torch.randn(BATCH, HEADS, NUM_FEATURES, HEAD_DIM, generator=g),
    }
    if packed:
        inputs["packed"] = pack_heads(q, k, v).detach().requires_grad_()
        inputs["grad_out_packed"] = inputs["grad_out"].transpose(1, 2).reshape(1, n, -1)
    return inputs


def leaves(x: dict) -> list[torch.Tensor]:
    return [t for t in x.values() if t.requires_grad]


QUADRATIC_BUFFERS = {  # (method, workload): n x n float32 buffers per head alive at the peak
    ("naive softmax", "forward"): 3.0,  # scores, weights, one temporary (6.0 GiB at 8192)
    ("naive softmax", "train"): 7.0,  # saved weights, their gradient, temporaries (6.8 measured)
}
STATE_BUFFERS = {  # (method, workload): n x m x d float32 buffers per head at the peak
    # performer-pytorch's causal fallback materialises the running (m x d) state of every
    # position of a chunk, and keeps all of them for the backward pass (measured: 0.85 of
    # them forward at n = 4096, 4.0 in a training step at n = 2048)
    (PERFORMER_PKG_CAUSAL, "forward"): 1.2,
    (PERFORMER_PKG_CAUSAL, "train"): 4.5,
}


def needed_bytes(name: str, mode: str, n: int) -> float:
    """Estimated peak bytes of the buffers that grow fastest with n (0 for the others)."""
    per_head = (QUADRATIC_BUFFERS.get((name, mode), 0.0) * n * n
                + STATE_BUFFERS.get((name, mode), 0.0) * n * NUM_FEATURES * HEAD_DIM)
    return per_head * BATCH * HEADS * 4


def floor(x):
    """phi(K)^T V and phi(Q) S: the two products of size (n x m)(m x d)."""
    return x["features"].transpose(-2, -1) @ x["v"], x["features"] @ x["state"]


def sdpa(x):
    """PyTorch's exact attention, called as users call it: on 4-D (batch, heads, n, d)."""
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"])


def sdpa_causal(x):
    """Causal exact attention as users call it: 4-D, ``is_causal=True`` (the fused kernel
    skips the key blocks above the diagonal). The baseline of every causal comparison."""
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)


METHODS = {
    "naive softmax": lambda x: ea.softmax_attention(x["q"], x["k"], x["v"]),
    "SDPA": sdpa,
    "SDPA causal": sdpa_causal,
    "linear (elu+1)": lambda x: ea.linear_attention(x["q"], x["k"], x["v"]),
    "FAVOR+": lambda x: ea.favor_attention(x["q"], x["k"], x["v"], x["w"]),
    "FAVOR+ causal": lambda x: ea.favor_attention(x["q"], x["k"], x["v"], x["w"], causal=True),
    FLOOR: floor,
    "Nystrom (64 landmarks)": lambda x: ea.nystrom_attention(x["q"], x["k"], x["v"],
                                                             num_landmarks=LANDMARKS),
    "banded (w=32)": lambda x: ea.banded_attention(x["q"], x["k"], x["v"], bandwidth=BANDWIDTH),
}


def peer_methods() -> tuple[dict, dict]:
    """The public implementations that can be imported here, and a note for each."""
    methods, notes = {}, {}
    core = nystrom_package_core(HEADS, HEAD_DIM, LANDMARKS)
    if core is None:
        notes[NYSTROM_PKG] = "skipped: nystrom-attention is not importable"
    else:
        methods[NYSTROM_PKG] = lambda x: core(x["packed"])
        notes[NYSTROM_PKG] = "timed"
    for name, causal in ((PERFORMER_PKG, False), (PERFORMER_PKG_CAUSAL, True)):
        module = performer_package_attention(frequencies(), causal)
        if module is None:
            notes[name] = "skipped: performer_pytorch is not importable"
            continue
        methods[name] = functools.partial(lambda mod, x: mod(x["q"], x["k"], x["v"]), module)
        notes[name] = "timed"
    return methods, notes


def available_methods() -> dict:
    return {**METHODS, **peer_methods()[0]}


def run_once(mode: str, method, x: dict) -> None:
    """One forward call (no autograd), or one training step: forward, then backward."""
    if mode == "forward":
        with torch.inference_mode():
            method(x)
        return
    for leaf in leaves(x):
        leaf.grad = None
    out = method(x)
    out.backward(x["grad_out"] if out.shape == x["grad_out"].shape else x["grad_out_packed"])


def tasks(names, modes=MODES) -> list[tuple[str, str]]:
    """(workload, method) pairs to run: every method forward, all but the floor trained."""
    return [(mode, name) for mode in modes for name in names
            if not (mode == "train" and name in FORWARD_ONLY)]


def skip_reason(name: str, mode: str, n: int) -> str | None:
    needed = needed_bytes(name, mode, n)
    if needed > QUADRATIC_LIMIT_BYTES:
        return f"needs ~{needed / 2**30:.0f} GiB (> 8 GiB)"
    return None


# --- is SDPA fused? -------------------------------------------------------------------------

FUSED_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention")
UNFUSED_OP = "_scaled_dot_product_attention_math"


def sdpa_kernels(shape: tuple[int, ...], causal: bool = False) -> dict[str, list[str]]:
    """The ATen ops that SDPA dispatches to on inputs of ``shape``, forward and training step
    (with ``is_causal=causal``)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    ops = {}
    for mode in MODES:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if mode == "forward":
                with torch.inference_mode():
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        ops[mode] = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name
                            or "flash" in e.name})
    return ops


def is_fused(ops: list[str]) -> bool:
    return any(fused in op for op in ops for fused in FUSED_OPS) and not any(
        UNFUSED_OP in op for op in ops)


BENCHMARK_LAYOUTS = ("4-D (benchmark)", "4-D causal (benchmark)")  # must be fused


def check_sdpa_is_fused(kernels: dict) -> None:
    """Stop the run if SDPA on the benchmark's 4-D layout (bidirectional, and causal where
    profiled) did not take a fused kernel."""
    for layout in BENCHMARK_LAYOUTS:
        for mode, ops in kernels.get(layout, {}).items():
            if not is_fused(ops):
                raise SystemExit(f"SDPA {mode}, {layout}, on (1, 8, n, 64) ran {ops}: no "
                                 "fused kernel. Every ratio against SDPA would compare with "
                                 "the unfused fallback; fix the call before benchmarking.")


def sdpa_memory_bound(n: int) -> float:
    """Bytes SDPA may add at ``n`` and still count as fused: half of one float32 ``n x n``
    score matrix per head. The unfused path keeps at least one full such matrix (measured
    2.25 of them forward on 3-D inputs); the fused one keeps blocks and O(n d) tensors."""
    return 0.5 * BATCH * HEADS * n * n * 4


def check_sdpa_memory(n: int, memory: dict) -> list[str]:
    """Stop the run if the measured peak extra memory of SDPA or SDPA causal at ``n`` looks
    quadratic."""
    checked = []
    for mode in MODES:
        for name in ("SDPA", "SDPA causal"):
            mib = memory.get(mode, {}).get(name, {}).get("peak_extra_mib")
            if mib is None or n < 2048:  # below, fixed overheads are of the bound's size
                continue
            bound = sdpa_memory_bound(n) / 2**20
            if mib > bound:
                raise SystemExit(f"{name} {mode} at n = {n} used {mib:.0f} MiB of extra "
                                 f"memory, more than {bound:.0f} MiB (half an n x n float32 "
                                 "matrix per head): the fused kernel was not used.")
            checked.append(f"{name} {mode} at n = {n}: {mib:.1f} MiB <= {bound:.0f} MiB")
    return checked


# --- memory ---------------------------------------------------------------------------------

def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def release_free_memory() -> None:
    """Hand memory that malloc keeps after ``free`` back to the OS (glibc ``malloc_trim``)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: large blocks are unmapped anyway
        pass


def peak_extra_rss(call, inputs=()) -> int:
    """Peak extra resident bytes of one ``call()``.

    Writing 5 to /proc/self/clear_refs resets the kernel's peak-RSS mark (VmHWM) to the
    current RSS, so VmHWM after the call is the peak during it. Before it, freed memory is
    handed back to the OS, so that the call does not run in memory a previous one left
    resident, and the gradients a previous call left on the tensors ``inputs`` are dropped:
    ``run_once`` drops them itself, but inside the call, where the memory they free would be
    reused by the new ones and hide that much of the peak. (``ru_maxrss`` would not do: on
    Linux it keeps the parent's RSS across fork and exec, and it cannot be reset.) A training
    step's gradients count: they are allocated during the call.
    """
    for tensor in inputs:
        tensor.grad = None
    release_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    call()
    return max(0, status_bytes("VmHWM") - before)


def memory_probe(n: int, keys: list[str]) -> None:
    """Subprocess entry: print the peak extra RSS (``peak_extra_rss``) of each
    ``mode:method`` key at ``n``."""
    torch.set_num_threads(THREADS)
    methods = available_methods()
    pairs = [key.split(":", 1) for key in keys]
    packed = any(name == NYSTROM_PKG for _, name in pairs)
    tiny = make_inputs(64, packed)
    for mode, name in pairs:
        run_once(mode, methods[name], tiny)  # load kernels and libraries
    del tiny
    inputs = make_inputs(n, packed)
    extra: dict[str, dict[str, int]] = {mode: {} for mode in MODES}
    for mode, name in pairs:
        extra[mode][name] = peak_extra_rss(
            functools.partial(run_once, mode, methods[name], inputs), leaves(inputs))
    print(json.dumps(extra))


def run_probe(args: list[str], env: dict | None = None) -> tuple[object, str | None]:
    """Run this script with hidden probe ``args`` in a fresh process.

    Returns ``(value, None)`` with the JSON of its last line of output, or
    ``(None, error)`` with the last line of its error output.
    """
    command = [sys.executable, __file__, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1]), None


def measure_memory(n: int, pairs: list[tuple[str, str]]) -> dict:
    """Peak extra MiB of each (workload, method) at ``n``, from one fresh subprocess."""
    extra, error = run_probe(["--memory-probe", str(n), *(f"{m}:{name}" for m, name in pairs)])
    out: dict[str, dict] = {mode: {} for mode in MODES}
    for mode, name in pairs:
        out[mode][name] = ({"error": error} if error is not None
                           else {"peak_extra_mib": extra[mode][name] / 2**20})
    return out


# --- time -----------------------------------------------------------------------------------

POLICY_METHODS = ["FAVOR+", "FAVOR+ causal", FLOOR]
PROBE_ROUNDS = 25  # rounds of the wait-policy probes (a round costs about 0.3 s at n = 8192)
WAIT_POLICIES = ("PASSIVE", "ACTIVE")
POLICY_RATIOS = ("FAVOR+ / floor", "FAVOR+ causal / FAVOR+")  # reported for each policy


def time_probe(n: int, repeats: int, names: list[str]) -> None:
    """Subprocess entry: print the forward times of ``names`` at ``n`` (taking turns) and their
    paired ratios, as ``{"time": ..., "ratios": ...}``."""
    torch.set_num_threads(THREADS)
    methods = {name: method for name, method in available_methods().items() if name in names}
    print(json.dumps(time_methods(methods, n, repeats, set(), modes=("forward",))["forward"]))


def compare_wait_policies(n: int, repeats: int) -> dict:
    """FAVOR+ against the floor with idle OpenMP threads sleeping (PASSIVE) or spinning (ACTIVE).

    The policy is read once, when the OpenMP runtime starts, so each one is timed in a
    fresh process; the two processes run one after the other at the same ``n``.
    PASSIVE suits a shared, busy machine (the default of ``make bench``); ACTIVE is
    close to what an unset policy gives on an idle machine. Many small operations (the
    feature blocks of FAVOR+) pay a thread wake-up each under PASSIVE; two large matmuls
    (the floor) hardly do, so the ratio depends on the policy.
    """
    out = {}
    for policy in WAIT_POLICIES:
        timed, error = run_probe(["--time-probe", str(n), str(repeats), *POLICY_METHODS],
                                 env={**os.environ, "OMP_WAIT_POLICY": policy})
        out[policy] = {"error": error} if error else {"time": timed["time"],
                                                       "ratios": timed["ratios"]}
    return out


def time_methods(methods: dict, n: int, repeats: int, slow: set, modes=MODES) -> dict:
    """Time every (workload, method) at ``n``, all of them taking turns (``_timing``).

    Returns ``{workload: {"time": {method: {"median_s", "times_s"} or {"skipped": why}},
    "ratios": {label: paired ratio}}}``. A (workload, method) whose warm-up took more than
    ``SLOW_CALL_S`` is added to ``slow``, and not run at the larger n that follow.
    """
    inputs = make_inputs(n, NYSTROM_PKG in methods)
    results: dict[str, dict] = {mode: {} for mode in modes}
    calls = {}
    for mode, name in tasks(methods, modes):
        reason = ("slower than 60 s at a smaller n" if (mode, name) in slow
                  else skip_reason(name, mode, n))
        if reason:
            results[mode][name] = {"skipped": reason}
        else:
            calls[mode, name] = functools.partial(run_once, mode, methods[name], inputs)
    timings = time_in_turns(calls, repeats)
    for (mode, name), timing in timings.items():
        results[mode][name] = timing.summary("s")
        if timing.warm_up_s > SLOW_CALL_S:
            slow.add((mode, name))
    return {mode: {"time": results[mode],
                   "ratios": ratios({name: timing for (m, name), timing in timings.items()
                                     if m == mode})}
            for mode in modes}


RATIO_PAIRS = {  # label: (numerator, denominator)
    "FAVOR+ / floor": ("FAVOR+", FLOOR),
    "FAVOR+ / SDPA": ("FAVOR+", "SDPA"),
    "FAVOR+ causal / FAVOR+": ("FAVOR+ causal", "FAVOR+"),
    "FAVOR+ causal / SDPA causal": ("FAVOR+ causal", "SDPA causal"),
    "SDPA causal / SDPA": ("SDPA causal", "SDPA"),
    "naive / SDPA": ("naive softmax", "SDPA"),
    "linear / SDPA": ("linear (elu+1)", "SDPA"),
    "banded / SDPA": ("banded (w=32)", "SDPA"),
    "Nystrom / SDPA": ("Nystrom (64 landmarks)", "SDPA"),
    "Nystrom / nystrom-attention pkg": ("Nystrom (64 landmarks)", NYSTROM_PKG),
    "FAVOR+ / performer-pytorch": ("FAVOR+", PERFORMER_PKG),
    "FAVOR+ causal / performer-pytorch causal": ("FAVOR+ causal", PERFORMER_PKG_CAUSAL),
}


def ratios(timings: dict[str, Timing]) -> dict:
    """The ratios of ``RATIO_PAIRS`` of one workload at one n (where both were timed): the
    median over rounds of the ratio of the two calls of one round (``_timing.paired_ratio``)."""
    return {label: paired_ratio(timings[a], timings[b]) for label, (a, b) in RATIO_PAIRS.items()
            if a in timings and b in timings}


# --- report ---------------------------------------------------------------------------------

TITLES = {"forward": "one forward call", "train": "one training step (forward + backward)"}


def table(report: dict, header: str, cell) -> list[str]:
    """One markdown table, a row per n and a column per method (``cell(row, name)``)."""
    names = report["methods"]
    lines = [header, "", "| n | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for n, row in report["results"].items():
        lines.append(f"| {n} | " + " | ".join(cell(row, name) for name in names) + " |")
    return lines + [""]


def time_cell(mode):
    def cell(row, name):
        entry = row[mode]["time"].get(name)
        if entry is None:
            return "-"
        return f"{1e3 * entry['median_s']:.1f}" if "median_s" in entry else "skipped"
    return cell


def memory_cell(mode):
    def cell(row, name):
        entry = row[mode].get("memory", {}).get(name, {})
        return f"{entry['peak_extra_mib']:.0f}" if "peak_extra_mib" in entry else "-"
    return cell


def markdown(report: dict) -> str:
    """The tables of ``attention_speed.md``."""
    loads = report["loadavg_start"], report["loadavg_end"]
    lines = [
        "# Attention time and peak extra memory: forward call and training step",
        "",
        f"Inputs (batch, heads, n, d) = ({BATCH}, {HEADS}, n, {HEAD_DIM}), float32, "
        f"{THREADS} threads, m = {NUM_FEATURES} features. torch {report['torch']}, "
        f"{report['machine']}. Load average (1, 5, 15 min) at start: "
        f"{', '.join(f'{x:.1f}' for x in loads[0])}; at end: "
        f"{', '.join(f'{x:.1f}' for x in loads[1])}.",
        "",
        "SDPA kernels (profiler): " + "; ".join(
            f"{layout} {mode}: {', '.join(ops)}"
            for layout, per_mode in report["sdpa_kernels"].items()
            for mode, ops in per_mode.items()),
        "",
    ]
    for mode in MODES:
        lines += table(report, f"## Median time of {TITLES[mode]} (ms)", time_cell(mode))
    for mode in MODES:
        if any(row[mode].get("memory") for row in report["results"].values()):
            lines += table(report, f"## Peak extra memory of {TITLES[mode]} (MiB)",
                           memory_cell(mode))
    for mode in MODES:
        labels = [label for label in RATIO_PAIRS
                  if any(label in row[mode]["ratios"] for row in report["results"].values())]
        lines += [f"## Ratios of times, {TITLES[mode]} (median over rounds, calls taking turns)",
                  "",
                  "| n | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for n, row in report["results"].items():
            cells = [f"{row[mode]['ratios'][label]:.3f}" if label in row[mode]["ratios"]
                     else "-" for label in labels]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    if report.get("targets"):
        lines += [f"## Targets at n = {TARGET_N} (forward)", "",
                  "| quantity | measured | target | met |", "|---|---|---|---|"]
        for label, entry in report["targets"].items():
            lines.append(f"| {label} | {entry['measured']:.3f} | <= {entry['limit']} | "
                         f"{'yes' if entry['met'] else 'NO'} |")
        lines.append("")
    if report.get("wait_policies"):
        lines += [f"## FAVOR+ at n = {TARGET_N} under each OpenMP wait policy", "",
                  "Each policy timed in a fresh process (forward calls taking turns), one after "
                  "the other. PASSIVE: idle threads sleep (the default of `make bench`, for "
                  "shared machines); ACTIVE: they spin (close to an unset policy on an idle "
                  "machine).", "", "| OMP_WAIT_POLICY | FAVOR+ (ms) | FAVOR+ causal (ms) | "
                  "floor (ms) | FAVOR+ / floor | FAVOR+ causal / FAVOR+ |",
                  "|---|---|---|---|---|---|"]
        for policy, entry in report["wait_policies"].items():
            if "time" not in entry:
                lines.append(f"| {policy} | {entry.get('error', 'failed')} | | | | |")
                continue
            ms = [entry["time"].get(name, {}).get("median_s") for name in POLICY_METHODS]
            cells = [f"{1e3 * t:.1f}" if t else "-" for t in ms]
            cells += [f"{entry['ratios'].get(label, float('nan')):.3f}"
                      for label in POLICY_RATIOS]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    skipped = sorted({
        f"{name}, {mode}, at n = {n}: {entry['skipped']}"
        for n, row in report["results"].items() for mode in MODES
        for name, entry in row[mode]["time"].items() if "skipped" in entry
    })
    if skipped:
        lines += ["Skipped:", ""] + [f"- {s}" for s in skipped] + [""]
    lines += ["Public implementations:", ""]
    lines += [f"- {name}: {note}" for name, note in report["peers"].items()] + [""]
    lines += ["Notes:", ""] + [f"- {s}" for s in report["notes"]]
    return "\n".join(lines) + "\n"


TARGET_N = 8192
TARGETS = {  # label: (forward ratio label or memory method, limit)
    "FAVOR+ / floor": ("FAVOR+ / floor", 2.5),
    "FAVOR+ causal / FAVOR+": ("FAVOR+ causal / FAVOR+", 2.0),
    "FAVOR+ peak extra memory (MiB)": ("FAVOR+", 150),
    "Nystrom / nystrom-attention pkg": ("Nystrom / nystrom-attention pkg", 1.0),
    "FAVOR+ / performer-pytorch": ("FAVOR+ / performer-pytorch", 1.0),
}


def check_targets(report: dict) -> dict:
    """The project's targets at n = 8192, forward, measured in this run (empty if not run)."""
    row = report["results"].get(str(TARGET_N))
    if row is None:
        return {}
    measured = {}  # label -> (value, limit)
    for label, (key, limit) in TARGETS.items():
        if label.endswith("(MiB)"):
            entry = row["forward"].get("memory", {}).get(key, {})
            measured[label] = (entry.get("peak_extra_mib"), limit)
        else:
            measured[label] = (row["forward"]["ratios"].get(key), limit)
    for policy, entry in report.get("wait_policies", {}).items():
        for label in POLICY_RATIOS:
            measured[f"{label}, OMP_WAIT_POLICY={policy} probe"] = (
                entry.get("ratios", {}).get(label), TARGETS[label][1])
    return {label: {"measured": value, "limit": limit, "met": value <= limit}
            for label, (value, limit) in measured.items() if value is not None}


CAUSAL_METHODS = ("SDPA causal", "FAVOR+ causal", PERFORMER_PKG_CAUSAL)


def plot(report: dict):
    """The figure of ``attention_speed.png``: time against n, one panel per workload, for
    the bidirectional methods (against SDPA) and the causal ones (against SDPA causal)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharey=True)
    for row_axes, causal in zip(axes, (False, True), strict=True):
        names = [name for name in report["methods"] if (name in CAUSAL_METHODS) == causal]
        colours = {name: f"C{i % 10}" for i, name in enumerate(names)}  # distinct in a row
        for ax, mode in zip(row_axes, MODES, strict=True):
            for name in names:
                points = [(int(n), row[mode]["time"][name]["median_s"])
                          for n, row in report["results"].items()
                          if "median_s" in row[mode]["time"].get(name, {})]
                if points:
                    xs, ys = zip(*points, strict=True)
                    style = "--" if name.startswith("floor") else ":" if "pkg" in name or (
                        "pytorch" in name) else "-"
                    ax.loglog(xs, ys, style, marker="o", ms=3, color=colours[name],
                              label=name)
            kind = "causal, against SDPA causal" if causal else "bidirectional"
            ax.set_title(f"{TITLES[mode]}, {kind}", fontsize=10)
            ax.set_xlabel("sequence length n")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        row_axes[0].set_ylabel("median time (s)")
    fig.suptitle(f"(1, {HEADS}, n, {HEAD_DIM}) float32, CPU, {THREADS} threads")
    fig.tight_layout()
    return fig


def print_row(n: int, row: dict) -> None:
    for mode in MODES:
        for name, entry in row[mode]["time"].items():
            shown = f"{1e3 * entry['median_s']:9.1f} ms" if "median_s" in entry else "  skipped"
            memory = row[mode].get("memory", {}).get(name, {}).get("peak_extra_mib")
            extra = f"  {memory:8.1f} MiB" if memory is not None else ""
            print(f"    {mode:8s}{name:40s}{shown}{extra}", flush=True)
        for label, value in row[mode]["ratios"].items():
            print(f"    {mode:8s}{label:40s}{value:9.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--repeats", type=int, help="timed calls per method (default 5)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--memory-probe", nargs="+", help=argparse.SUPPRESS)  # N MODE:METHOD...
    parser.add_argument("--time-probe", nargs="+", help=argparse.SUPPRESS)  # N REPEATS METHOD...
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(int(args.memory_probe[0]), args.memory_probe[1:])
        return
    if args.time_probe:
        time_probe(int(args.time_probe[0]), int(args.time_probe[1]), args.time_probe[2:])
        return
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(THREADS)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (3 if args.quick else 5)
    peers, peer_notes = peer_methods()
    methods = {**METHODS, **peers}
    kernels = {"4-D (benchmark)": sdpa_kernels((BATCH, HEADS, 64, HEAD_DIM)),
               "4-D causal (benchmark)": sdpa_kernels((BATCH, HEADS, 64, HEAD_DIM), True),
               "3-D (not used)": sdpa_kernels((BATCH * HEADS, 64, HEAD_DIM))}
    check_sdpa_is_fused(kernels)
    began = time.perf_counter()
    conditions = run_conditions()
    machine = machine_info()
    report = {
        "quick": args.quick,
        "conditions": conditions,
        "torch": machine["torch"],
        "machine": machine["processor"],
        "threads": THREADS,
        "shape": [BATCH, HEADS, "n", HEAD_DIM],
        "num_features": NUM_FEATURES,
        "omp_wait_policy": machine["omp_wait_policy"],
        "cpu_count": machine["cpu_count"],
        "load_start": conditions["load_average_start"][0],
        "loadavg_start": conditions["load_average_start"],
        "sdpa_kernels": kernels,
        "sdpa_memory_checks": [],
        "modes": list(MODES),
        "methods": list(methods),
        "peers": peer_notes,
        "results": {},
        "notes": [
            f"time: median of {repeats} calls after a warm-up (3 for calls slower than 2 s; "
            "for calls slower than 10 s, the warm-up and one more call); every workload and "
            "method of one n taking turns",
            "ratios: median over rounds of the ratio of the two calls made in the same round "
            "(the ratio of the medians where the two were not timed in the same rounds); "
            f"the wait-policy probes at n = {TARGET_N}: {PROBE_ROUNDS} rounds each",
            "forward: one call under torch.inference_mode(); train: forward and backward of "
            "a fixed random output gradient, inputs q, k, v with requires_grad",
            "memory: peak RSS (VmHWM) of a fresh process during one call minus its RSS before",
            "skipped where the estimated buffers would exceed 8 GiB: naive softmax (3 n x n "
            "float32 buffers per head forward, 7 in a training step), performer-pytorch's "
            "causal fallback (1.2 n x m x d buffers per head forward, 4.5 in training)",
            "SDPA and SDPA causal must take a fused kernel (profiler op names) and stay below "
            "half an n x n float32 matrix per head of extra memory from n = 2048 on, or the "
            "run stops",
            "causal methods are compared with SDPA causal (is_causal=True), bidirectional "
            "ones with SDPA",
        ],
    }
    slow: set[tuple] = set()
    for n in sizes:
        print(f"n = {n}: timing ...", flush=True)
        row = time_methods(methods, n, repeats, slow)
        if not args.no_memory and (not args.quick or n == sizes[-1]):  # quick: largest n
            print(f"n = {n}: memory ...", flush=True)
            pairs = [(mode, name) for mode in MODES for name, entry in row[mode]["time"].items()
                     if "median_s" in entry]
            memory = measure_memory(n, pairs)
            for mode in MODES:
                row[mode]["memory"] = memory[mode]
            report["sdpa_memory_checks"] += check_sdpa_memory(n, memory)
        report["results"][str(n)] = row
        print_row(n, row)
    if str(TARGET_N) in report["results"]:
        print(f"n = {TARGET_N}: FAVOR+ and the floor under each OpenMP wait policy ...",
              flush=True)
        report["wait_policies"] = compare_wait_policies(TARGET_N, PROBE_ROUNDS)
        for policy, entry in report["wait_policies"].items():
            for label in POLICY_RATIOS:
                value = entry.get("ratios", {}).get(label)
                shown = f"{value:9.3f}" if value is not None else entry.get("error", "-")
                print(f"    {policy:8s}{label:24s}{shown}", flush=True)
    report["conditions"].update(run_conditions(end=True))
    report["load_end"] = report["conditions"]["load_average_end"][0]
    report["loadavg_end"] = report["conditions"]["load_average_end"]
    report["targets"] = check_targets(report)
    for label, entry in report["targets"].items():
        verdict = "met" if entry["met"] else "MISSED"
        print(f"target at n = {TARGET_N}: {label} = {entry['measured']:.3f} "
              f"(<= {entry['limit']}): {verdict}")
    report["wall_s"] = time.perf_counter() - began
    write_results("attention_speed", report, out=out, markdown=markdown(report),
                  figure=plot(report))
    print(f"wrote {out}/attention_speed.{{json,md,png}} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
