"""Gated linear recurrences (``ea.gated_linear_attention``, ``ea.delta_rule_attention``)
against causal linear attention and causal SDPA: time and peak tensor memory against n.

Run from the repository root::

    .venv/bin/python benchmarks/recurrent_speed.py          # full run (a few minutes, idle)
    .venv/bin/python benchmarks/recurrent_speed.py --quick  # smoke test, seconds

Setting: ``q, k, v`` of shape ``(1, 8, n, 64)`` float32, CPU, 2 threads, n = 512 ... 16384.
Methods (all causal):

- ``gated chunkwise``: ``ea.gated_linear_attention`` with one decay per token (RetNet /
  Mamba-2 style, the main case), default chunks;
- ``gated per-channel``: the same with one decay per key channel (GLA), ``(1, 8, n, 64)``;
- ``gated recurrent``: the token-by-token loop (only up to ``RECURRENT_MAX_N``);
- ``gated parallel``: the masked ``n x n`` matrix (only up to ``PARALLEL_MAX_N``);
- ``delta chunkwise``: ``ea.delta_rule_attention`` (DeltaNet, unit keys, beta in (0, 1));
- ``causal linear``: ``ea.linear_attention(q, k, v, causal=True)`` (elu + 1 features and a
  normaliser: the same chunked prefix sums without decay);
- ``SDPA causal``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on the 4-D
  tensors (the fused kernel; the script stops if the profiler shows the unfused one).

Two workloads: ``forward`` (one call under ``torch.inference_mode``) and ``train`` (forward
and backward of a fixed random output gradient, every input with ``requires_grad``). Time:
median of several calls after a warm-up, every (workload, method) of one n taking turns
call by call, so that ratios (of the medians) compare calls made under the same load (3 calls
for calls over 2 s, 1 and the warm-up for calls over 10 s: ``_timing.time_in_turns``).
Memory: ``ea.peak_tensor_memory`` of one call (tensors created by PyTorch operators,
gradients included in ``train``; a fused kernel's internal scratch is not seen). A
chunk-size sweep at ``SWEEP_N`` times the forward for several chunk sizes: the library's
defaults were chosen from it.

Writes ``recurrent_speed.json``, ``.md`` and ``.png`` (``benchmarks/results/`` or ``--out``).
JSON keys (``<n>`` a length as a string, ``<workload>`` ``forward`` or ``train``)::

    preliminary  bool: 1-minute load average at the start above 1.0 (rerun when idle)
    quick        bool
    conditions   _results.run_conditions() at the start and the end
    setting      shape, dtype, threads, sizes, repeats, chunk sizes, row blocks, limits
    time         {<n>: {<workload>: {<method>: {"median_ms", "times_ms"} | {"skipped"}}}}
    ratios       {<n>: {<workload>: {<label>: float}}}  (labels: RATIO_PAIRS)
    memory_mib   {<n>: {<workload>: {<method>: float}}}
    nxn_mib      {<n>: float}  one n x n float32 matrix per head (8 heads), for scale
    chunk_sweep  {"n", "median_ms": {<method>: {<chunk>: float}}, "fastest", "default"}
    crossover    {<workload>: n or null}: the smallest measured n from which gated
                 chunkwise is faster than SDPA causal at every larger measured n
    targets      {"gated chunkwise / causal linear at n=8192": {"measured", "limit": 1.5,
                 "met"}} (forward)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import prefer_passive_wait_policy, time_in_turns  # noqa: E402

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

import efficient_attention as ea  # noqa: E402
from efficient_attention._recurrence import BLOCK_ROWS  # noqa: E402

THREADS = 2
HEADS = 8
HEAD_DIM = 64
WORKLOADS = ("forward", "train")
FULL = {"sizes": [512, 1024, 2048, 4096, 8192, 16384], "repeats": 5, "sweep_n": 8192}
QUICK = {"sizes": [64, 128], "repeats": 2, "sweep_n": 128}
RECURRENT_MAX_N = 2048  # n sequential steps: slow, and nothing is extrapolated
PARALLEL_MAX_N = 4096  # a few n x n float32 buffers per head: 512 MiB each (8 heads)
TARGET_N = 8192
TARGET_LIMIT = 1.5
TARGET_LABEL = f"gated chunkwise / causal linear at n={TARGET_N}"
SWEEP_CHUNKS = {"gated chunkwise": [32, 64, 128], "gated per-channel": [16, 32, 64],
                "delta chunkwise": [32, 64, 128]}


def make_inputs(n: int, grad: bool) -> dict[str, torch.Tensor]:
    """Seeded inputs ``(1, 8, n, .)``: q, k, unit keys, v, decays, beta, an output gradient."""
    g = torch.Generator().manual_seed(n)
    shape = (1, HEADS, n, HEAD_DIM)
    x = {name: torch.randn(shape, generator=g) for name in ("q", "k", "v", "grad_out")}
    x["k_unit"] = F.normalize(x["k"], dim=-1)
    x["log_decay"] = F.logsigmoid(torch.randn(shape[:-1], generator=g) + 3.0) / 4
    x["log_decay_channels"] = F.logsigmoid(torch.randn(shape, generator=g) + 3.0) / 4
    x["beta"] = torch.rand(shape[:-1], generator=g)
    for name, t in x.items():
        if name != "grad_out":
            t.requires_grad_(grad)
    return x


def gated(x, chunk_size=None):
    return ea.gated_linear_attention(x["q"], x["k"], x["v"], x["log_decay"],
                                     chunk_size=chunk_size)


def gated_per_channel(x, chunk_size=None):
    return ea.gated_linear_attention(x["q"], x["k"], x["v"], x["log_decay_channels"],
                                     chunk_size=chunk_size)


def delta(x, chunk_size=None):
    return ea.delta_rule_attention(x["q"], x["k_unit"], x["v"], x["beta"], chunk_size=chunk_size)


METHODS = {
    "gated chunkwise": gated,
    "gated per-channel": gated_per_channel,
    "gated recurrent": lambda x: ea.gated_linear_attention(
        x["q"], x["k"], x["v"], x["log_decay"], form="recurrent"),
    "gated parallel": lambda x: ea.gated_linear_attention(
        x["q"], x["k"], x["v"], x["log_decay"], form="parallel"),
    "delta chunkwise": delta,
    "causal linear": lambda x: ea.linear_attention(x["q"], x["k"], x["v"], causal=True),
    "SDPA causal": lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"],
                                                            is_causal=True),
}
LIMITS = {"gated recurrent": RECURRENT_MAX_N, "gated parallel": PARALLEL_MAX_N}
RATIO_PAIRS = {  # label: (numerator, denominator)
    "gated chunkwise / causal linear": ("gated chunkwise", "causal linear"),
    "gated chunkwise / SDPA causal": ("gated chunkwise", "SDPA causal"),
    "gated per-channel / gated chunkwise": ("gated per-channel", "gated chunkwise"),
    "delta chunkwise / gated chunkwise": ("delta chunkwise", "gated chunkwise"),
    "delta chunkwise / causal linear": ("delta chunkwise", "causal linear"),
    "gated recurrent / gated chunkwise": ("gated recurrent", "gated chunkwise"),
    "gated parallel / gated chunkwise": ("gated parallel", "gated chunkwise"),
}


def run_once(method, workload: str, x: dict) -> None:
    """One forward call (no autograd), or one training step: forward, then backward."""
    if workload == "forward":
        with torch.inference_mode():
            method(x)
        return
    for t in x.values():
        t.grad = None
    method(x).backward(x["grad_out"])


def time_turns(calls: dict, repeats: int) -> dict:
    """Median time (ms) of each zero-argument call, the calls taking turns after a warm-up
    (``_timing.time_in_turns``), as ``{name: {"median_ms", "times_ms"}}``."""
    return {name: timing.summary("ms") for name, timing in time_in_turns(calls, repeats).items()}


def measure(n: int, repeats: int) -> tuple[dict, dict]:
    """Times and peak tensor memory (MiB) of every (workload, method) at n."""
    timed, memory = {}, {}
    for workload in WORKLOADS:
        x = make_inputs(n, grad=workload == "train")
        names = [name for name in METHODS if n <= LIMITS.get(name, n)]
        calls = {name: (lambda m=METHODS[name], w=workload, x=x: run_once(m, w, x))
                 for name in names}
        timed[workload] = time_turns(calls, repeats)
        for name in METHODS:
            if name not in names:
                timed[workload][name] = {"skipped": f"n > {LIMITS[name]}"}
        memory[workload] = {name: ea.peak_tensor_memory(call) / 2**20
                            for name, call in calls.items()}
    return timed, memory


def ratios(row: dict) -> dict:
    def t(name):
        return row.get(name, {}).get("median_ms")

    return {label: t(a) / t(b) for label, (a, b) in RATIO_PAIRS.items() if t(a) and t(b)}


def chunk_sweep(n: int, repeats: int) -> dict:
    """Forward time of each chunked method for several chunk sizes, taking turns."""
    x = make_inputs(n, grad=False)
    calls = {(name, c): (lambda m=METHODS[name], c=c: run_once(
        lambda x: m(x, chunk_size=c), "forward", x))
        for name, chunks in SWEEP_CHUNKS.items() for c in chunks}
    result = time_turns(calls, repeats)
    median = {name: {str(c): result[name, c]["median_ms"] for c in chunks}
              for name, chunks in SWEEP_CHUNKS.items()}
    return {"n": n, "median_ms": median,
            "fastest": {name: int(min(m, key=m.get)) for name, m in median.items()},
            "default": {"gated chunkwise": ea.recurrent.DEFAULT_CHUNK_SIZE,
                        "gated per-channel": ea.recurrent.DEFAULT_CHANNEL_CHUNK_SIZE,
                        "delta chunkwise": ea.delta_rule.DEFAULT_CHUNK_SIZE}}


def crossover(report: dict, workload: str) -> int | None:
    """Smallest measured n from which gated chunkwise beats SDPA causal at every larger n."""
    sizes = sorted(int(n) for n in report["ratios"])
    found = None
    for n in reversed(sizes):
        ratio = report["ratios"][str(n)][workload].get("gated chunkwise / SDPA causal")
        if ratio is None or ratio >= 1.0:
            break
        found = n
    return found


def check_targets(report: dict) -> dict:
    ratio = report["ratios"].get(str(TARGET_N), {}).get("forward", {}).get(
        "gated chunkwise / causal linear")
    if ratio is None:
        return {}
    return {TARGET_LABEL: {"measured": ratio, "limit": TARGET_LIMIT,
                           "met": ratio <= TARGET_LIMIT}}


def check_sdpa_is_fused() -> list[str]:
    """The ATen ops of causal SDPA on the benchmark's 4-D layout; stop if it is unfused."""
    from torch.profiler import ProfilerActivity, profile

    x = make_inputs(64, grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_once(METHODS["SDPA causal"], "train", x)
    ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
    fused = any(tag in op for op in ops for tag in ("flash", "efficient", "cudnn"))
    if not fused or any("_math" in op for op in ops):
        raise SystemExit(f"causal SDPA did not take a fused kernel (ops: {ops})")
    return ops


def markdown(report: dict) -> str:
    cond, names = report["conditions"], list(METHODS)
    lines = ["# Gated linear recurrences: time and memory", ""]
    if report["preliminary"]:
        lines += ["**PRELIMINARY: measured on a shared, busy machine; rerun on an idle one "
                  "(`.venv/bin/python benchmarks/recurrent_speed.py`).**", ""]
    lines += [f"q, k, v (1, {HEADS}, n, {HEAD_DIM}) float32, {THREADS} threads, torch "
              f"{cond['torch']}; load average at start / end: {cond['load_average_start']} / "
              f"{cond.get('load_average_end')}. SDPA ops: {', '.join(report['sdpa_ops'])}.", ""]
    for workload in WORKLOADS:
        lines += [f"## Median time, {workload} (ms)", "", "| n | " + " | ".join(names) + " |",
                  "|---" * (len(names) + 1) + "|"]
        for n, row in report["time"].items():
            cells = [f"{row[workload][m]['median_ms']:.1f}" if "median_ms" in row[workload][m]
                     else "-" for m in names]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        labels = list(RATIO_PAIRS)
        lines += ["", f"## Ratios of median times, {workload} (same run, taking turns)", "",
                  "| n | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for n, row in report["ratios"].items():
            cells = [f"{row[workload][label]:.3f}" if label in row[workload] else "-"
                     for label in labels]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", f"## Peak tensor memory, {workload} (MiB)", "",
                  "| n | " + " | ".join(names) + " | one n x n (8 heads) |",
                  "|---" * (len(names) + 2) + "|"]
        for n, row in report["memory_mib"].items():
            cells = [f"{row[workload][m]:.1f}" if m in row[workload] else "-" for m in names]
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {report['nxn_mib'][n]:.0f} |")
        lines.append("")
    sweep = report["chunk_sweep"]
    lines += [f"## Chunk sizes, forward at n = {sweep['n']} (ms)", "",
              "| method | " + " | ".join(f"C = {c}" for c in (16, 32, 64, 128)) +
              " | fastest | default |", "|---" * 7 + "|"]
    for name, medians in sweep["median_ms"].items():
        cells = [f"{medians[str(c)]:.1f}" if str(c) in medians else "-"
                 for c in (16, 32, 64, 128)]
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {sweep['fastest'][name]} | {sweep['default'][name]} |")
    lines += ["", "Crossover with SDPA causal (gated chunkwise faster from this n on): " +
              ", ".join(f"{w}: {report['crossover'][w] or 'not within the measured n'}"
                        for w in WORKLOADS), ""]
    if report["targets"]:
        lines += ["## Targets", "", "| quantity | measured | limit | met |", "|---|---|---|---|"]
        for label, entry in report["targets"].items():
            lines.append(f"| {label} | {entry['measured']:.3f} | <= {entry['limit']} | "
                         f"{'yes' if entry['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, workload in zip(axes[:2], WORKLOADS, strict=True):
        for name in METHODS:
            points = [(int(n), row[workload][name]["median_ms"])
                      for n, row in report["time"].items() if "median_ms" in row[workload][name]]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.loglog(xs, ys, "--" if "SDPA" in name or "linear" in name else "-",
                          marker="o", ms=3, label=name)
        ax.set(xlabel="sequence length n", ylabel="median time (ms)",
               title=f"{workload}, (1, {HEADS}, n, {HEAD_DIM}), {THREADS} threads")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    for name in METHODS:
        points = [(int(n), row["train"][name]) for n, row in report["memory_mib"].items()
                  if name in row["train"]]
        if points:
            xs, ys = zip(*points, strict=True)
            axes[2].loglog(xs, ys, marker="o", ms=3, label=name)
    xs = [int(n) for n in report["nxn_mib"]]
    axes[2].loglog(xs, list(report["nxn_mib"].values()), color="grey", lw=0.8,
                   label="one n x n matrix (8 heads)")
    axes[2].set(xlabel="sequence length n", ylabel="peak tensor memory (MiB)",
                title="training step, peak tensor memory")
    axes[2].grid(True, which="both", alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the results preliminary whatever the load")
    args = parser.parse_args(argv)
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(THREADS)
    plan = QUICK if args.quick else FULL
    conditions = run_conditions()
    report = {
        "benchmark": "recurrent_speed",
        "preliminary": bool(args.preliminary or (conditions["load_average_start"] or [0])[0]
                            > 1.0),
        "quick": args.quick,
        "conditions": conditions,
        "setting": {"shape": [1, HEADS, "n", HEAD_DIM], "dtype": "float32", "threads": THREADS,
                    "sizes": plan["sizes"], "repeats": plan["repeats"],
                    "chunk_size": {"gated": ea.recurrent.DEFAULT_CHUNK_SIZE,
                                   "gated per-channel": ea.recurrent.DEFAULT_CHANNEL_CHUNK_SIZE,
                                   "delta": ea.delta_rule.DEFAULT_CHUNK_SIZE},
                    "block_rows": BLOCK_ROWS,
                    "per_channel_sub_chunk": ea.recurrent.sub_chunk_size(
                        ea.recurrent.DEFAULT_CHANNEL_CHUNK_SIZE),
                    "recurrent_max_n": RECURRENT_MAX_N, "parallel_max_n": PARALLEL_MAX_N},
        "sdpa_ops": check_sdpa_is_fused(),
        "time": {}, "ratios": {}, "memory_mib": {}, "nxn_mib": {},
    }
    for n in plan["sizes"]:
        print(f"n = {n} ...", flush=True)
        timed, memory = measure(n, plan["repeats"])
        key = str(n)
        report["time"][key] = timed
        report["ratios"][key] = {w: ratios(timed[w]) for w in WORKLOADS}
        report["memory_mib"][key] = memory
        report["nxn_mib"][key] = HEADS * n * n * 4 / 2**20
        for w in WORKLOADS:
            print(f"  {w}: " + ", ".join(f"{label} {value:.2f}" for label, value
                                         in report["ratios"][key][w].items()), flush=True)
    print(f"chunk sweep at n = {plan['sweep_n']} ...", flush=True)
    report["chunk_sweep"] = chunk_sweep(plan["sweep_n"], plan["repeats"])
    report["crossover"] = {w: crossover(report, w) for w in WORKLOADS}
    report["targets"] = check_targets(report)
    report["conditions"].update(run_conditions(end=True))
    for label, entry in report["targets"].items():
        print(f"target {label}: {entry['measured']:.3f} (<= {entry['limit']}): "
              f"{'met' if entry['met'] else 'MISSED'}")
    print(f"crossover with SDPA causal: {report['crossover']}")
    written = write_results("recurrent_speed", report, out=out, markdown=markdown(report),
                            figure=plot(report))
    print(f"wrote {', '.join(str(p) for p in written.values())}")
    return report


if __name__ == "__main__":
    main()
