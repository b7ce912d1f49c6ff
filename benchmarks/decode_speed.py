"""Decoding one token: time per step and state size against the context length n.

Run from the repository root::

    .venv/bin/python benchmarks/decode_speed.py          # full run (about a minute, idle)
    .venv/bin/python benchmarks/decode_speed.py --quick  # smoke test, seconds

Setting: batch 1, 8 query heads of dimension 64, float32, CPU, 2 threads. One decoding
step is the attention of one new token at position n: its query ``(1, 8, 1, 64)``, key and
value are ready made (random; the projections are the same for every method and are not
timed), and the step appends the key and value to the method's cache or state and returns
the token's output. Before the first call the cache holds n random keys and values (the
state the same n tokens leave). Methods (keys of the JSON):

    mha       ea.KVCache with 8 key-value heads + ea.cached_attention (multi-head)
    gqa       the same with 2 key-value heads (grouped-query, 4 query heads per group)
    mqa       the same with 1 key-value head (multi-query)
    sdpa_mha  the 8-head cache read by torch's fused scaled_dot_product_attention on 4-D
              (1, 8, 1, 64) x (1, 8, n + 1, 64) tensors: the baseline for ``mha``
    window    ea.SlidingWindowKVCache(1024) + ea.cached_attention (8 heads, w = 1024)
    linear    ea.RecurrentLinearAttention.step (elu + 1 features, state 64 x 64 + 64)
    gated     efficient_attention.recurrent.gated_linear_attention_step (one decay per key
              channel, GLA; state 64 x 64); skipped, with the reason, if not importable

Time: median of ``repeats`` calls after a warm-up (``_timing.time_in_turns``). All caches
and states, of every n, are built first, and then every (n, method) takes its turn, call by
call, in each round: a burst
of load on the shared machine slows a whole round, not one n or one method, so that both
the ratios between methods and the growth with n compare calls made under the same load
(and every call finds its cache cold, as a decoding step does after the other layers have
run). The full caches are rewound (``KVCache.truncate(n)``) before every
call, so every call sees exactly n cached tokens; the window and the recurrent states
simply advance (their cost does not depend on n).

Bytes: what each method keeps per sequence after the n tokens, for all 8 heads:
``used_nbytes`` of a cache (keys and values held), the state tensors of the recurrences.

What bounds a step (a roofline, measured in the same run, in the same turns):

- diagnostics: the steps of ``mha``, ``gqa`` and ``mqa`` with torch limited to one thread
  for the call (``<method>_1thread``). The fused CPU kernel shares its work out by
  (batch, key-value head, block of 32 query rows): 8 items for ``mha``, 2 for ``gqa``, 1
  for ``mqa``. A step that takes as long on one thread as on two used one.
- memory: at every n, a streaming read (``torch.sum``) of a float32 buffer of the bytes of
  the ``mha`` cache, and a ``copy_`` of it into another (bytes read plus bytes written).
- machine: a ``MATMUL`` x ``MATMUL`` float32 matrix product, on ``THREADS`` threads and on
  one: the FLOP rate of a large, compute-bound product.
- roofline: for each cache step, the bytes of cache it reads (keys and values of the
  ``m`` positions it sees: ``m = n + 1``, or at most ``w + 1`` for the window), its
  operations (``4 h_q d m``: a dot product and a term of the weighted sum per query head
  and position) and the achieved rates, bytes / median time and operations / median time.

Writes ``decode_speed.json``, ``.md`` and ``.png`` (``benchmarks/results/`` or ``--out``).
JSON keys (stable; ``book/kv_cache.ipynb`` reads them; ``<n>`` a length as a string)::

    preliminary  bool: 1-minute load average at the start above 1.0 (or --preliminary)
    quick        bool: --quick run
    conditions   _results.run_conditions() at the start, plus "finished", "load_average_end"
    setting      {"batch", "query_heads", "d_head", "dtype", "threads", "window",
                  "repeats", "sizes": [n, ...]}
    methods      {<method>: label}   the methods timed
    skipped      {<method>: reason}  the methods that could not run
    diagnostics  {<name>: label}   timed like the methods, not plotted: <method>_1thread
    time         {<n>: {<method or diagnostic>: {"median_ms": float, "times_ms": [...]}}}
    state_bytes  {<n>: {<method>: int}}
    ratios       {<n>: {"<method or diagnostic> / mha": float}}   medians, same run
    growth       {<method>: median at the largest n / median at the smallest n}
    memory       {<n>: {"bytes": int, "read": {"median_ms", "times_ms", "gbs"},
                        "copy": {"median_ms", "times_ms", "gbs"}}}  (GB/s = 1e9 bytes/s;
                 the copy's GB/s count the bytes read and written, 2 * bytes)
    machine      {"matmul": {"size", "threads", "flop", "median_ms", "times_ms", "gflops"},
                  "matmul_1thread": {...}}
    roofline     {<n>: {<cache method or diagnostic>: {"positions", "bytes_read", "flop",
                        "intensity", "gbs", "gflops"}}}   (intensity: flop / bytes_read)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
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

THREADS = 2
BATCH = 1
HEADS = 8
HEAD_DIM = 64
WINDOW = 1024
PREFILL_BLOCK = 1024  # tokens appended at a time when the cache is filled
FULL = {"sizes": [512, 1024, 2048, 4096, 8192, 16384], "repeats": 40}
QUICK = {"sizes": [128, 256, 512], "repeats": 5}
MATMUL = 512  # the side of the square product that measures the FLOP rate
LABELS = {
    "mha": "softmax, KV cache, 8 kv heads (MHA)",
    "gqa": "softmax, KV cache, 2 kv heads (GQA)",
    "mqa": "softmax, KV cache, 1 kv head (MQA)",
    "sdpa_mha": "SDPA on the MHA cache",
    "window": f"sliding window, w = {WINDOW}",
    "linear": "recurrent linear (elu+1)",
    "gated": "recurrent gated (GLA)",
}
CACHES = ("mha", "sdpa_mha", "gqa", "mqa", "window")  # the steps that read a KV cache
DIAGNOSTICS = {f"{name}_1thread": f"{LABELS[name]}, one thread" for name in ("mha", "gqa", "mqa")}


def gated_step_function():
    """``gated_linear_attention_step`` and ``None``, or ``None`` and why it is missing."""
    try:
        from efficient_attention.recurrent import gated_linear_attention_step
    except ImportError as error:
        return None, f"efficient_attention.recurrent is not importable: {error}"
    return gated_linear_attention_step, None


def kv_heads(method: str) -> int:
    """Key-value heads of a cache method (or of the method of a diagnostic)."""
    return {"gqa": 2, "mqa": 1}.get(method.removesuffix("_1thread"), HEADS)


def one_thread(step):
    """``step`` with torch limited to one thread for the call (then ``THREADS`` again)."""
    def call():
        torch.set_num_threads(1)
        try:
            return step()
        finally:
            torch.set_num_threads(THREADS)
    return call


def random_token(gen: torch.Generator, kv_heads: int) -> dict[str, torch.Tensor]:
    """Query ``(1, 8, 1, 64)``, key and value ``(1, kv_heads, 1, 64)`` of the new token."""
    return {"q": torch.randn(BATCH, HEADS, 1, HEAD_DIM, generator=gen),
            "k": torch.randn(BATCH, kv_heads, 1, HEAD_DIM, generator=gen),
            "v": torch.randn(BATCH, kv_heads, 1, HEAD_DIM, generator=gen)}


def filled(cache, n: int, kv_heads: int, gen: torch.Generator):
    """``cache`` after n random tokens, appended in blocks (as a chunked prefill would)."""
    for start in range(0, n, PREFILL_BLOCK):
        size = min(PREFILL_BLOCK, n - start)
        k, v = (torch.randn(BATCH, kv_heads, size, HEAD_DIM, generator=gen) for _ in range(2))
        cache.append(k, v)
    return cache


def cache_step(cache, token: dict, n: int | None):
    """One decoding step on a cache; a full cache is first rewound to n tokens."""
    def step():
        if n is not None:
            cache.truncate(n)
        return ea.cached_attention(token["q"], cache.append(token["k"], token["v"]))
    return step


def sdpa_step(cache, token: dict, n: int):
    def step():
        cache.truncate(n)
        visible = cache.append(token["k"], token["v"])
        return F.scaled_dot_product_attention(token["q"], visible.keys, visible.values)
    return step


def linear_state(n: int, gen: torch.Generator) -> ea.RecurrentLinearAttention:
    """``RecurrentLinearAttention`` holding the state of n random tokens, in closed form:
    ``S = phi(K)^T V`` and ``z = sum_j phi(k_j)``."""
    rnn = ea.RecurrentLinearAttention(ea.elu_feature_map)
    k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))
    features = ea.elu_feature_map(k)  # (1, 8, n, 64)
    rnn.state, rnn.normalizer = features.transpose(-2, -1) @ v, features.sum(-2)
    return rnn


def gated_state(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The GLA state after tokens ``0 .. n-1``,
    ``sum_j diag(exp(sum_{j < s < n} log a_s)) k_j v_j^T``, and the log decays of the new
    token. Decays ``a = sigmoid(x)^(1/16)`` per key channel (GLA's parametrisation)."""
    k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen) for _ in range(2))
    log_decay = F.logsigmoid(torch.randn(BATCH, HEADS, n + 1, HEAD_DIM, generator=gen)) / 16
    suffix = log_decay[..., :n, :].flip(-2).cumsum(-2).flip(-2)  # sum_{j <= s < n}
    remaining = torch.cat([suffix[..., 1:, :], torch.zeros_like(suffix[..., :1, :])], -2)
    state = (k * remaining.exp()).transpose(-2, -1) @ v  # (1, 8, 64, 64)
    return state, log_decay[..., -1, :]


