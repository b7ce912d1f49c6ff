"""Ring attention on 1, 2 and 4 gloo processes against single-process tiled attention (and
torch's own context parallelism): time, peak memory per rank and bytes sent per rank.

Run from the repository root::

    .venv/bin/python benchmarks/ring_speed.py          # full run (tens of minutes, loaded)
    .venv/bin/python benchmarks/ring_speed.py --quick  # smoke test, small n, seconds

Setting: the whole sequence ``q, k, v`` of shape ``(1, 8, n, 64)`` float32 (bidirectional
attention), CPU. Configurations, each in processes started by
``efficient_attention.distributed.run_on_processes`` (gloo, forked):

- ``tiled``: ``ea.tiled_attention(q, k, v)`` on the whole sequence in one process with 2
  threads (the baseline);
- ``ring p=1``: ``cp.ring_attention`` in a group of one (the same process as ``tiled``);
- ``ring p=2``, ``ring p=4``: ``cp.ring_attention`` on 2 and 4 processes, each holding the
  contiguous shard of ``n / p`` tokens (``cp.shard_sequence``), 1 thread each (the machine
  has 2 cores: p = 4 is oversubscribed, and no p can be faster than the 2 threads of
  ``tiled`` here: the times show the overhead, not a speed-up);
- ``torch context_parallel p=2``, ``p=4`` (full run, at ``CP_N`` only):
  ``torch.distributed.tensor.experimental.context_parallel`` around
  ``F.scaled_dot_product_attention`` on 4-D shards, what torch does with it on CPU (the
  result of trying it is recorded: see ``context_parallel`` in the JSON).

Two workloads: ``forward`` (one call under ``torch.inference_mode``) and ``train`` (forward
and backward of a fixed random output gradient). Time: each run warms every call up and times
it once (``_timing.time_in_turns``, the calls of a run taking turns); the whole set of runs
is repeated ``passes`` times (p = 1, 2, 4, one after the other), so that every configuration
has one sample per pass. A sample of a multi-process configuration is the slowest rank's time.
Ratios (``_timing.paired_ratio``) pair the samples of the same pass (median over passes of
the ratio of the two samples of one pass), which keeps the machine's drift out of them.

Memory per rank (first pass, after the timed calls): ``inputs`` (the rank's q, k, v, and the
output gradient in ``train``), ``rss_extra`` (peak resident memory during one call minus the
resident memory before it, after ``malloc_trim`` and a reset of the kernel's peak mark: the
probe of ``attention_speed.py``; it includes gloo's buffers; glibc's mmap threshold is held
at 128 KiB while memory is measured, see ``map_large_blocks``: with its default, freed blocks
stayed in the heap and moved the excess by 20-40 MiB from one n to the next; the smallest of
``RSS_REPEATS`` calls, as a single call now and then peaked 10-20 MiB higher) and ``tensor_extra``
(``ea.TensorMemoryTracker``: the tensors made during one call). ``peak`` = inputs + extra.
Bytes sent per rank: ``cp.CommunicationLog`` of one call, with the closed form
``cp.ring_communication_bytes`` beside it.

Acceptance: the peak memory per rank at p = 2 and 4 is at most 1/p of the single-process
tiled run plus a constant. ``targets`` reports, per p and workload, the excess
``peak(p) - peak(tiled) / p`` at every n and its slope ``d peak(p) / d (peak(tiled) / p)``
from the smallest to the largest n (1: exactly 1/p plus a constant; met when at most
``SLOPE_LIMIT``).

Writes ``ring_speed.json``, ``.md`` and ``.png`` (``benchmarks/results/`` or ``--out``).
JSON keys (``<n>`` a length as a string, ``<config>`` as above, ``<workload>`` ``forward``
or ``train``)::

    benchmark, preliminary, quick, conditions   as in the other scripts
    setting      shape, dtype, sizes, passes, world_sizes, threads_per_rank, layout, cp_n
    time         {<n>: {<config>: {<workload>: {"median_ms", "times_ms"}}}}
    ratios       {<n>: {<workload>: {"<config> / tiled": float, ...}}}
    memory_mib   {<n>: {<config>: {<workload>: {"inputs", "rss_extra", "tensor_extra",
                 "rss_peak", "tensor_peak"} (max over ranks, MiB)}}}
    bytes_sent   {<n>: {<config>: {"forward", "train", "formula_forward",
                 "formula_train"} (per rank, max over ranks)}}
    context_parallel  {"status", "forward", "train", "rotate_method", "collectives",
                 "note"}: what torch's context parallelism did (tried live)
    targets      {"ring p=<p> peak per rank <= tiled / p + constant (<kind>, <workload>)":
                 {"excess_mib": {<n>: MiB}, "slope", "limit", "met"}}
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Timing, paired_ratio, prefer_passive_wait_policy, time_in_turns  # noqa: E402

prefer_passive_wait_policy()  # before torch starts OpenMP (see _timing.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _results import (  # noqa: E402
    add_output_arguments,
    output_folder,
    pyplot,
    run_conditions,
    write_results,
)
from attention_speed import peak_extra_rss, release_free_memory, run_once  # noqa: E402

import efficient_attention as ea  # noqa: E402
from efficient_attention import distributed as cp  # noqa: E402

CORES = 2
HEADS = 8
HEAD_DIM = 64
WORKLOADS = ("forward", "train")
WORLD_SIZES = (1, 2, 4)
LAYOUT = "contiguous"
FULL = {"sizes": [2048, 4096, 8192], "passes": 3, "cp_n": 8192}
QUICK = {"sizes": [128, 256], "passes": 2, "cp_n": None}
PIECE = ea.DEFAULT_BLOCK_SIZE[1]  # keys per message of cp.ring_attention (its default)
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, held fixed while memory is measured
RSS_REPEATS = 3  # the RSS probe's noise only adds (a call's first touch, gloo): the minimum
SLOPE_LIMIT = 1.1  # d peak(p) / d (peak(tiled) / p) between the smallest and largest n
TIMEOUT_S = 3600.0
MIB = 2**20


def threads_per_rank(world_size: int) -> int:
    return max(1, CORES // world_size)


def whole_sequence(n: int) -> list[torch.Tensor]:
    """``q, k, v`` and the output gradient, ``(1, 8, n, 64)``, the same on every rank."""
    g = torch.Generator().manual_seed(n)
    return [torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(4)]


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """glibc only: serve every allocation of ``threshold`` bytes or more by its own mapping,
    unmapped when freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc from raising
    the threshold to the largest block freed so far). Resident memory then follows the live
    buffers instead of what the heap keeps of freed ones. Returns whether it applied."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc
        return False


