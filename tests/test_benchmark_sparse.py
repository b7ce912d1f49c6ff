"""Smoke tests of the Part IV benchmarks, ``benchmarks/sparse_speed.py`` and
``benchmarks/ring_speed.py``: their quick modes run and write results with the documented
structure; the mask, target and pairing logic is checked on made-up inputs. Nothing here checks
a time (the numbers come from a full run). About 30 s of CPU each on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MASKS = [f"{p} {d}" for p in ("window", "random") for d in ("1/4", "1/8", "1/16")]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sparse_speed():
    return _module("sparse_speed")


@pytest.fixture(scope="module")
def ring_speed():
    return _module("ring_speed")


def _quick(script: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    name = script.removesuffix(".py")
    for suffix in ("md", "png"):
        assert (out / f"{name}.{suffix}").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


# --- sparse_speed.py ------------------------------------------------------------------------


def test_sparse_quick_run_writes_the_documented_structure(tmp_path):
    report = _quick("sparse_speed.py", tmp_path)
    assert report["quick"] is True and report["benchmark"] == "sparse_speed"
    assert report["setting"]["shape"] == [1, 8, "n", 64]  # 4-D: SDPA's fused kernel
    for label in ("dense", "token mask"):
        assert any("flash" in op for op in report["sdpa_ops"][label]), label
    assert {"load_average_start", "load_average_end", "torch"} <= set(report["conditions"])
    sizes = [str(n) for n in report["setting"]["sizes"]]
    assert list(report["time"]) == list(report["ratios"]) == list(report["masks"]) == sizes
    assert list(report["memory_mib"]) == sizes[-1:]  # quick: memory at the largest n only
    for n in sizes:
        assert set(report["masks"][n]) == set(MASKS)
        for name, mask in report["masks"][n].items():
            assert 0 < mask["density"] <= 1 and mask["blocks"] > 0, name
        for workload in ("forward", "train"):
            entries = report["time"][n][workload]
            timed = {name for name, entry in entries.items() if "median_ms" in entry}
            assert {"SDPA", *(f"block-sparse ({m})" for m in MASKS),
                    *(f"SDPA + token mask ({m})" for m in MASKS),
                    *(f"top-k ({d})" for d in ("1/4", "1/8", "1/16")),
                    "LSH (ours)", "LSH (ours, duplicates counted)"} <= timed, (n, workload)
            for name, entry in entries.items():  # every method is timed or says why not
                assert ("median_ms" in entry and entry["times_ms"]) or entry["skipped"], name
            for m in MASKS:  # FlexAttention: compiled not in a quick run, no backward on CPU
                assert "skipped" in entries[f"FlexAttention ({m})"]
            assert report["ratios"][n][workload]["block-sparse (window 1/8) / SDPA"] > 0
        assert "median_ms" in report["time"][n]["forward"]["FlexAttention eager (window 1/8)"]
        assert report["nxn_mib"][n] == 8 * int(n) ** 2 * 4 / 2**20
    memory = report["memory_mib"][sizes[-1]]
    assert memory["train"]["SDPA"] >= 0 and memory["forward"]["block-sparse (window 1/8)"] >= 0
    flex = report["flex"]
    assert flex["eager_forward"].startswith("runs")
    assert flex["backward"].startswith(("runs", "fails"))
    checks = flex["checks"]
    assert checks["kernel"] == "eager" and set(checks["block_mask_equal_to_create_block_mask"]) \
        == set(MASKS)
    assert all(checks["block_mask_equal_to_create_block_mask"].values())
    assert max(checks["max_abs_diff_vs_block_sparse"].values()) < 1e-4
    note = report["peers"]["LSH (reformer-pytorch)"]
    assert note == "timed" or note.startswith("skipped:")
    assert report["targets"] == {}  # n = 16384 is not in a quick run


def test_window_is_the_one_nearest_the_density(sparse_speed):
    assert sparse_speed.window_density(8, 0) == 1 / 8
    assert sparse_speed.window_density(4, 3) == 1.0
    nb = 128
    for inverse in (4, 8, 16):
        w = sparse_speed.nearest_window(nb, 1 / inverse)
        error = abs(sparse_speed.window_density(nb, w) - 1 / inverse)
        assert all(error <= abs(sparse_speed.window_density(nb, o) - 1 / inverse)
                   for o in range(nb))
    masks, info = sparse_speed.make_masks(16384, 128)
    assert set(masks) == set(MASKS)
    for name, mask in masks.items():  # the recorded density is the mask's
        assert info[name]["density"] == pytest.approx(float(mask.float().mean()))
    assert info["random 1/8"]["blocks_per_row"] == 16
    assert all(int(row.sum()) == 16 for row in masks["random 1/8"])


def test_sparse_targets_compare_density_one_eighth_at_16384(sparse_speed):
    ratios = {"forward": {"block-sparse (window 1/8) / SDPA": 0.2,
                          "FlexAttention (window 1/8) / SDPA": 0.15,
                          "block-sparse (random 1/8) / SDPA": 0.35},
              "train": {"block-sparse (window 1/8) / SDPA": 0.25}}
    targets = sparse_speed.check_targets({"ratios": {"16384": ratios}})
    window = targets["block-sparse (window 1/8) / SDPA, forward, n=16384"]
    assert window == {"measured": 0.2, "limit": 0.3, "met": True, "flex_attention": 0.15}
    random = targets["block-sparse (random 1/8) / SDPA, forward, n=16384"]
    assert random["met"] is False and random["flex_attention"] is None
    assert targets["block-sparse (window 1/8) / SDPA, train, n=16384"]["met"] is True
    assert len(targets) == 3
    assert sparse_speed.check_targets({"ratios": {"4096": ratios}}) == {}


# --- ring_speed.py --------------------------------------------------------------------------


def test_ring_quick_run_writes_the_documented_structure(tmp_path):
    report = _quick("ring_speed.py", tmp_path)
    assert report["quick"] is True and report["benchmark"] == "ring_speed"
    configs = ["tiled", "ring p=1", "ring p=2", "ring p=4"]
    sizes = [str(n) for n in report["setting"]["sizes"]]
    passes = report["setting"]["passes"]
    for n in sizes:
        for config in configs:
            for workload in ("forward", "train"):
                entry = report["time"][n][config][workload]
                assert entry["median_ms"] > 0 and len(entry["times_ms"]) == passes
                memory = report["memory_mib"][n][config][workload]
                assert memory["rss_peak"] == pytest.approx(memory["inputs"] + memory["rss_extra"],
                                                           abs=1e-6)
                assert memory["tensor_extra"] > 0
        for workload in ("forward", "train"):
            assert set(report["ratios"][n][workload]) >= {"ring p=2 / tiled", "ring p=4 / tiled"}
            assert report["memory_mib"][n]["ring p=4"][workload]["inputs"] == pytest.approx(
                report["memory_mib"][n]["tiled"][workload]["inputs"] / 4)
        for config, sent in report["bytes_sent"][n].items():  # counted = closed form
            assert sent["forward"] == sent["formula_forward"], (n, config)
            assert sent["train"] == sent["formula_train"], (n, config)
        assert report["bytes_sent"][n]["ring p=1"]["train"] == 0
    assert report["context_parallel"]["note"].startswith("not tried")
    assert len(report["targets"]) == 8  # p = 2, 4 x RSS, tensors x forward, train
    for entry in report["targets"].values():
        assert set(entry["excess_mib"]) == set(sizes) and entry["limit"] == 1.1


def test_ring_target_is_the_slope_over_tiled_over_p(ring_speed):
    def memory(tiled, ring2, ring4):
        return {kind: {"forward": {"rss_peak": value, "tensor_peak": value},
                       "train": {"rss_peak": value, "tensor_peak": value}}
                for kind, value in (("tiled", tiled), ("ring p=2", ring2), ("ring p=4", ring4))}

    report = {"setting": {"sizes": [1024, 4096]},
              "memory_mib": {"1024": memory(100.0, 60.0, 40.0),  # tiled/p + 10, + 15
                             "4096": memory(400.0, 210.0, 250.0)}}  # + 10 ; + 150
    targets = ring_speed.check_targets(report)
    p2 = targets["ring p=2 peak per rank <= tiled / p + constant (rss, train)"]
    assert p2["slope"] == pytest.approx(1.0) and p2["met"] is True
    assert p2["excess_mib"] == {"1024": pytest.approx(10.0), "4096": pytest.approx(10.0)}
    p4 = targets["ring p=4 peak per rank <= tiled / p + constant (tensor, forward)"]
    assert p4["slope"] == pytest.approx(210.0 / 75.0) and p4["met"] is False
    assert p4["ratio_to_tiled_over_p"]["4096"] == pytest.approx(2.5)


def test_ring_samples_are_the_slowest_rank_paired_by_pass(ring_speed):
    def rank(config_times):
        return {"times": {key: (0.1, (t,)) for key, t in config_times.items()}}

    passes = []
    for scale in (1.0, 2.0):  # the second pass twice as slow for everyone
        ranks = {1: [rank({("tiled", w): scale * 1.0 for w in ("forward", "train")}
                          | {("ring p=1", w): scale * 1.5 for w in ("forward", "train")})]}
        for p in (2, 4):
            ranks[p] = [rank({(f"ring p={p}", w): scale * (2.0 + r) for w in ("forward", "train")})
                        for r in range(p)]
        passes.append(ranks)
    summary, timings = ring_speed.collect(passes)
    assert summary["ring p=4"]["train"]["times_ms"] == pytest.approx([5000.0, 10000.0])
    ratios = ring_speed.compute_ratios(timings)
    assert ratios["forward"]["ring p=4 / tiled"] == pytest.approx(5.0)  # per pass: 5, 5
    assert ratios["forward"]["ring p=2 / ring p=1"] == pytest.approx(2.0)


def test_committed_reformer_run_supports_the_readme():
    """benchmarks/README.md quotes the run with reformer-pytorch importable
    (results/sparse_speed_reformer/): its ranges must be those of the stored ratios."""
    run = json.loads((ROOT / "benchmarks" / "results" / "sparse_speed_reformer"
                      / "sparse_speed.json").read_text())
    assert run["peers"] == {"LSH (reformer-pytorch)": "timed"} and not run["quick"]
    sizes = [str(n) for n in run["setting"]["sizes"]]
    assert sizes == ["1024", "2048", "4096"]

    def ratios(workload, label):
        return [run["ratios"][n][workload][label] for n in sizes]

    counted = "LSH (ours, duplicates counted) / LSH (reformer-pytorch)"
    exact = "LSH (ours) / LSH (reformer-pytorch)"
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for low, high, values in (
            (1.02, 1.16, ratios("forward", counted)), (0.86, 0.97, ratios("train", counted)),
            (1.9, 2.4, ratios("forward", exact)), (1.3, 1.5, ratios("train", exact))):
        assert round(min(values), len(str(low)) - 2) == low, values
        assert round(max(values), len(str(high)) - 2) == high, values
        assert f"{low}" in readme and f"{high}" in readme
    # both LSH implementations slower than dense SDPA at every length, both workloads
    for n in sizes:
        for workload in ("forward", "train"):
            times = run["time"][n][workload]
            assert times["LSH (reformer-pytorch)"]["median_ms"] > times["SDPA"]["median_ms"]
            assert times["LSH (ours)"]["median_ms"] > times["SDPA"]["median_ms"]


def test_the_end_load_counts_only_work_beside_the_run(sparse_speed):
    """A run of two threads that ends alone shows a load of about 2: not preliminary; one
    that other work joined shows more."""
    assert not sparse_speed.joined_by_other_work([1.94, 1.96, 2.3], threads=2)
    assert not sparse_speed.joined_by_other_work(None, threads=2)
    assert sparse_speed.joined_by_other_work([3.5, 2.2, 2.0], threads=2)
    assert sparse_speed.joined_by_other_work([2.1, 3.2, 2.0], threads=2)
    assert sparse_speed.joined_by_other_work([2.5, 1.0, 1.0], threads=1)