def methods_at(n: int, gen: torch.Generator, gated_step) -> tuple[dict, dict]:
    """Zero-argument step functions and the bytes each method holds after n tokens."""
    steps, state_bytes = {}, {}
    for name in ("mha", "gqa", "mqa"):
        heads = kv_heads(name)
        cache = filled(ea.KVCache(n + 1), n, heads, gen)
        state_bytes[name] = cache.used_nbytes
        steps[name] = cache_step(cache, random_token(gen, heads), n)
        # the same step on the same cache, on one thread (a diagnostic, not a method)
        steps[f"{name}_1thread"] = one_thread(cache_step(cache, random_token(gen, heads), n))
        if name == "mha":
            steps["sdpa_mha"] = sdpa_step(cache, random_token(gen, heads), n)
            state_bytes["sdpa_mha"] = cache.used_nbytes
    window = filled(ea.SlidingWindowKVCache(WINDOW), n, HEADS, gen)
    state_bytes["window"] = window.used_nbytes
    steps["window"] = cache_step(window, random_token(gen, HEADS), None)
    rnn = linear_state(n, gen)
    state_bytes["linear"] = sum(t.numel() * t.element_size() for t in (rnn.state, rnn.normalizer))
    token = {name: x[:, :, 0] for name, x in random_token(gen, HEADS).items()}  # (1, 8, 64)
    steps["linear"] = lambda: rnn.step(token["q"], token["k"], token["v"])
    if gated_step is not None:
        holder = {}
        holder["state"], log_decay = gated_state(n, gen)
        state_bytes["gated"] = holder["state"].numel() * holder["state"].element_size()

        def gated():
            out, holder["state"] = gated_step(token["q"], token["k"], token["v"], log_decay,
                                              holder["state"])
            return out
        steps["gated"] = gated
    return steps, state_bytes


