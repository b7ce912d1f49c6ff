"""Forward time and peak extra memory of attention methods against the sequence length n.

Run from the repository root::

    .venv/bin/python benchmarks/attention_speed.py          # full run (a few minutes)
    .venv/bin/python benchmarks/attention_speed.py --quick  # small sizes, under a minute

Setting: batch x heads = 8, head dimension d = 64, float32, CPU, 2 threads, m = 256
random features. Methods: naive softmax attention (``ea.softmax_attention``, which
builds the n x n matrix), PyTorch's ``scaled_dot_product_attention`` (SDPA, fused),
linear attention (elu + 1), FAVOR+ (bidirectional and causal), the Nystrom and banded
approximations when the package has them, and the "floor": the two ``(n x m) @ (m x d)``
products every random-feature method must do, on ready-made features.

Time: median over several forward calls after one warm-up call, the methods of one n
taking turns (round robin), so that ratios compare calls made under the same load.
Memory: for each n a fresh subprocess warms every method up on a tiny input, allocates
the inputs, and then for each method in turn releases freed memory to the OS, resets
the kernel's peak-RSS mark, runs the method once and reads the peak resident set size
(VmHWM in /proc/self/status); peak minus the RSS just before the call is the peak extra
memory of that forward, as the operating system saw it.

Writes benchmarks/results/attention_speed.{json,md,png} (or the folder given by --out).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Threads that sleep while waiting (instead of spinning) keep a shared, oversubscribed
# machine from turning every parallel region into a wait for a descheduled thread.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import efficient_attention as ea  # noqa: E402

THREADS = 2
BATCH_HEADS = 8
HEAD_DIM = 64
NUM_FEATURES = 256
LANDMARKS = 64
BANDWIDTH = 32
QUADRATIC_LIMIT_BYTES = 8 * 2**30  # skip quadratic methods needing more than ~8 GB
SLOW_CALL_S = 60.0  # a method slower than this at one n is not run at larger n
FULL_SIZES = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_SIZES = [256, 512, 1024]
RESULTS = Path(__file__).resolve().parent / "results"


def make_inputs(n: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Seeded inputs for one n: q, k, v ``(8, n, 64)``, w ``(256, 64)`` and floor operands.

    ``packed`` adds ``[q | k | v]`` laid out for the public Nystrom package.
    """
    g = torch.Generator().manual_seed(n)
    shape = (BATCH_HEADS, n, HEAD_DIM)
    inputs = {
        "q": torch.randn(shape, generator=g),
        "k": torch.randn(shape, generator=g),
        "v": torch.randn(shape, generator=g),
        "w": ea.gaussian_random_matrix(NUM_FEATURES, HEAD_DIM, orthogonal=True, generator=g),
        "features": torch.rand(BATCH_HEADS, n, NUM_FEATURES, generator=g),
        "state": torch.randn(BATCH_HEADS, NUM_FEATURES, HEAD_DIM, generator=g),
    }
    if packed:
        inputs["packed"] = pack_heads(inputs)
    return inputs


QUADRATIC_BUFFERS = {  # n x n float32 buffers alive at the peak of one call
    "naive softmax": 3.0,  # scores, weights and one temporary (measured: 6.0 GiB at 8192)
    "SDPA": 2.25,  # PyTorch's CPU kernel for these shapes (measured: 4.5 GiB at 8192)
}


def quadratic_bytes(name: str, n: int) -> float:
    return QUADRATIC_BUFFERS.get(name, 0.0) * BATCH_HEADS * n * n * 4


def floor(x):
    """phi(K)^T V and phi(Q) S: the two products of size (n x m)(m x d)."""
    return x["features"].transpose(-2, -1) @ x["v"], x["features"] @ x["state"]


