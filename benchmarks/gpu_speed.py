"""The library on one CUDA GPU, against what users run there: fused SDPA (its flash kernel),
FlexAttention with the same block mask, and the GPU's own memory bandwidth.

Run on a machine with a GPU, from the repository root::

    python benchmarks/gpu_speed.py --out DIR            # all sections (minutes on an H100)
    python benchmarks/gpu_speed.py --quick --device cpu # smoke test of the code paths

Sections (each one independent: a section that fails records its error and the others run):

- ``sparse``: ``q, k, v`` of shape ``(1, 8, n, 64)`` in bfloat16, blocks of ``B = 128``.
  ``SDPA`` (dense, ``F.scaled_dot_product_attention``), ``block-sparse (window 1/8)``
  (``ea.longformer_block_mask`` with the window whose density is nearest 1/8),
  ``block-sparse (random 1/8)`` (``ea.bigbird_block_mask``, own block plus random ones),
  ``top-k (1/8)`` (``ea.topk_block_attention``) and ``FlexAttention (window 1/8)``
  (``torch.compile(flex_attention)`` with a ``BlockMask`` of the same blocks). Forward
  (under ``torch.inference_mode``) and training step (forward and backward). Time: CUDA
  synchronised wall clock, the methods taking turns (``_timing.time_in_turns``); memory:
  ``torch.cuda.max_memory_allocated`` during one call, minus what was allocated before it.
- ``decode``: one decoding step (``ea.cached_attention``) on a filled ``ea.KVCache`` of 8
  query heads and 8, 2 or 1 key-value heads (MHA, GQA, MQA) of 64, bfloat16, batch 1 and 32,
  against the GPU's streaming copy bandwidth measured in the same run; the achieved
  bandwidth of a step is the bytes of cache it reads over its time.
- ``ring``: ``ea.ring_attention`` in a process group of one (nccl): a ring of one GPU has
  no neighbour, so this only shows the cost of the ring's bookkeeping against
  ``ea.tiled_attention`` and SDPA, and that the nccl path runs.

Writes ``gpu_speed.json`` and ``gpu_speed.md`` into ``--out`` (``benchmarks/results`` by
default).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from _timing import prefer_passive_wait_policy, time_in_turns  # noqa: E402

prefer_passive_wait_policy()  # before torch starts OpenMP (see _timing.py); no effect on a GPU

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sparse_speed import nearest_window  # noqa: E402

import efficient_attention as ea  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 8, 64, 128
FULL = {"sparse_sizes": [4096, 8192, 16384, 32768], "decode_sizes": [4096, 16384, 65536],
        "decode_batches": [1, 32], "ring_sizes": [4096, 16384], "repeats": 10}
QUICK = {"sparse_sizes": [512, 1024], "decode_sizes": [256, 1024], "decode_batches": [1, 2],
         "ring_sizes": [512], "repeats": 2}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(calls: dict, repeats: int, device: torch.device) -> dict:
    """Median ms of each call, the calls taking turns; the clock waits for the GPU."""
    def clock() -> float:
        synchronize(device)
        return time.perf_counter()
    timings = time_in_turns(calls, repeats, clock=clock, fewer_rounds_when_slow=False)
    return {key: timing.summary("ms") for key, timing in timings.items()}


def peak_extra_mib(call, device: torch.device) -> float | None:
    """Peak memory allocated on the GPU during one call, above what was allocated before."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = call()
    synchronize(device)
    del result
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def flex_call(q, k, v, block_mask: torch.Tensor, device: torch.device):
    """FlexAttention with a BlockMask of exactly the blocks of ``block_mask`` (compiled)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    blocks = block_mask.shape[-1]
    rows = block_mask.to(torch.int32)
    counts = rows.sum(-1).to(torch.int32)[None, None]  # (1, 1, nb)
    order = torch.argsort(rows, dim=-1, descending=True, stable=True).to(torch.int32)
    indices = order[None, None]  # (1, 1, nb, nb): selected blocks first
    mask = BlockMask.from_kv_blocks(counts.to(device), indices.to(device),
                                    BLOCK_SIZE=BLOCK, seq_lengths=(blocks * BLOCK,) * 2)
    torch._dynamo.reset()  # one compiled kernel per (n, grad mode): no recompile limit hit
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=mask)


def train_call(forward, inputs: list[torch.Tensor], grad: torch.Tensor):
    def step():
        for x in inputs:
            x.grad = None
        out = forward()
        out.backward(grad)
        return out.detach()
    return step


def sparse_methods(q, k, v, masks: dict, top_k: int) -> dict:
    """Zero-argument calls of dense SDPA, block-sparse attention with each mask and top-k."""
    def block_sparse(mask):
        return lambda: ea.block_sparse_attention(q, k, v, mask, block_size=BLOCK)
    calls = {"SDPA": lambda: F.scaled_dot_product_attention(q, k, v)}
    calls |= {f"block-sparse ({name})": block_sparse(mask) for name, mask in masks.items()}
    calls["top-k (1/8)"] = lambda: ea.topk_block_attention(q, k, v, block_size=BLOCK,
                                                           top_k=top_k)
    return calls


def copy_gbs(numbers: int, config: dict, device: torch.device, dtype: torch.dtype) -> float:
    """Bytes read and written per second by a streaming copy of ``numbers`` elements."""
    source = torch.ones(numbers, dtype=dtype, device=device)
    target = torch.empty_like(source)
    copy = timed({"copy": lambda: target.copy_(source)}, config["repeats"], device)
    return 2 * numbers * source.element_size() / (copy["copy"]["median_ms"] / 1e3) / 1e9


def decode_step(cache, q: torch.Tensor, new: list[torch.Tensor], n: int):
    """One decoding step on ``cache`` rewound to n tokens."""
    def step():
        cache.truncate(n)
        return ea.cached_attention(q, cache.append(*new))
    return step


def sparse_section(config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    report = {"time_ms": {}, "memory_mib": {}, "ratios": {}, "density": {}, "errors": {}}
    gen = torch.Generator().manual_seed(0)
    for n in config["sparse_sizes"]:
        blocks = n // BLOCK
        window = nearest_window(blocks, 1 / 8)
        masks = {"window 1/8": ea.longformer_block_mask(n, block_size=BLOCK, window=window),
                 "random 1/8": ea.bigbird_block_mask(n, block_size=BLOCK, window=0,
                                                     num_global=0,
                                                     num_random=max(blocks // 8 - 1, 0),
                                                     generator=gen)}
        report["density"][n] = {name: m.float().mean().item() for name, m in masks.items()}
        masks = {name: m.to(device) for name, m in masks.items()}
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).to(device, dtype)
                   for _ in range(3))
        top_k = max(blocks // 8, 1)

        forward = sparse_methods(q, k, v, masks, top_k)
        if device.type == "cuda":
            try:
                flex = flex_call(q, k, v, masks["window 1/8"], device)
                reference = ea.block_sparse_attention(q, k, v, masks["window 1/8"],
                                                      block_size=BLOCK)
                gap = (flex().float() - reference.float()).abs().max().item()
                report.setdefault("flex_max_abs_diff", {})[n] = gap
                forward["FlexAttention (window 1/8)"] = flex
            except Exception as error:  # noqa: BLE001 - recorded, the others still run
                report["errors"][f"flex forward n={n}"] = repr(error)[:500]
        with torch.inference_mode():
            times = {"forward": timed(forward, config["repeats"], device)}
            memory = {"forward": {name: peak_extra_mib(call, device)
                                  for name, call in forward.items()}}
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        grad = torch.randn(q.shape, generator=gen).to(device, dtype)
        train = {name: train_call(call, [qg, kg, vg], grad)
                 for name, call in sparse_methods(qg, kg, vg, masks, top_k).items()}
        if device.type == "cuda":
            try:
                train["FlexAttention (window 1/8)"] = train_call(
                    flex_call(qg, kg, vg, masks["window 1/8"], device), [qg, kg, vg], grad)
                train["FlexAttention (window 1/8)"]()
            except Exception as error:  # noqa: BLE001
                train.pop("FlexAttention (window 1/8)", None)
                report["errors"][f"flex train n={n}"] = repr(error)[:500]
        times["train"] = timed(train, config["repeats"], device)
        memory["train"] = {name: peak_extra_mib(call, device) for name, call in train.items()}
        report["time_ms"][n], report["memory_mib"][n] = times, memory
        report["ratios"][n] = {
            workload: {f"{name} / SDPA": times[workload][name]["median_ms"]
                       / times[workload]["SDPA"]["median_ms"]
                       for name in times[workload] if name != "SDPA"}
            for workload in times}
        print(f"sparse n={n}: {json.dumps(report['ratios'][n])}", flush=True)
    return report


def decode_section(config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    report = {"copy_gbs": None, "time_ms": {}, "gbs": {}}
    gen = torch.Generator().manual_seed(1)
    numbers = 2**28 if device.type == "cuda" else 2**22
    report["copy_gbs"] = copy_gbs(numbers, config, device, dtype)
    for batch in config["decode_batches"]:
        for n in config["decode_sizes"]:
            calls, bytes_read = {}, {}
            for name, kv_heads in (("MHA", HEADS), ("GQA-2", 2), ("MQA", 1)):
                cache = ea.KVCache(n + 1)
                for start in range(0, n, 4096):
                    size = min(4096, n - start)
                    cache.append(*(torch.randn(batch, kv_heads, size, HEAD_DIM,
                                               generator=gen).to(device, dtype)
                                   for _ in range(2)))
                q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=gen).to(device, dtype)
                new = [torch.randn(batch, kv_heads, 1, HEAD_DIM, generator=gen).to(device, dtype)
                       for _ in range(2)]
                calls[name] = decode_step(cache, q, new, n)
                bytes_read[name] = 2 * batch * kv_heads * (n + 1) * HEAD_DIM * q.element_size()
            with torch.inference_mode():
                times = timed(calls, config["repeats"], device)
            key = f"batch {batch}, n {n}"
            report["time_ms"][key] = times
            report["gbs"][key] = {name: bytes_read[name] / (times[name]["median_ms"] / 1e3) / 1e9
                                  for name in calls}
            print(f"decode {key}: {json.dumps(report['gbs'][key])}", flush=True)
    return report


def ring_section(config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    import torch.distributed as dist
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=0, world_size=1)
    report = {"backend": backend, "time_ms": {}, "max_abs_diff": {}}
    try:
        gen = torch.Generator().manual_seed(2)
        for n in config["ring_sizes"]:
            q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).to(device, dtype)
                       for _ in range(3))
            calls = {name: functools.partial(function, q, k, v) for name, function in
                     (("ring p=1", ea.ring_attention), ("tiled", ea.tiled_attention),
                      ("SDPA", F.scaled_dot_product_attention))}
            with torch.inference_mode():
                report["max_abs_diff"][n] = (calls["ring p=1"]().float()
                                             - calls["SDPA"]().float()).abs().max().item()
                report["time_ms"][n] = timed(calls, config["repeats"], device)
            medians = {m: t["median_ms"] for m, t in report["time_ms"][n].items()}
            print(f"ring n={n}: {json.dumps(medians)}", flush=True)
    finally:
        dist.destroy_process_group()
    return report


SECTIONS = {"sparse": sparse_section, "decode": decode_section, "ring": ring_section}


def markdown(report: dict) -> str:
    lines = ["# The library on one GPU", "",
             f"Device: {report['device_name']}; torch {report['torch']}; {report['dtype']}.", ""]
    for name, section in report["sections"].items():
        lines += [f"## {name}", ""]
        if "error" in section:
            lines += ["Failed: `" + section["error"].splitlines()[-1] + "`", ""]
            continue
        if name == "sparse":
            for n, workloads in section["time_ms"].items():
                for workload, methods in workloads.items():
                    lines += [f"n = {n}, {workload}: "
                              + ", ".join(f"{m} {t['median_ms']:.3f} ms "
                                          f"({section['memory_mib'][n][workload].get(m) or 0:.0f}"
                                          " MiB)" for m, t in methods.items()), ""]
            for error, text in section["errors"].items():
                lines += [f"- {error}: `{text[:200]}`"]
        elif name == "decode":
            lines += [f"Streaming copy: {section['copy_gbs']:.0f} GB/s (read + write).", ""]
            for key, rates in section["gbs"].items():
                times = section["time_ms"][key]
                lines += [f"{key}: " + ", ".join(
                    f"{m} {times[m]['median_ms']:.4f} ms = {r:.0f} GB/s" for m, r in rates.items()),
                    ""]
        elif name == "ring":
            for n, times in section["time_ms"].items():
                lines += [f"n = {n} ({section['backend']}, max |ring - SDPA| = "
                          f"{section['max_abs_diff'][n]:.2e}): "
                          + ", ".join(f"{m} {t['median_ms']:.3f} ms" for m, t in times.items()),
                          ""]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = QUICK if args.quick else FULL
    report = {"benchmark": "gpu_speed", "quick": args.quick, "torch": torch.__version__,
              "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                              else "cpu"),
              "dtype": str(dtype), "config": config, "sections": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        start = time.perf_counter()
        try:
            report["sections"][name] = SECTIONS[name](config, device, dtype)
        except Exception:  # noqa: BLE001 - one failed section must not lose the others
            report["sections"][name] = {"error": traceback.format_exc()}
            print(traceback.format_exc(), flush=True)
        report["sections"][name]["seconds"] = time.perf_counter() - start
        (out / "gpu_speed.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_speed.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