def memory_calls(n: int) -> tuple[dict, int]:
    """A streaming read (``torch.sum``) of a float32 buffer of the bytes of the n-token MHA
    cache, and a ``copy_`` of it into another buffer; and those bytes."""
    numbers = 2 * HEADS * n * HEAD_DIM
    source, target = torch.ones(numbers), torch.empty(numbers)
    return {"read": source.sum, "copy": lambda: target.copy_(source)}, 4 * numbers


def matmul_calls(gen: torch.Generator) -> dict:
    """A ``MATMUL`` x ``MATMUL`` float32 product on ``THREADS`` threads and on one."""
    a, b = (torch.randn(MATMUL, MATMUL, generator=gen) for _ in range(2))

    def product():
        return a @ b
    return {"matmul": product, "matmul_1thread": one_thread(product)}


def roofline(n: int, name: str, median_ms: float) -> dict:
    """Positions seen, bytes of cache read, operations and the achieved rates of one cache
    step (or diagnostic) with n tokens cached: float32 keys and values of ``kv_heads`` heads
    at ``m`` positions, ``4 h_q d m`` operations (module docstring)."""
    positions = min(n + 1, WINDOW + 1) if name == "window" else n + 1
    bytes_read = 2 * kv_heads(name) * positions * HEAD_DIM * 4
    flop = 4 * HEADS * HEAD_DIM * positions
    seconds = median_ms / 1e3
    return {"positions": positions, "bytes_read": bytes_read, "flop": flop,
            "intensity": flop / bytes_read, "gbs": bytes_read / seconds / 1e9,
            "gflops": flop / seconds / 1e9}


