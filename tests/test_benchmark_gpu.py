"""benchmarks/gpu_speed.py: its code paths on the CPU at tiny sizes, and the committed GPU
results (benchmarks/results/gpu_speed.json) consistent with themselves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_speed  # noqa: E402

TINY = {"sparse_sizes": [256], "decode_sizes": [64], "decode_batches": [1], "ring_sizes": [128],
        "repeats": 2}


def test_sparse_and_decode_sections_run_on_the_cpu():
    cpu = torch.device("cpu")
    sparse = gpu_speed.sparse_section(TINY, cpu, torch.float32)
    times = sparse["time_ms"][256]
    assert set(times) == {"forward", "train"}
    for workload in times.values():
        assert {"SDPA", "block-sparse (window 1/8)", "top-k (1/8)"} <= set(workload)
        assert all(t["median_ms"] > 0 for t in workload.values())
    ratio = sparse["ratios"][256]["forward"]["top-k (1/8) / SDPA"]
    assert ratio == times["forward"]["top-k (1/8)"]["median_ms"] / times["forward"]["SDPA"][
        "median_ms"]
    decode = gpu_speed.decode_section(TINY, cpu, torch.float32)
    assert decode["copy_gbs"] > 0
    assert set(decode["gbs"]["batch 1, n 64"]) == {"MHA", "GQA-2", "MQA"}


def test_the_committed_gpu_results_hold_together():
    report = json.loads((ROOT / "benchmarks/results/gpu_speed.json").read_text())
    assert report["device_name"].startswith("NVIDIA") and not report["quick"]
    assert report["cuda_tests"].split()[1].strip(",") == "passed"
    assert "failed" not in report["cuda_tests"] and "error" not in report["cuda_tests"]
    sections = report["sections"]
    assert not any("error" in section for section in sections.values())
    for n, workloads in sections["sparse"]["time_ms"].items():
        for workload, methods in workloads.items():
            sdpa = methods["SDPA"]["median_ms"]
            for name, timing in methods.items():
                if name != "SDPA":
                    measured = sections["sparse"]["ratios"][n][workload][f"{name} / SDPA"]
                    assert abs(measured - timing["median_ms"] / sdpa) < 1e-9 * measured
    # FlexAttention agrees with block-sparse attention (bfloat16: a few units of 2^-8)
    assert max(sections["sparse"]["flex_max_abs_diff"].values()) < 0.05
    # the ring of one equals SDPA up to bfloat16 rounding
    assert max(sections["ring"]["max_abs_diff"].values()) < 0.05
    assert (ROOT / "benchmarks/results/gpu_speed.md").read_text() == gpu_speed.markdown(
        report) + "\n"