def measure_tensors(call) -> int:
    with ea.TensorMemoryTracker() as tracker:
        call()
    return tracker.peak


def rank_main(n: int, with_tiled: bool, measure: bool) -> dict:
    """Run on every rank: time ring attention (and, on one process, tiled attention) forward
    and in a training step; on ``measure``, then the memory and bytes of one call of each."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = whole_sequence(n)
    shards = [cp.shard_sequence(t, rank, world_size, LAYOUT).clone() for t in whole]
    x = {name: t.requires_grad_(name != "grad_out") for name, t in
         zip(("q", "k", "v", "grad_out"), shards, strict=True)}
    configs = {f"ring p={world_size}": lambda x, log=None: cp.ring_attention(
        x["q"], x["k"], x["v"], layout=LAYOUT, log=log)}
    xs = {f"ring p={world_size}": x}
    if with_tiled:  # world_size 1: the shard is the whole sequence
        configs["tiled"] = lambda x, log=None: ea.tiled_attention(x["q"], x["k"], x["v"])
        xs["tiled"] = {name: t.detach().clone().requires_grad_(t.requires_grad)
                       for name, t in x.items()}
    del whole, shards
    calls = {(config, workload): functools.partial(run_once, workload, method, xs[config])
             for workload in WORKLOADS for config, method in configs.items()}
    timings = time_in_turns(calls, 1, fewer_rounds_when_slow=False)
    result = {"rank": rank, "world_size": world_size,
              "times": {key: (t.warm_up_s, t.times_s) for key, t in timings.items()}}
    if not measure:
        return result
    memory, sent = {}, {}
    result["large_blocks_mapped"] = map_large_blocks()  # after the timings, which keep glibc's
    for config, method in configs.items():                # default
        for workload in WORKLOADS:
            held = [xs[config][name] for name in ("q", "k", "v")]
            if workload == "train":
                held.append(xs[config]["grad_out"])
            log = cp.CommunicationLog()  # the bytes of the first of these two calls
            rss = [peak_extra_rss(functools.partial(run_once, workload,
                                                    functools.partial(method, log=log),
                                                    xs[config]), xs[config].values())]
            rss += [peak_extra_rss(functools.partial(run_once, workload, method, xs[config]),
                                   xs[config].values()) for _ in range(RSS_REPEATS - 1)]
            tensors = measure_tensors(functools.partial(run_once, workload, method, xs[config]))
            memory[config, workload] = {"inputs": tensor_bytes(*held), "rss_extra": min(rss),
                                        "rss_extra_samples": rss, "tensor_extra": tensors}
            sent[config, workload] = log.total_bytes
    result["memory"], result["bytes"] = memory, sent
    return result


def context_parallel_main(n: int, repeats: int, measure: bool) -> dict:
    """Run on every rank: torch's ``context_parallel`` around SDPA on this rank's shard
    (buffers sharded in place by torch), forward timed; the training step tried."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import context_parallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v, _ = whole_sequence(n)
    out: dict = {"rank": rank, "world_size": world_size}
    buffers = [q, k, v]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers=set(buffers)):
        release_free_memory()
        x = {"q": q, "k": k, "v": v}

        def method(x):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"])

        def forward():  # no_grad rather than inference_mode: DTensors are made inside
            with torch.no_grad():
                method(x)

        start = time.perf_counter()
        forward()  # the first call per shape: DTensor's sharding propagation
        out["first_call_s"] = time.perf_counter() - start
        timing = time_in_turns({"forward": forward}, repeats,
                               fewer_rounds_when_slow=False)["forward"]
        out["times"] = (timing.warm_up_s, timing.times_s)
        if measure:
            with CommDebugMode() as comm:
                forward()
            out["collectives"] = {str(op): count for op, count in comm.get_comm_counts().items()}
            out["memory"] = {"inputs": tensor_bytes(q, k, v), "rss_extra": peak_extra_rss(forward)}
        leaves = {name: t.detach().clone().requires_grad_() for name, t in x.items()}
        leaves["grad_out"] = torch.ones_like(q)
        try:
            run_once("train", method, leaves)
            out["train"] = "runs"
        except Exception as exc:  # noqa: BLE001  (recorded)
            out["train"] = f"fails: {type(exc).__name__}: {exc}".splitlines()[0]
    return out


