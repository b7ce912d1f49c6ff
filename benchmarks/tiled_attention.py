"""Tiled exact attention (``ea.tiled_attention``) against fused SDPA: time and peak memory.

Run from the repository root::

    .venv/bin/python benchmarks/tiled_attention.py          # full run (about 6 minutes, idle)
    .venv/bin/python benchmarks/tiled_attention.py --quick  # smoke test, seconds

Setting: ``q, k, v`` of shape ``(1, 8, n, 64)`` (batch 1, 8 heads, head dimension 64),
float32, CPU, 2 threads. Methods: ``SDPA`` is
``torch.nn.functional.scaled_dot_product_attention`` on these 4-D tensors (PyTorch's
fused kernel, ``is_causal=True`` when causal), ``tiled`` is ``ea.tiled_attention`` with
its default tiles, ``naive`` is ``ea.softmax_attention`` (the ``n x n`` weights; only for
``n <= 4096``, where its buffers stay below about 3 GiB).

Writes ``tiled_attention.json``, ``.md`` and ``.png`` to ``benchmarks/results/`` (or
``--out``). The JSON keys are stable (``book/flash_attention.ipynb`` reads them); ``<n>``
is a sequence length written as a string, ``<method>`` one of ``"SDPA"``, ``"tiled"``,
``"naive"``::

    preliminary      bool: measured on a busy machine (1-minute load average at the start
                     above 1.0, or --preliminary); rerun on an idle machine for the book
    quick            bool: --quick run (small sizes)
    conditions       _results.run_conditions() at the start, plus "finished" and
                     "load_average_end" (os.getloadavg(): 1, 5, 15 minutes)
    setting          {"shape": [1, 8, "n", 64], "dtype": "float32", "threads": 2,
                      "block_size": [block_q, block_k] (the library default),
                      "repeats": int, "time_sizes": [n...], "memory_sizes": [n...]}
    tile_sweep       {"n": int, "block_sizes": [[block_q, block_k], ...],
                      "median_ms": [...], "tiled_over_sdpa": [...] (same order),
                      "sdpa_median_ms": float, "fastest": [block_q, block_k],
                      "default": [block_q, block_k]}   forward, bidirectional
    time             {<n>: {<case>: {<method>: {"median_ms": float, "times_ms": [...]}}}}
                     <case>: "forward", "forward_causal", "training_step",
                     "training_step_causal" (training step = forward + backward of
                     (out * g).sum() with respect to q, k, v); a method not run at n is
                     absent from that case
    ratios           {<n>: {"<case> tiled / SDPA": float, "<case> naive / SDPA": float}}
                     medians of calls that took turns in one process (same load)
    memory_mib       {<n>: {"forward" | "training_step_causal": {<method>: float}}}
                     peak extra resident memory (MiB) of one call in a fresh process
    nxn_mib          {<n>: float}  one n x n float32 matrix per head (8 n^2 4 bytes), MiB
    targets          {<label>: {"measured": float, "limit": float, "met": bool}}
                     "forward tiled / SDPA at n = 8192" (limit 1.5), and for
                     "forward" and "training_step_causal": "<case> tiled memory growth
                     16384 / 8192" (limit 2.5: linear growth gives 2, quadratic 4)

Time: median of several calls (default 5; 3 for calls over 2 s) after a warm-up; at each
``n`` the methods take turns, call by call, so that ratios (of the medians) compare calls
made under the same load (``_timing.time_in_turns``). Memory: in a fresh subprocess per ``n``
and case, for each method in turn, freed memory is returned to the OS, the kernel's peak-RSS
mark is reset and the call runs once; peak RSS (``VmHWM``) minus the RSS before the call is
the peak extra memory (the helpers of ``attention_speed.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import prefer_passive_wait_policy, time_in_turns  # noqa: E402

prefer_passive_wait_policy()  # before torch starts OpenMP (see _timing.py)

import torch  # noqa: E402
from _results import (  # noqa: E402
    add_output_arguments,
    output_folder,
    pyplot,
    run_conditions,
    write_results,
)
from attention_speed import peak_extra_rss  # noqa: E402

import efficient_attention as ea  # noqa: E402

THREADS = 2
HEADS = 8
HEAD_DIM = 64
NAIVE_MAX_N = 4096
TARGET_N = 8192
FORWARD_LIMIT = 1.5
GROWTH_LIMIT = 2.5
CASES = ("forward", "forward_causal", "training_step", "training_step_causal")
MEMORY_CASES = ("forward", "training_step_causal")
FULL = {"time": [1024, 2048, 4096, 8192], "memory": [1024, 2048, 4096, 8192, 16384],
        "sweep_n": 8192, "repeats": 5}
QUICK = {"time": [128, 256], "memory": [512], "sweep_n": 256, "repeats": 2}
SWEEP = [(64, 512), (128, 256), (128, 512), (256, 256), (256, 512), (512, 256), (512, 512),
         (1024, 512), (256, 1024), (256, 8192)]  # the last: one key tile spans all of n
QUICK_SWEEP = [(128, 128), (512, 512)]  # the default must be in the sweep


def make_inputs(n: int, grad: bool = False) -> dict[str, torch.Tensor]:
    """Seeded ``q, k, v`` and an output gradient ``g``, all ``(1, 8, n, 64)``."""
    gen = torch.Generator().manual_seed(n)
    x = {name: torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) for name in "qkvg"}
    for name in "qkv":
        x[name].requires_grad_(grad)
    return x


def sdpa(x, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"],
                                                            is_causal=causal)


def tiled(x, causal=False, block_size=None):
    return ea.tiled_attention(x["q"], x["k"], x["v"], causal=causal, block_size=block_size)


def naive(x, causal=False):
    return ea.softmax_attention(x["q"], x["k"], x["v"], causal=causal)


METHODS = {"SDPA": sdpa, "tiled": tiled, "naive": naive}


def call(method, case: str, x: dict) -> None:
    """One forward, or one training step (forward and backward of ``(out * g).sum()``)."""
    causal = case.endswith("causal")
    if case.startswith("forward"):
        with torch.inference_mode():
            method(x, causal=causal)
        return
    for name in "qkv":
        x[name].grad = None
    (method(x, causal=causal) * x["g"]).sum().backward()


def methods_at(n: int) -> dict:
    return {name: fn for name, fn in METHODS.items() if name != "naive" or n <= NAIVE_MAX_N}


def time_turns(calls: dict, repeats: int) -> dict:
    """Median time (ms) of each zero-argument call, the calls taking turns after a warm-up
    (``_timing.time_in_turns``), as ``{name: {"median_ms", "times_ms"}}``."""
    return {name: timing.summary("ms") for name, timing in time_in_turns(calls, repeats).items()}


def time_case(n: int, case: str, repeats: int) -> dict:
    x = make_inputs(n, grad=case.startswith("training"))
    calls = {name: (lambda fn=fn: call(fn, case, x)) for name, fn in methods_at(n).items()}
    return time_turns(calls, repeats)


def tile_sweep(n: int, block_sizes: list, repeats: int) -> dict:
    x = make_inputs(n)
    calls = {"SDPA": lambda: call(sdpa, "forward", x)}
    for size in block_sizes:
        calls[size] = lambda size=size: call(
            lambda x, causal: tiled(x, causal, block_size=size), "forward", x)
    result = time_turns(calls, repeats)
    sdpa_ms = result["SDPA"]["median_ms"]
    medians = [result[size]["median_ms"] for size in block_sizes]
    return {"n": n, "block_sizes": [list(size) for size in block_sizes], "median_ms": medians,
            "tiled_over_sdpa": [m / sdpa_ms for m in medians], "sdpa_median_ms": sdpa_ms,
            "fastest": list(block_sizes[medians.index(min(medians))]),
            "default": list(ea.DEFAULT_BLOCK_SIZE)}


def memory_probe(n: int, case: str, names: list[str]) -> None:
    """Subprocess entry: print the peak extra RSS (bytes) of one call of each method."""
    torch.set_num_threads(THREADS)
    small = make_inputs(64, grad=case.startswith("training"))
    for name in names:
        call(METHODS[name], case, small)  # load kernels and libraries first
    x = make_inputs(n, grad=case.startswith("training"))
    extra = {}
    for name in names:
        extra[name] = peak_extra_rss(functools.partial(call, METHODS[name], case, x),
                                     (x["q"], x["k"], x["v"]))
    print(json.dumps(extra))


def measure_memory(n: int, case: str) -> dict:
    names = list(methods_at(n))
    command = [sys.executable, __file__, "--memory-probe", str(n), case, *names]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe n={n} {case} failed:\n{done.stderr[-2000:]}")
    extra = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: value / 2**20 for name, value in extra.items()}


def compute_ratios(row: dict) -> dict:
    out = {}
    for case, entries in row.items():
        for name in ("tiled", "naive"):
            if name in entries and "SDPA" in entries:
                out[f"{case} {name} / SDPA"] = (entries[name]["median_ms"]
                                                / entries["SDPA"]["median_ms"])
    return out


def check_targets(report: dict) -> dict:
    targets = {}
    forward = report["ratios"].get(str(TARGET_N), {}).get("forward tiled / SDPA")
    if forward is not None:
        targets[f"forward tiled / SDPA at n = {TARGET_N}"] = (forward, FORWARD_LIMIT)
    memory = report["memory_mib"]
    big, small = str(2 * TARGET_N), str(TARGET_N)
    if big in memory and small in memory:
        for case in MEMORY_CASES:
            growth = memory[big][case]["tiled"] / max(memory[small][case]["tiled"], 1e-9)
            targets[f"{case} tiled memory growth {big} / {small}"] = (growth, GROWTH_LIMIT)
    return {label: {"measured": value, "limit": limit, "met": value <= limit}
            for label, (value, limit) in targets.items()}


def markdown(report: dict) -> str:
    """The tables of ``tiled_attention.md``."""
    cond = report["conditions"]
    lines = ["# Tiled exact attention against fused SDPA", ""]
    if report["preliminary"]:
        lines += ["**PRELIMINARY: measured on a shared, busy machine; rerun on an idle one "
                  "(`.venv/bin/python benchmarks/tiled_attention.py`).**", ""]
    lines += [f"q, k, v (1, 8, n, 64) float32, {THREADS} threads, tiles "
              f"{tuple(report['setting']['block_size'])} (queries, keys). torch "
              f"{cond['torch']}; load average at start / end: {cond['load_average_start']} / "
              f"{cond['load_average_end']}.", "", "## Median time (ms)", "",
              "| n | case | SDPA | tiled | naive | tiled / SDPA |", "|---|---|---|---|---|---|"]
    for n, row in report["time"].items():
        for case, entries in row.items():
            cells = [f"{entries[m]['median_ms']:.1f}" if m in entries else "-"
                     for m in ("SDPA", "tiled", "naive")]
            ratio = report["ratios"][n].get(f"{case} tiled / SDPA")
            lines.append(f"| {n} | {case} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    lines += ["", "## Peak extra memory of one call (MiB)", "",
              "| n | case | SDPA | tiled | naive | one n x n (all heads) |",
              "|---|---|---|---|---|---|"]
    for n, row in report["memory_mib"].items():
        for case, entries in row.items():
            cells = [f"{entries[m]:.1f}" if m in entries else "-"
                     for m in ("SDPA", "tiled", "naive")]
            lines.append(f"| {n} | {case} | " + " | ".join(cells)
                         + f" | {report['nxn_mib'][n]:.0f} |")
    sweep = report["tile_sweep"]
    lines += ["", f"## Tile shapes, forward at n = {sweep['n']} (SDPA "
              f"{sweep['sdpa_median_ms']:.1f} ms)", "", "| block_q x block_k | ms | / SDPA |",
              "|---|---|---|"]
    for size, ms, ratio in zip(sweep["block_sizes"], sweep["median_ms"],
                               sweep["tiled_over_sdpa"], strict=True):
        lines.append(f"| {size[0]} x {size[1]} | {ms:.1f} | {ratio:.2f} |")
    if report["targets"]:
        lines += ["", "## Targets", "", "| quantity | measured | limit | met |",
                  "|---|---|---|---|"]
        for label, entry in report["targets"].items():
            lines.append(f"| {label} | {entry['measured']:.2f} | <= {entry['limit']} | "
                         f"{'yes' if entry['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict):
    """The figure of ``tiled_attention.png``: time, memory and the tile sweep."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {"SDPA": "-", "tiled": "--", "naive": ":"}
    for case, marker in (("forward", "o"), ("training_step_causal", "s")):
        for name, style in styles.items():
            points = [(int(n), row[case][name]["median_ms"])
                      for n, row in report["time"].items() if name in row[case]]
            if points:
                xs, ys = zip(*points, strict=True)
                axes[0].loglog(xs, ys, style, marker=marker, label=f"{name}, {case}")
            points = [(int(n), row[case][name]) for n, row in report["memory_mib"].items()
                      if name in row[case]]
            if points:
                xs, ys = zip(*points, strict=True)
                axes[1].loglog(xs, ys, style, marker=marker, label=f"{name}, {case}")
    xs = [int(n) for n in report["nxn_mib"]]
    axes[1].loglog(xs, list(report["nxn_mib"].values()), color="grey", lw=0.8,
                   label="one n x n matrix (8 heads)")
    axes[0].set(xlabel="n", ylabel="median time (ms)", title="time")
    axes[1].set(xlabel="n", ylabel="peak extra memory (MiB)", title="memory")
    sweep = report["tile_sweep"]
    labels = [f"{a}x{b}" for a, b in sweep["block_sizes"]]
    axes[2].bar(labels, sweep["tiled_over_sdpa"])
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set(xlabel="block_q x block_k", ylabel="tiled / SDPA time",
                title=f"tile shape, forward at n = {sweep['n']}")
    axes[2].tick_params(axis="x", rotation=45)
    for ax in axes[:2]:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the results preliminary whatever the load")
    parser.add_argument("--memory-probe", nargs="+", help=argparse.SUPPRESS)  # N CASE NAME...
    args = parser.parse_args(argv)
    if args.memory_probe:
        memory_probe(int(args.memory_probe[0]), args.memory_probe[1], args.memory_probe[2:])
        return
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(THREADS)
    plan = QUICK if args.quick else FULL
    conditions = run_conditions()
    report = {
        "preliminary": bool(args.preliminary or conditions["load_average_start"][0] > 1.0),
        "quick": args.quick,
        "conditions": conditions,
        "setting": {"shape": [1, HEADS, "n", HEAD_DIM], "dtype": "float32",
                    "threads": THREADS, "block_size": list(ea.DEFAULT_BLOCK_SIZE),
                    "repeats": plan["repeats"], "time_sizes": plan["time"],
                    "memory_sizes": plan["memory"]},
    }
    print(f"tile sweep at n = {plan['sweep_n']} ...", flush=True)
    report["tile_sweep"] = tile_sweep(plan["sweep_n"], QUICK_SWEEP if args.quick else SWEEP,
                                      plan["repeats"])
    report["time"], report["ratios"] = {}, {}
    for n in plan["time"]:
        row = {case: time_case(n, case, plan["repeats"]) for case in CASES}
        report["time"][str(n)] = row
        report["ratios"][str(n)] = compute_ratios(row)
        print(f"n = {n}: " + ", ".join(f"{label} {value:.2f}" for label, value
                                       in report["ratios"][str(n)].items()), flush=True)
    report["memory_mib"], report["nxn_mib"] = {}, {}
    for n in plan["memory"]:
        report["memory_mib"][str(n)] = {case: measure_memory(n, case) for case in MEMORY_CASES}
        report["nxn_mib"][str(n)] = HEADS * n * n * 4 / 2**20
        print(f"n = {n}: memory (MiB) {report['memory_mib'][str(n)]}", flush=True)
    report["targets"] = check_targets(report)
    report["conditions"].update(run_conditions(end=True))
    for label, entry in report["targets"].items():
        print(f"target {label}: {entry['measured']:.2f} (<= {entry['limit']}): "
              f"{'met' if entry['met'] else 'MISSED'}")
    write_results("tiled_attention", report, out=out, markdown=markdown(report),
                  figure=plot(report), dpi=110)
    print(f"wrote {out}/tiled_attention.{{json,md,png}}")


if __name__ == "__main__":
    main()