METHODS = {
    "naive softmax": lambda x: ea.softmax_attention(x["q"], x["k"], x["v"]),
    "SDPA": lambda x: torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"]),
    "linear (elu+1)": lambda x: ea.linear_attention(x["q"], x["k"], x["v"]),
    "FAVOR+": lambda x: ea.favor_attention(x["q"], x["k"], x["v"], x["w"]),
    "FAVOR+ causal": lambda x: ea.favor_attention(x["q"], x["k"], x["v"], x["w"], causal=True),
    "floor (2 matmuls)": floor,
}
PUBLIC_NYSTROM = "nystrom-attention pkg core (64)"
OPTIONAL = {  # written by other modules; included when the package has them
    "Nystrom (64 landmarks)": (
        "nystrom_attention",
        lambda fn, x: fn(x["q"], x["k"], x["v"], num_landmarks=LANDMARKS),
    ),
    "banded (w=32)": (
        "banded_attention",
        lambda fn, x: fn(x["q"], x["k"], x["v"], bandwidth=BANDWIDTH),
    ),
}


def public_nystrom_core():
    """The core of the public ``nystrom-attention`` package (lucidrains), if it is installed.

    Its ``NystromAttention`` module projects ``x`` to q, k, v, runs the Nystromformer core
    (segment-mean landmarks, three softmaxes, its iterative pseudo-inverse) and projects
    back. With ``to_qkv`` and ``to_out`` replaced by identities and no residual convolution,
    one call on the packed ``[q | k | v]`` of shape ``(1, n, 3 * heads * d)`` is the core
    alone: the same computation as ``ea.nystrom_attention`` with the same landmarks and
    iterations. Not a dependency of the project: install it in a scratch folder and put
    that folder on ``PYTHONPATH`` (see benchmarks/README.md).
    """
    try:
        from nystrom_attention import NystromAttention
    except ImportError:
        return None
    module = NystromAttention(dim=BATCH_HEADS * HEAD_DIM, dim_head=HEAD_DIM, heads=BATCH_HEADS,
                              num_landmarks=LANDMARKS, pinv_iterations=6, residual=False)
    module.to_qkv = torch.nn.Identity()
    module.to_out = torch.nn.Identity()
    return module.eval()


def pack_heads(x: dict) -> torch.Tensor:
    """``q, k, v (8, n, 64)`` as the package's input ``(1, n, 3 * 8 * 64)``, heads in order."""
    n = x["q"].shape[-2]
    return torch.cat([x[t].transpose(0, 1).reshape(1, n, -1) for t in "qkv"], dim=-1)


def available_methods() -> dict:
    methods = dict(METHODS)
    for name, (attribute, call) in OPTIONAL.items():
        fn = getattr(ea, attribute, None)
        if fn is None:
            print(f"note: ea.{attribute} is missing; '{name}' is not benchmarked")
            continue
        methods[name] = functools.partial(call, fn)  # x -> call(fn, x)
    public = public_nystrom_core()
    if public is not None:
        methods[PUBLIC_NYSTROM] = lambda x: public(x["packed"])
    return methods


def skip_reason(name: str, n: int) -> str | None:
    if quadratic_bytes(name, n) > QUADRATIC_LIMIT_BYTES:
        return f"needs ~{quadratic_bytes(name, n) / 2**30:.0f} GiB (> 8 GiB)"
    return None


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


def memory_probe(n: int, names: list[str]) -> None:
    """Subprocess entry: print the peak extra RSS of one forward of each method at ``n``.

    Writing 5 to /proc/self/clear_refs resets the kernel's peak-RSS mark (VmHWM) to the
    current RSS, so VmHWM after a call is the peak during that call. Between methods,
    freed memory is handed back to the OS, so that no method runs in memory a previous
    one left resident. (``ru_maxrss`` would not do: on Linux it keeps the parent's RSS
    across fork and exec, and it cannot be reset.)
    """
    torch.set_num_threads(THREADS)
    methods = available_methods()
    extra = {}
    with torch.inference_mode():
        for name in names:
            methods[name](make_inputs(64, PUBLIC_NYSTROM in names))  # load kernels, libraries
        inputs = make_inputs(n, PUBLIC_NYSTROM in names)
        for name in names:
            release_free_memory()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = status_bytes("VmRSS")
            out = methods[name](inputs)
            extra[name] = max(0, status_bytes("VmHWM") - before)
            del out
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