# --- the runs ---------------------------------------------------------------------------------

def run_pass(n: int, index: int, measure: bool) -> dict:
    """One pass at ``n``: ring on 1 (with tiled), 2 and 4 processes, one after the other."""
    ranks = {}
    for p in WORLD_SIZES:
        print(f"  pass {index}, p = {p} ...", flush=True)
        ranks[p] = cp.run_on_processes(rank_main, p, (n, p == 1, measure),
                                       threads=threads_per_rank(p), timeout_s=TIMEOUT_S)
    return ranks


def config_names() -> list[str]:
    return ["tiled", *(f"ring p={p}" for p in WORLD_SIZES)]


def collect(passes: list[dict]) -> tuple[dict, dict[tuple, Timing]]:
    """Per (config, workload) a ``Timing`` whose sample of pass ``i`` (round ``i``) is the
    slowest rank's time; and its summary."""
    timings = {}
    for config in config_names():
        for workload in WORKLOADS:
            warm, samples = [], []
            for ranks in passes:
                results = [r for rs in ranks.values() for r in rs
                           if (config, workload) in r["times"]]
                warm.append(max(r["times"][config, workload][0] for r in results))
                samples.append(max(r["times"][config, workload][1][0] for r in results))
            timings[config, workload] = Timing(max(warm), tuple(samples),
                                               tuple(range(len(samples))))
    summary: dict = {}
    for (config, workload), timing in timings.items():
        summary.setdefault(config, {})[workload] = timing.summary("ms")
    return summary, timings