def time_turns(calls: dict, repeats: int) -> dict:
    """Median time (ms) of each zero-argument call, the calls taking turns after a warm-up
    (``_timing.time_in_turns``), as ``{key: {"median_ms", "times_ms"}}``. Every call gets
    ``repeats`` rounds: a decoding step takes well under a second, and a slow warm-up is a
    one-off cost of the first call (seen: over 2 s on a busy machine), not the step's."""
    timed = time_in_turns(calls, repeats, fewer_rounds_when_slow=False)
    return {key: timing.summary("ms") for key, timing in timed.items()}


def markdown(report: dict) -> str:
    """The table of ``decode_speed.md``."""
    cond, setting = report["conditions"], report["setting"]
    names = list(report["methods"])
    lines = ["# Decoding one token: time per step and state size", ""]
    if report["preliminary"]:
        lines += ["**PRELIMINARY: measured on a shared, busy machine; rerun on an idle one "
                  "(`.venv/bin/python benchmarks/decode_speed.py`).**", ""]
    lines += [f"Batch {setting['batch']}, {setting['query_heads']} query heads of "
              f"{setting['d_head']}, {setting['dtype']}, {setting['threads']} threads, median of "
              f"{setting['repeats']} calls. torch {cond['torch']}; load average at start / end: "
              f"{cond['load_average_start']} / {cond['load_average_end']}.", ""]
    for name, reason in report["skipped"].items():
        lines += [f"Skipped `{name}`: {reason}", ""]
    lines += ["## Median time of one step (ms)", "",
              "| n | " + " | ".join(report["methods"][m] for m in names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for n, row in report["time"].items():
        lines.append(f"| {n} | " + " | ".join(f"{row[m]['median_ms']:.3f}" for m in names)
                     + " |")
    lines += ["", "## State kept per sequence (KiB)", "",
              "| n | " + " | ".join(report["methods"][m] for m in names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for n, row in report["state_bytes"].items():
        lines.append(f"| {n} | " + " | ".join(f"{row[m] / 2**10:.0f}" for m in names) + " |")
    lines += ["", "## Growth of the step time from the smallest to the largest n", "",
              "| method | growth |", "|---|---|"]
    lines += [f"| {report['methods'][m]} | {g:.2f} |" for m, g in report["growth"].items()]
    rated = [*CACHES, *report["diagnostics"]]
    labels = {**report["methods"], **report["diagnostics"]}
    for title, key in (("Achieved bandwidth of a cache step (GB/s)", "gbs"),
                       ("Achieved FLOP rate of a cache step (GFLOP/s)", "gflops")):
        lines += ["", f"## {title}", "",
                  "bytes of keys and values read, or 4 h_q d m operations, over the median "
                  "time", "",
                  "| n | " + " | ".join(labels[m] for m in rated) + " |",
                  "|---" * (len(rated) + 1) + "|"]
        for n, row in report["roofline"].items():
            lines.append(f"| {n} | " + " | ".join(f"{row[m][key]:.2f}" for m in rated) + " |")
    lines += ["", "## The machine, in the same run", "",
              "| n | bytes (MHA cache) | read (GB/s) | copy (GB/s, read + written) |",
              "|---|---|---|---|"]
    for n, row in report["memory"].items():
        lines.append(f"| {n} | {row['bytes']} | {row['read']['gbs']:.2f} | "
                     f"{row['copy']['gbs']:.2f} |")
    lines += [""] + [f"- {size}: float32 product of {entry['size']} x {entry['size']} matrices, "
                     f"{entry['threads']} thread(s): {entry['gflops']:.1f} GFLOP/s"
                     for size, entry in report["machine"].items()]
    return "\n".join(lines) + "\n"


def plot(report: dict):
    """Time per step, bytes held and the achieved bandwidth of the cache steps, against n
    (log-log), the streaming read of the machine beside the last."""
    plt = pyplot()
    fig, (ax_time, ax_bytes, ax_rate) = plt.subplots(1, 3, figsize=(17, 4.5))
    sizes = [int(n) for n in report["time"]]
    for name, label in report["methods"].items():
        style = ":" if name == "sdpa_mha" else "-"
        ax_time.loglog(sizes, [report["time"][str(n)][name]["median_ms"] for n in sizes],
                       style, marker="o", label=label)
        ax_bytes.loglog(sizes, [report["state_bytes"][str(n)][name] / 2**20 for n in sizes],
                        style, marker="o", label=label)
    ax_time.set(xlabel="context length n", ylabel="median time of one step (ms)",
                title="one decoding step, 8 query heads of 64")
    ax_bytes.set(xlabel="context length n", ylabel="MiB kept per sequence",
                 title="cache or state (float32)")
    labels = {**report["methods"], **report["diagnostics"]}
    for name in [*CACHES, *report["diagnostics"]]:
        ax_rate.loglog(sizes, [report["roofline"][str(n)][name]["gbs"] for n in sizes],
                       ":" if name in report["diagnostics"] else "-", marker="o",
                       label=labels[name])
    ax_rate.loglog(sizes, [report["memory"][str(n)]["read"]["gbs"] for n in sizes], "k--",
                   label="streaming read (torch.sum)")
    ax_rate.set(xlabel="context length n", ylabel="GB/s of cache read",
                title="achieved bandwidth of a step")
    for ax in (ax_time, ax_bytes, ax_rate):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the results preliminary whatever the load")
    parser.add_argument("--sizes", type=int, nargs="+", help="context lengths to time")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    plan = dict(QUICK if args.quick else FULL)
    if args.sizes:
        plan["sizes"] = sorted(args.sizes)
    out = output_folder(args.quick, args.out)
    conditions = run_conditions()
    gated_step, gated_missing = gated_step_function()
    report = {
        "preliminary": bool(args.preliminary or conditions["load_average_start"][0] > 1.0),
        "quick": args.quick,
        "conditions": conditions,
        "setting": {"batch": BATCH, "query_heads": HEADS, "d_head": HEAD_DIM,
                    "dtype": "float32", "threads": THREADS, "window": WINDOW,
                    "repeats": plan["repeats"], "sizes": plan["sizes"]},
        "methods": {name: label for name, label in LABELS.items()
                    if name != "gated" or gated_step is not None},
        "skipped": {} if gated_step is not None else {"gated": gated_missing},
        "diagnostics": dict(DIAGNOSTICS),
        "time": {}, "state_bytes": {}, "ratios": {}, "memory": {}, "roofline": {},
    }
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        calls, memory_bytes = {}, {}
        for n in plan["sizes"]:  # every cache and state first: then all of them take turns
            steps, report["state_bytes"][str(n)] = methods_at(n, gen, gated_step)
            calls.update({(n, name): step for name, step in steps.items()})
            streams, memory_bytes[n] = memory_calls(n)
            calls.update({(n, name): stream for name, stream in streams.items()})
        calls.update({("machine", name): call for name, call in matmul_calls(gen).items()})
        timed = time_turns(calls, plan["repeats"])
    for n in plan["sizes"]:
        row = {name: timed[(n, name)] for name in [*report["methods"], *DIAGNOSTICS]}
        report["time"][str(n)] = row
        report["ratios"][str(n)] = {f"{name} / mha": row[name]["median_ms"]
                                    / row["mha"]["median_ms"] for name in row}
        report["roofline"][str(n)] = {name: roofline(n, name, row[name]["median_ms"])
                                      for name in [*CACHES, *DIAGNOSTICS]}
        size = memory_bytes[n]
        report["memory"][str(n)] = {"bytes": size, **{
            name: {**timed[(n, name)], "gbs": moved * size / timed[(n, name)]["median_ms"] / 1e6}
            for name, moved in (("read", 1), ("copy", 2))}}
        print(f"n = {n}: " + ", ".join(f"{name} {entry['median_ms']:.3f} ms"
                                       for name, entry in row.items())
              + f"; read {report['memory'][str(n)]['read']['gbs']:.1f} GB/s", flush=True)
    flop = 2 * MATMUL**3
    report["machine"] = {name: {"size": MATMUL, "threads": threads, "flop": flop,
                                **timed[("machine", name)],
                                "gflops": flop / timed[("machine", name)]["median_ms"] / 1e6}
                         for name, threads in (("matmul", THREADS), ("matmul_1thread", 1))}
    first, last = str(plan["sizes"][0]), str(plan["sizes"][-1])
    report["growth"] = {name: report["time"][last][name]["median_ms"]
                        / report["time"][first][name]["median_ms"] for name in report["methods"]}
    report["conditions"].update(run_conditions(end=True))
    written = write_results("decode_speed", report, out=out, markdown=markdown(report),
                            figure=plot(report))
    print("wrote " + ", ".join(str(path) for path in written.values()))


if __name__ == "__main__":
    main()