def measure_memory(n: int, names: list[str]) -> dict:
    """Peak extra MiB of one forward of each method at ``n``, from a fresh subprocess."""
    extra, error = run_probe(["--memory-probe", str(n), *names])
    if error is not None:
        return {name: {"error": error} for name in names}
    return {name: {"peak_extra_mib": value / 2**20} for name, value in extra.items()}


POLICY_METHODS = ["FAVOR+", "FAVOR+ causal", "floor (2 matmuls)"]
WAIT_POLICIES = ("PASSIVE", "ACTIVE")
POLICY_RATIOS = ("FAVOR+ / floor", "FAVOR+ causal / FAVOR+")  # reported for each policy


def time_probe(n: int, repeats: int, names: list[str]) -> None:
    """Subprocess entry: print the median times of ``names`` at ``n`` (methods taking turns)."""
    torch.set_num_threads(THREADS)
    methods = {name: method for name, method in available_methods().items() if name in names}
    print(json.dumps(time_methods(methods, n, repeats, set())))


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
        times, error = run_probe(["--time-probe", str(n), str(repeats), *POLICY_METHODS],
                                 env={**os.environ, "OMP_WAIT_POLICY": policy})
        out[policy] = {"error": error} if error else {"time": times, "ratios": ratios(times)}
    return out


def time_methods(methods: dict, n: int, repeats: int, slow: set) -> dict:
    """Median forward time of every method at ``n``, the methods taking turns.

    Calls slower than 2 s get 3 timed runs; calls slower than 10 s get one more run
    after the warm-up, and the warm-up counts as a sample (its one-off costs are
    milliseconds against tens of seconds).
    """
    inputs = make_inputs(n, PUBLIC_NYSTROM in methods)
    rounds: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    results: dict[str, dict] = {}
    with torch.inference_mode():
        for name, method in methods.items():
            reason = "slower than 60 s at a smaller n" if name in slow else skip_reason(name, n)
            if reason:
                results[name] = {"skipped": reason}
                continue
            start = time.perf_counter()
            method(inputs)  # warm-up
            warm = time.perf_counter() - start
            times[name] = [warm] if warm > 10.0 else []
            rounds[name] = repeats if warm < 2.0 else 3 if warm < 10.0 else 1
            if warm > SLOW_CALL_S:
                slow.add(name)
        for r in range(max(rounds.values(), default=0)):
            for name in rounds:
                if r < rounds[name]:
                    start = time.perf_counter()
                    methods[name](inputs)
                    times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        results[name] = {"median_s": statistics.median(values), "times_s": values}
    return results


def ratios(row: dict) -> dict:
    def t(name):
        return row.get(name, {}).get("median_s")

    out = {}
    pairs = {
        "FAVOR+ / floor": ("FAVOR+", "floor (2 matmuls)"),
        "FAVOR+ / SDPA": ("FAVOR+", "SDPA"),
        "FAVOR+ causal / FAVOR+": ("FAVOR+ causal", "FAVOR+"),
        "linear / SDPA": ("linear (elu+1)", "SDPA"),
        "banded / SDPA": ("banded (w=32)", "SDPA"),
        "Nystrom / SDPA": ("Nystrom (64 landmarks)", "SDPA"),
        "Nystrom / nystrom-attention pkg": ("Nystrom (64 landmarks)", PUBLIC_NYSTROM),
    }
    for label, (a, b) in pairs.items():
        if t(a) and t(b):
            out[label] = t(a) / t(b)
    return out