def compute_ratios(timings: dict) -> dict:
    out = {}
    for workload in WORKLOADS:
        base = timings["tiled", workload]
        row = {f"{config} / tiled": paired_ratio(timings[config, workload], base)
               for config in config_names() if config != "tiled"}
        for p in WORLD_SIZES[1:]:
            row[f"ring p={p} / ring p=1"] = paired_ratio(timings[f"ring p={p}", workload],
                                                         timings["ring p=1", workload])
        out[workload] = row
    return out


def memory_and_bytes(first_pass: dict, n: int) -> tuple[dict, dict]:
    """Max over ranks (MiB) of each memory quantity, and bytes sent per rank."""
    memory, sent = {}, {}
    for p, results in first_pass.items():
        configs = ["tiled", f"ring p={p}"] if p == 1 else [f"ring p={p}"]
        for config in configs:
            for workload in WORKLOADS:
                per_rank = [r["memory"][config, workload] for r in results]
                entry = {key: max(m[key] for m in per_rank) / MIB
                         for key in ("inputs", "rss_extra", "tensor_extra")}
                entry["rss_peak"] = max(m["inputs"] + m["rss_extra"] for m in per_rank) / MIB
                entry["tensor_peak"] = max(m["inputs"] + m["tensor_extra"]
                                           for m in per_rank) / MIB
                memory.setdefault(config, {})[workload] = entry
            if config.startswith("ring"):
                forward, backward = cp.ring_communication_bytes(
                    batch=HEADS, keys_per_rank=n // p, d=HEAD_DIM, d_v=HEAD_DIM, world_size=p,
                    dtype=torch.float32)
                sent[config] = {"forward": max(r["bytes"][config, "forward"] for r in results),
                                "train": max(r["bytes"][config, "train"] for r in results),
                                "formula_forward": forward,
                                "formula_train": forward + backward}
    return memory, sent