def write_markdown(report: dict, path: Path) -> None:
    names = report["methods"]
    lines = [
        "# Attention forward time and peak extra memory",
        "",
        f"batch x heads = {BATCH_HEADS}, d = {HEAD_DIM}, float32, {THREADS} threads, "
        f"m = {NUM_FEATURES} features. torch {report['torch']}, {report['machine']}. "
        f"Load average (1 min) at start / end: {report['load_start']:.1f} / "
        f"{report['load_end']:.1f}.",
        "",
        "## Median forward time (ms)",
        "",
        "| n | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for n, row in report["results"].items():
        cells = []
        for name in names:
            entry = row["time"].get(name, {})
            cells.append(f"{1e3 * entry['median_s']:.1f}" if "median_s" in entry else "skipped")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "## Peak extra memory of one forward (MiB)", "",
              "| n | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for n, row in report["results"].items():
        if not row.get("memory"):
            continue
        cells = []
        for name in names:
            entry = row.get("memory", {}).get(name, {})
            cells.append(f"{entry['peak_extra_mib']:.0f}" if "peak_extra_mib" in entry else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    labels = sorted({label for row in report["results"].values() for label in row["ratios"]})
    lines += ["", "## Ratios of median times (same run, methods taking turns)", "",
              "| n | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for n, row in report["results"].items():
        cells = [f"{row['ratios'][label]:.3f}" if label in row["ratios"] else "-"
                 for label in labels]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if report.get("targets"):
        lines += ["", f"## Targets at n = {TARGET_N}", "", "| quantity | measured | target | met |",
                  "|---|---|---|---|"]
        for label, entry in report["targets"].items():
            lines.append(f"| {label} | {entry['measured']:.3f} | <= {entry['limit']} | "
                         f"{'yes' if entry['met'] else 'NO'} |")
    if report.get("wait_policies"):
        lines += ["", f"## FAVOR+ at n = {TARGET_N} under each OpenMP wait policy", "",
                  "Each policy timed in a fresh process (methods taking turns), one after the "
                  "other. PASSIVE: idle threads sleep (the default of `make bench`, for shared "
                  "machines); ACTIVE: they spin (close to an unset policy on an idle machine).",
                  "", "| OMP_WAIT_POLICY | FAVOR+ (ms) | FAVOR+ causal (ms) | floor (ms) | "
                  "FAVOR+ / floor | FAVOR+ causal / FAVOR+ |", "|---|---|---|---|---|---|"]
        for policy, entry in report["wait_policies"].items():
            if "time" not in entry:
                lines.append(f"| {policy} | {entry.get('error', 'failed')} | | | | |")
                continue
            ms = [entry["time"].get(name, {}).get("median_s") for name in POLICY_METHODS]
            cells = [f"{1e3 * t:.1f}" if t else "-" for t in ms]
            cells += [f"{entry['ratios'].get(label, float('nan')):.3f}"
                      for label in POLICY_RATIOS]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    skipped = sorted({
        f"{name} at n = {n}: {entry['skipped']}"
        for n, row in report["results"].items()
        for name, entry in row["time"].items()
        if "skipped" in entry
    })
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in skipped]
    if report["notes"]:
        lines += ["", "Notes:", ""] + [f"- {s}" for s in report["notes"]]
    path.write_text("\n".join(lines) + "\n")


TARGET_N = 8192
TARGETS = {  # label: (ratio label or memory method, limit)
    "FAVOR+ / floor": ("FAVOR+ / floor", 2.5),
    "FAVOR+ / SDPA": ("FAVOR+ / SDPA", 0.1),
    "FAVOR+ causal / FAVOR+": ("FAVOR+ causal / FAVOR+", 3.0),
    "FAVOR+ peak extra memory (MiB)": ("FAVOR+", 150),
    "banded / SDPA": ("banded / SDPA", 0.05),
    "Nystrom / nystrom-attention pkg": ("Nystrom / nystrom-attention pkg", 1.0),
}


def check_targets(report: dict) -> dict:
    """The project's targets at n = 8192, measured in this run (empty if n not run)."""
    row = report["results"].get(str(TARGET_N))
    if row is None:
        return {}
    measured = {}  # label -> (value, limit)
    for label, (key, limit) in TARGETS.items():
        if label.endswith("(MiB)"):
            measured[label] = (row.get("memory", {}).get(key, {}).get("peak_extra_mib"), limit)
        else:
            measured[label] = (row["ratios"].get(key), limit)
    for policy, entry in report.get("wait_policies", {}).items():
        measured[f"FAVOR+ / floor, OMP_WAIT_POLICY={policy} probe"] = (
            entry.get("ratios", {}).get("FAVOR+ / floor"), TARGETS["FAVOR+ / floor"][1])
    return {label: {"measured": value, "limit": limit, "met": value <= limit}
            for label, (value, limit) in measured.items() if value is not None}


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name in report["methods"]:
        points = [
            (int(n), row["time"][name]["median_s"])
            for n, row in report["results"].items()
            if "median_s" in row["time"].get(name, {})
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            style = "--" if name.startswith("floor") else "-"
            ax.loglog(xs, ys, style, marker="o", label=name)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("median forward time (s)")
    ax.set_title(
        f"Attention forward, CPU {THREADS} threads, batch x heads {BATCH_HEADS}, d {HEAD_DIM}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--repeats", type=int, help="timed calls per method (default 5)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--memory-probe", nargs="+", help=argparse.SUPPRESS)  # N METHOD...
    parser.add_argument("--time-probe", nargs="+", help=argparse.SUPPRESS)  # N REPEATS METHOD...
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(int(args.memory_probe[0]), args.memory_probe[1:])
        return
    if args.time_probe:
        time_probe(int(args.time_probe[0]), int(args.time_probe[1]), args.time_probe[2:])
        return
    torch.set_num_threads(THREADS)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (3 if args.quick else 5)
    methods = available_methods()
    began = time.perf_counter()
    report = {
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": THREADS,
        "shape": [BATCH_HEADS, "n", HEAD_DIM],
        "num_features": NUM_FEATURES,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_start": os.getloadavg()[0],
        "methods": list(methods),
        "results": {},
        "notes": [
            f"time: median of {repeats} calls after a warm-up (3 for calls slower than 2 s; "
            "for calls slower than 10 s, the warm-up and one more call)",
            "memory: peak RSS (VmHWM) of a fresh process during one call minus its RSS before",
            "naive softmax (~3 n x n float32 buffers) and SDPA (~2.25, measured on this CPU) "
            "are skipped where those would exceed 8 GiB",
        ],
    }
    slow: set[str] = set()
    for n in sizes:
        print(f"n = {n}: timing ...", flush=True)
        row = {"time": time_methods(methods, n, repeats, slow)}
        row["ratios"] = ratios(row["time"])
        if not args.no_memory and (not args.quick or n == sizes[-1]):  # quick: largest n
            print(f"n = {n}: memory ...", flush=True)
            timed = [name for name, entry in row["time"].items() if "median_s" in entry]
            row["memory"] = measure_memory(n, timed)
        report["results"][str(n)] = row
        for name, entry in row["time"].items():
            shown = f"{1e3 * entry['median_s']:9.1f} ms" if "median_s" in entry else "  skipped"
            memory = row.get("memory", {}).get(name, {}).get("peak_extra_mib")
            extra = f"  {memory:8.1f} MiB" if memory is not None else ""
            print(f"    {name:24s}{shown}{extra}", flush=True)
        for label, value in row["ratios"].items():
            print(f"    {label:24s}{value:9.3f}", flush=True)
    if str(TARGET_N) in report["results"]:
        print(f"n = {TARGET_N}: FAVOR+ and the floor under each OpenMP wait policy ...",
              flush=True)
        report["wait_policies"] = compare_wait_policies(TARGET_N, repeats)
        for policy, entry in report["wait_policies"].items():
            for label in POLICY_RATIOS:
                value = entry.get("ratios", {}).get(label)
                shown = f"{value:9.3f}" if value is not None else entry.get("error", "-")
                print(f"    {policy:8s}{label:24s}{shown}", flush=True)
    report["load_end"] = os.getloadavg()[0]
    report["targets"] = check_targets(report)
    for label, entry in report["targets"].items():
        verdict = "met" if entry["met"] else "MISSED"
        print(f"target at n = {TARGET_N}: {label} = {entry['measured']:.3f} "
              f"(<= {entry['limit']}): {verdict}")
    report["wall_s"] = time.perf_counter() - began
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_speed.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, args.out / "attention_speed.md")
    write_plot(report, args.out / "attention_speed.png")
    print(f"wrote {args.out}/attention_speed.{{json,md,png}} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