def run_context_parallel(n: int, repeats: int) -> dict:
    """torch's context parallelism at ``n`` on 2 and 4 processes: what happened, the forward
    times, collectives, memory; the training step's outcome."""
    out: dict = {"n": n, "runs": {}}
    for p in WORLD_SIZES[1:]:
        print(f"  torch context_parallel, p = {p} ...", flush=True)
        try:
            ranks = cp.run_on_processes(context_parallel_main, p, (n, repeats, True),
                                        threads=threads_per_rank(p), timeout_s=TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (recorded)
            out["runs"][f"p={p}"] = {"status": f"fails: {type(exc).__name__}: "
                                     f"{str(exc).strip().splitlines()[-1]}"}
            traceback.print_exc()
            continue
        times = [r["times"][1] for r in ranks]
        samples = tuple(max(ts) for ts in zip(*times, strict=True))
        timing = Timing(max(r["times"][0] for r in ranks), samples, tuple(range(len(samples))))
        shard = HEADS * (n // p) * HEAD_DIM * 4
        gathers = sum(count for op, count in ranks[0]["collectives"].items()
                      if "all_gather" in op)
        out["runs"][f"p={p}"] = {
            "status": "runs",
            "forward": timing.summary("ms"),
            "first_call_s": max(r["first_call_s"] for r in ranks),
            "train": ranks[0]["train"],
            "collectives": ranks[0]["collectives"],
            "bytes_sent_estimate": gathers * (p - 1) * shard,
            "memory_mib": {
                "inputs": max(r["memory"]["inputs"] for r in ranks) / MIB,
                "rss_extra": max(r["memory"]["rss_extra"] for r in ranks) / MIB,
                "rss_peak": max(r["memory"]["inputs"] + r["memory"]["rss_extra"]
                                for r in ranks) / MIB}}
    return out


def check_targets(report: dict) -> dict:
    """Per p in (2, 4), memory kind and workload: the excess of the per-rank peak over
    ``tiled / p`` at every n, and its slope from the smallest to the largest n."""
    sizes = [str(n) for n in report["setting"]["sizes"]]
    targets = {}
    for p in WORLD_SIZES[1:]:
        for kind in ("rss_peak", "tensor_peak"):
            for workload in WORKLOADS:
                tiled = {n: report["memory_mib"][n]["tiled"][workload][kind] / p for n in sizes}
                ring = {n: report["memory_mib"][n][f"ring p={p}"][workload][kind] for n in sizes}
                excess = {n: ring[n] - tiled[n] for n in sizes}
                first, last = sizes[0], sizes[-1]
                slope = None
                if len(sizes) > 1 and tiled[last] != tiled[first]:
                    slope = (ring[last] - ring[first]) / (tiled[last] - tiled[first])
                label = (f"ring p={p} peak per rank <= tiled / p + constant "
                         f"({kind.replace('_peak', '')}, {workload})")
                # the excess in pieces of keys (or values) the ring sends, PIECE x h x d
                # floats: a constant number of them as n grows is the target's constant
                pieces = {n: excess[n] / (PIECE * HEADS * HEAD_DIM * 4 / MIB) for n in sizes}
                targets[label] = {"excess_mib": excess, "ratio_to_tiled_over_p": {
                    n: ring[n] / tiled[n] for n in sizes}, "slope": slope,
                    "excess_in_pieces": pieces,
                    "limit": SLOPE_LIMIT, "met": slope is not None and slope <= SLOPE_LIMIT}
    return targets


# --- report -----------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    cond, setting = report["conditions"], report["setting"]
    sizes = [str(n) for n in setting["sizes"]]
    lines = ["# Ring attention on gloo processes against single-process tiled attention", ""]
    if report["preliminary"]:
        lines += ["**PRELIMINARY: measured on a shared, loaded 2-core CPU machine (load average "
                  f"{cond['load_average_start']} at the start, {cond.get('load_average_end')} "
                  "at the end); no GPU was available. Compare ratios, not absolute times; rerun "
                  "on an idle machine (`.venv/bin/python benchmarks/ring_speed.py`).**", ""]
    lines += [f"Whole sequence q, k, v (1, {HEADS}, n, {HEAD_DIM}) float32, bidirectional, "
              f"{setting['layout']} shards; threads per rank: "
              + ", ".join(f"p = {p}: {t}" for p, t in setting["threads_per_rank"].items())
              + f" (the machine has {CORES} cores). {setting['passes']} passes; a sample of a "
              f"multi-process run is its slowest rank. torch {cond['torch']}. Memory per rank "
              "is measured after the timings, with glibc's mmap threshold held at "
              f"{setting.get('rss_mmap_threshold', 0) // 1024} KiB (`map_large_blocks`), so "
              "that the resident set follows the live buffers. Each rank sends its block in "
              f"pieces of {setting.get('piece', '?')} keys.", ""]
    if report["targets"]:
        lines += ["## Target: peak memory per rank at most 1/p of single-process tiled plus a "
                  "constant", "",
                  "excess = peak per rank - peak(tiled) / p (MiB) at each n; slope = d peak(p) "
                  "/ d (peak(tiled) / p) from the smallest to the largest n (1: 1/p plus a "
                  f"constant; met when <= {SLOPE_LIMIT}).", "",
                  f"The excess is also given in pieces ({PIECE} keys x h x d float32 numbers, "
                  "what the ring sends in one message): beyond tiled / p a rank holds the "
                  "piece of keys and values it computes on and the one arriving, a tile's "
                  "partial output and scores, and in the backward the pieces' dK, dV "
                  "accumulators, a number of pieces that does not depend on n.", "",
                  "| quantity | " + " | ".join(f"excess n={n} (pieces)" for n in sizes) +
                  " | peak / (tiled / p) at largest n | slope | met |",
                  "|---" * (len(sizes) + 4) + "|"]
        for label, entry in report["targets"].items():
            cells = [f"{entry['excess_mib'][n]:.1f} ({entry['excess_in_pieces'][n]:.1f})"
                     for n in sizes]
            slope = "-" if entry["slope"] is None else f"{entry['slope']:.3f}"
            lines.append(f"| {label} | " + " | ".join(cells) +
                         f" | {entry['ratio_to_tiled_over_p'][sizes[-1]]:.2f} | {slope} | "
                         f"{'yes' if entry['met'] else 'NO'} |")
        lines.append("")
    for workload in WORKLOADS:
        lines += [f"## Median time, {workload} (ms)", "",
                  "| config | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for config in config_names():
            cells = [f"{report['time'][n][config][workload]['median_ms']:.1f}" for n in sizes]
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
        labels = list(report["ratios"][sizes[0]][workload])
        lines += ["", f"## Ratios of times, {workload} (paired by pass)", "",
                  "| ratio | " + " | ".join(sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for label in labels:
            cells = [f"{report['ratios'][n][workload][label]:.3f}" for n in sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", f"## Memory per rank, {workload} (MiB, max over ranks)", "",
                  "| n | config | inputs | extra (RSS) | peak (RSS) | extra (tensors) | "
                  "peak (tensors) |", "|---|---|---|---|---|---|---|"]
        for n in sizes:
            for config in config_names():
                m = report["memory_mib"][n][config][workload]
                lines.append(f"| {n} | {config} | {m['inputs']:.1f} | {m['rss_extra']:.1f} | "
                             f"{m['rss_peak']:.1f} | {m['tensor_extra']:.1f} | "
                             f"{m['tensor_peak']:.1f} |")
        lines.append("")
    lines += ["## Bytes sent per rank (CommunicationLog, one call)", "",
              "| n | config | forward | training step | formula forward | formula training "
              "step |", "|---|---|---|---|---|---|"]
    for n in sizes:
        for config, entry in report["bytes_sent"][n].items():
            lines.append(f"| {n} | {config} | {entry['forward']} | {entry['train']} | "
                         f"{entry['formula_forward']} | {entry['formula_train']} |")
    lines += ["", "## torch context parallelism (tried live)", ""]
    tcp = report["context_parallel"]
    lines.append(f"- {tcp['note']}")
    for p, run in tcp.get("runs", {}).items():
        if run["status"] != "runs":
            lines.append(f"- {p}, n = {tcp['n']}: {run['status']}")
            continue
        mem = run["memory_mib"]
        lines.append(
            f"- {p}, n = {tcp['n']}: forward {run['forward']['median_ms']:.1f} ms (first call "
            f"{run['first_call_s']:.0f} s: DTensor's sharding propagation); collectives per "
            f"forward {run['collectives']}; about {run['bytes_sent_estimate']} bytes sent per "
            f"rank; memory per rank: inputs {mem['inputs']:.1f} MiB, extra (RSS) "
            f"{mem['rss_extra']:.1f} MiB, peak {mem['rss_peak']:.1f} MiB; training step: "
            f"{run['train']}")
    return "\n".join(lines) + "\n"


def plot(report: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    sizes = [str(n) for n in report["setting"]["sizes"]]
    xs = [int(n) for n in sizes]
    for ax, workload in zip(axes[:2], WORKLOADS, strict=True):
        for config in config_names():
            ys = [report["time"][n][config][workload]["median_ms"] for n in sizes]
            ax.loglog(xs, ys, "--" if config == "tiled" else "-", marker="o", ms=3, label=config)
        ax.set(xlabel="sequence length n", ylabel="median time (ms), slowest rank",
               title=f"{workload}, (1, {HEADS}, n, {HEAD_DIM}), {CORES} cores in all")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    for i, config in enumerate(config_names()):
        ys = [report["memory_mib"][n][config]["train"]["rss_peak"] for n in sizes]
        ax.loglog(xs, ys, "--" if config == "tiled" else "-", marker="o", ms=3, color=f"C{i}",
                  label=f"{config} (RSS)")
        ys = [report["memory_mib"][n][config]["train"]["tensor_peak"] for n in sizes]
        ax.loglog(xs, ys, ":", marker="x", ms=3, color=f"C{i}", label=f"{config} (tensors)")
    for p in WORLD_SIZES[1:]:
        ys = [report["memory_mib"][n]["tiled"]["train"]["rss_peak"] / p for n in sizes]
        ax.loglog(xs, ys, color="grey", lw=0.8, ls="-." if p == 2 else "--",
                  label=f"tiled (RSS) / {p}")
    ax.set(xlabel="sequence length n", ylabel="peak memory per rank (MiB)",
           title="training step: inputs + peak extra, per rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


CP_NOTE = (
    "torch.distributed.tensor.experimental.context_parallel patches "
    "F.scaled_dot_product_attention and turns the shards into DTensors; its ring "
    "implementations are registered only for the CUDA SDPA kernels (flash, efficient, cudnn). "
    "On CPU, SDPA reaches aten._scaled_dot_product_flash_attention_for_cpu, which DTensor "
    "handles by sharding propagation through its decomposition: it all-gathers the keys and "
    "values (the collectives below) and attends locally, so each rank holds all n keys and "
    "values, not a ring's n/p.")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--passes", type=int, help="passes over the configurations")
    parser.add_argument("--no-context-parallel", action="store_true",
                        help="do not try torch's context_parallel")
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the results preliminary whatever the load")
    args = parser.parse_args(argv)
    out = output_folder(args.quick, args.out)
    plan = dict(QUICK if args.quick else FULL)
    if args.sizes:
        plan["sizes"] = args.sizes
    if args.passes:
        plan["passes"] = args.passes
    if args.no_context_parallel:
        plan["cp_n"] = None
    conditions = run_conditions()
    began = time.perf_counter()
    # Imported once here rather than in every forked rank: TensorMemoryTracker's first call
    # imports torch._dynamo (seconds), and context_parallel needs it too.
    import torch._dynamo  # noqa: F401
    report = {
        "benchmark": "ring_speed",
        "preliminary": bool(args.preliminary or (conditions["load_average_start"] or [0])[0]
                            > 1.0),
        "quick": args.quick,
        "conditions": conditions,
        "setting": {"shape": [1, HEADS, "n", HEAD_DIM], "dtype": "float32",
                    "sizes": plan["sizes"], "passes": plan["passes"],
                    "world_sizes": list(WORLD_SIZES),
                    "threads_per_rank": {str(p): threads_per_rank(p) for p in WORLD_SIZES},
                    "layout": LAYOUT, "causal": False, "cp_n": plan["cp_n"], "piece": PIECE,
                    "rss_mmap_threshold": MMAP_THRESHOLD,
                    "slope_limit": SLOPE_LIMIT},
        "time": {}, "ratios": {}, "memory_mib": {}, "bytes_sent": {},
    }
    for n in plan["sizes"]:
        print(f"n = {n} ...", flush=True)
        passes = [run_pass(n, i, measure=i == 0) for i in range(plan["passes"])]
        key = str(n)
        report["time"][key], timings = collect(passes)
        report["ratios"][key] = compute_ratios(timings)
        report["memory_mib"][key], report["bytes_sent"][key] = memory_and_bytes(passes[0], n)
        for workload in WORKLOADS:
            print(f"  {workload}: " + ", ".join(
                f"{config} {report['time'][key][config][workload]['median_ms']:.0f} ms, peak "
                f"{report['memory_mib'][key][config][workload]['rss_peak']:.0f} MiB"
                for config in config_names()), flush=True)
    if plan["cp_n"] is None:
        report["context_parallel"] = {
            "note": ("not tried in this run (quick run or --no-context-parallel): its first "
                     "call per shape spends minutes in DTensor's sharding propagation here. "
                     + CP_NOTE)}
    else:
        print(f"torch context_parallel at n = {plan['cp_n']} ...", flush=True)
        report["context_parallel"] = {"note": CP_NOTE, **run_context_parallel(
            plan["cp_n"], plan["passes"])}
    report["targets"] = check_targets(report)
    report["conditions"].update(run_conditions(end=True))
    report["wall_s"] = time.perf_counter() - began
    for label, entry in report["targets"].items():
        slope = "-" if entry["slope"] is None else f"{entry['slope']:.3f}"
        print(f"target {label}: slope {slope} (<= {entry['limit']}): "
              f"{'met' if entry['met'] else 'MISSED'}; excess MiB "
              + ", ".join(f"{n}: {e:.1f}" for n, e in entry["excess_mib"].items()))
    written = write_results("ring_speed", report, out=out, markdown=markdown(report),
                            figure=plot(report))
    print(f"wrote {', '.join(str(p) for p in written.values())} in {report['wall_s']:.0f} s")
    return report


if __name__ == "__main__":
    main()
