"""Smoke tests of the benchmark scripts behind ``make bench`` and the comparison chapter.

Each script runs in its quick mode (small sizes, a few seconds) into a temporary folder, and
its JSON must have the structure of the committed results in ``benchmarks/results/``, which
``book/comparison.ipynb`` reads. Nothing here checks a time: the numbers are measured by
``make bench``, not by tests. About 40 s on two cores.
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
COMMITTED = BENCHMARKS / "results"


def _run(script: str, out: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    command = [sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


@pytest.fixture(scope="module")
def attention_speed():
    path = BENCHMARKS / "attention_speed.py"
    spec = importlib.util.spec_from_file_location("attention_speed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LIBRARY_METHODS = ["naive softmax", "SDPA", "SDPA causal", "linear (elu+1)", "FAVOR+",
                   "FAVOR+ causal", "Nystrom (64 landmarks)", "banded (w=32)"]


def test_attention_speed_quick_run_times_forward_and_training_step(tmp_path):
    _run("attention_speed.py", tmp_path, "--sizes", "128", "256", "--repeats", "2")
    report = _load(tmp_path, "attention_speed.json")
    assert list(report["results"]) == ["128", "256"]
    assert report["shape"] == [1, 8, "n", 64]  # 4-D, the layout that reaches the fused kernel
    assert len(report["loadavg_start"]) == 3 and len(report["loadavg_end"]) == 3
    for n, row in report["results"].items():
        for mode in ("forward", "train"):
            for name in LIBRARY_METHODS:
                assert row[mode]["time"][name]["median_s"] > 0, (n, mode, name)
            assert row[mode]["ratios"]["FAVOR+ / SDPA"] > 0
            # causal methods are compared with causal SDPA, never with the bidirectional one
            assert row[mode]["ratios"]["FAVOR+ causal / SDPA causal"] > 0
            assert not any(label.endswith("/ SDPA") and "causal" in label.split(" / ")[0]
                           and label != "SDPA causal / SDPA"
                           for label in row[mode]["ratios"]), row[mode]["ratios"]
        assert row["forward"]["time"]["floor (2 matmuls)"]["median_s"] > 0
        assert "floor (2 matmuls)" not in row["train"]["time"]  # nothing to differentiate
    # quick mode probes memory at the largest n only, for both workloads
    for mode in ("forward", "train"):
        for name in ("SDPA", "SDPA causal"):
            assert report["results"]["256"][mode]["memory"][name]["peak_extra_mib"] >= 0
        assert "memory" not in report["results"]["128"][mode]
    for layout in ("4-D (benchmark)", "4-D causal (benchmark)"):
        assert any("flash" in op for op in report["sdpa_kernels"][layout]["train"]), layout
    assert report["quick"] is True and report["conditions"]["load_average_end"]
    for name, note in report["peers"].items():  # every public peer is timed or says why not
        assert note == "timed" or note.startswith("skipped:"), (name, note)
        assert (name in report["methods"]) == (note == "timed")
    for suffix in ("md", "png"):
        assert (tmp_path / f"attention_speed.{suffix}").stat().st_size > 0
    assert "FAVOR+ causal / SDPA causal" in (tmp_path / "attention_speed.md").read_text()
    assert not list(tmp_path.glob("*.tmp"))  # written through a .tmp file, then moved


def test_sdpa_check_accepts_4d_and_rejects_the_3d_fallback(attention_speed):
    fused = attention_speed.sdpa_kernels((1, 2, 32, 8))
    unfused = attention_speed.sdpa_kernels((2, 32, 8))
    assert all(attention_speed.is_fused(ops) for ops in fused.values()), fused
    assert not any(attention_speed.is_fused(ops) for ops in unfused.values()), unfused
    attention_speed.check_sdpa_is_fused({"4-D (benchmark)": fused})  # passes
    with pytest.raises(SystemExit, match="no fused kernel"):
        attention_speed.check_sdpa_is_fused({"4-D (benchmark)": unfused})
    causal = attention_speed.sdpa_kernels((1, 2, 32, 8), causal=True)
    attention_speed.check_sdpa_is_fused({"4-D (benchmark)": fused,
                                         "4-D causal (benchmark)": causal})  # passes
    with pytest.raises(SystemExit, match="causal"):
        attention_speed.check_sdpa_is_fused({"4-D (benchmark)": fused,
                                             "4-D causal (benchmark)": unfused})


def test_sdpa_memory_check_stops_on_quadratic_memory(attention_speed):
    n = 4096
    one_matrix_per_head = 8 * n * n * 4 / 2**20  # MiB: what an unfused kernel keeps at least
    linear = {mode: {"SDPA": {"peak_extra_mib": 40.0}, "SDPA causal": {"peak_extra_mib": 30.0}}
              for mode in ("forward", "train")}
    assert len(attention_speed.check_sdpa_memory(n, linear)) == 4
    for name in ("SDPA", "SDPA causal"):
        quadratic = {"forward": {name: {"peak_extra_mib": one_matrix_per_head}}}
        with pytest.raises(SystemExit, match=f"{name} forward .*fused kernel was not used"):
            attention_speed.check_sdpa_memory(n, quadratic)


def test_wait_policy_probe_times_both_policies_in_fresh_processes(attention_speed):
    result = attention_speed.compare_wait_policies(256, 1)
    assert list(result) == ["PASSIVE", "ACTIVE"]
    for policy, entry in result.items():
        assert "error" not in entry, (policy, entry)
        assert set(entry["time"]) == set(attention_speed.POLICY_METHODS)
        assert entry["ratios"]["FAVOR+ / floor"] > 0


def test_targets_include_each_wait_policy(attention_speed):
    report = {
        "results": {"8192": {"forward": {
            "ratios": {"FAVOR+ / floor": 3.0, "FAVOR+ causal / FAVOR+": 1.7},
            "memory": {"FAVOR+": {"peak_extra_mib": 40.0}}}}},
        "wait_policies": {
            "PASSIVE": {"ratios": {"FAVOR+ / floor": 3.5, "FAVOR+ causal / FAVOR+": 2.1}},
            "ACTIVE": {"ratios": {"FAVOR+ / floor": 2.2, "FAVOR+ causal / FAVOR+": 1.9}}},
    }
    targets = attention_speed.check_targets(report)
    assert targets["FAVOR+ / floor"] == {"measured": 3.0, "limit": 2.5, "met": False}
    assert targets["FAVOR+ causal / FAVOR+"] == {"measured": 1.7, "limit": 2.0, "met": True}
    assert targets["FAVOR+ peak extra memory (MiB)"]["met"] is True
    assert targets["FAVOR+ / floor, OMP_WAIT_POLICY=PASSIVE probe"]["met"] is False
    assert targets["FAVOR+ / floor, OMP_WAIT_POLICY=ACTIVE probe"]["met"] is True
    assert targets["FAVOR+ causal / FAVOR+, OMP_WAIT_POLICY=PASSIVE probe"]["met"] is False
    assert targets["FAVOR+ causal / FAVOR+, OMP_WAIT_POLICY=ACTIVE probe"]["met"] is True
    assert "FAVOR+ / performer-pytorch" not in targets  # not measured: no row, no false verdict


def test_committed_speed_results_have_what_the_chapter_reads():
    report = _load(COMMITTED, "attention_speed.json")
    assert "8192" in report["results"] and report["shape"] == [1, 8, "n", 64]
    assert set(report["wait_policies"]) == {"PASSIVE", "ACTIVE"}
    assert all(name in report["methods"] for name in LIBRARY_METHODS)
    for mode in ("forward", "train"):
        assert "flash" in " ".join(report["sdpa_kernels"]["4-D (benchmark)"][mode])
        for name in LIBRARY_METHODS:
            assert "median_s" in report["results"]["8192"][mode]["time"][name] or \
                name == "naive softmax", (mode, name)


def test_train_models_quick_run_matches_the_committed_structure(tmp_path):
    _run("train_models.py", tmp_path, "--no-progress")
    quick, committed = _load(tmp_path, "train_models.json"), _load(COMMITTED, "train_models.json")
    assert quick.keys() == committed.keys()
    def shape(report):  # task -> mode -> attention kinds
        return {task: {mode: sorted(kinds) for mode, kinds in modes.items()}
                for task, modes in report["runs"].items()}

    assert shape(quick) == shape(committed)
    for task in quick["runs"].values():
        for mode in task.values():
            for kind, run in mode.items():
                if run["status"] == "trained":
                    assert len(run["loss"]) > 0 and 0 <= run["eval_accuracy"] <= 1, kind
                else:
                    assert run["reason"], kind


def test_approximation_error_quick_run_matches_the_committed_structure(tmp_path):
    _run("approximation_error.py", tmp_path, "--no-progress")
    quick = _load(tmp_path, "approximation_error.json")
    committed = _load(COMMITTED, "approximation_error.json")
    assert sorted(quick["regimes"]) == sorted(committed["regimes"])
    assert sorted(quick["methods"]) == sorted(committed["methods"])
    for name, regime in quick["regimes"].items():
        assert regime.keys() == committed["regimes"][name].keys(), name
        uniform = regime["methods"]["uniform"]["mean"]
        assert all(abs(value - 1) < 1e-9 for value in uniform), name  # the baseline scores 1


def test_tiled_attention_quick_run_matches_the_committed_structure(tmp_path):
    _run("tiled_attention.py", tmp_path)
    quick = _load(tmp_path, "tiled_attention.json")
    committed = _load(COMMITTED, "tiled_attention.json")
    assert quick.keys() == committed.keys()
    assert quick["setting"].keys() == committed["setting"].keys()
    assert quick["tile_sweep"].keys() == committed["tile_sweep"].keys()
    assert quick["conditions"]["load_average_start"] and quick["quick"] is True
    cases = ["forward", "forward_causal", "training_step", "training_step_causal"]
    for report in (quick, committed):
        assert list(report["time"]) == [str(n) for n in report["setting"]["time_sizes"]]
        for n, row in report["time"].items():
            assert list(row) == cases, n
            for case, entries in row.items():
                assert {"SDPA", "tiled"} <= set(entries), (n, case)
                assert all(entry["median_ms"] > 0 for entry in entries.values()), (n, case)
                assert report["ratios"][n][f"{case} tiled / SDPA"] > 0, (n, case)
        assert list(report["memory_mib"]) == [str(n) for n in report["setting"]["memory_sizes"]]
        for n, row in report["memory_mib"].items():
            assert list(row) == ["forward", "training_step_causal"], n
            assert all(row[case]["tiled"] >= 0 and "SDPA" in row[case] for case in row), n
        sweep = report["tile_sweep"]
        assert len(sweep["block_sizes"]) == len(sweep["median_ms"]) == len(
            sweep["tiled_over_sdpa"])
    for suffix in ("md", "png"):
        assert (tmp_path / f"tiled_attention.{suffix}").stat().st_size > 0


def test_committed_tiled_results_have_what_the_chapter_reads():
    report = _load(COMMITTED, "tiled_attention.json")
    assert report["quick"] is False
    assert "8192" in report["time"] and {"8192", "16384"} <= set(report["memory_mib"])
    assert set(report["targets"]) == {
        "forward tiled / SDPA at n = 8192",
        "forward tiled memory growth 16384 / 8192",
        "training_step_causal tiled memory growth 16384 / 8192",
    }
    assert report["setting"]["block_size"] == report["tile_sweep"]["default"]


@pytest.fixture(scope="module")
def results_writer():
    spec = importlib.util.spec_from_file_location("_results", BENCHMARKS / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_writer_writes_every_file_and_leaves_no_tmp(results_writer, tmp_path):
    plt = results_writer.pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    data = {"quick": True, "conditions": results_writer.run_conditions(), "x": [1.5]}
    data["conditions"].update(results_writer.run_conditions(end=True))
    written = results_writer.write_results("demo", data, out=tmp_path / "sub",
                                           markdown="# demo", figure=fig)
    assert set(written) == {"json", "md", "png"}
    assert json.loads(written["json"].read_text()) == data
    assert written["md"].read_text() == "# demo\n"
    assert written["png"].read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [
        "demo.json", "demo.md", "demo.png"]
    for key in ("torch", "cpu_count", "omp_wait_policy", "load_average_start",
                "load_average_end", "started", "finished"):
        assert key in data["conditions"], key


def test_results_writer_keeps_quick_runs_out_of_the_committed_folder(results_writer):
    committed = results_writer.RESULTS_DIR
    assert committed == COMMITTED
    assert results_writer.output_folder(False, None) == committed
    scratch = results_writer.output_folder(True, None)
    assert scratch.is_dir() and scratch.resolve() != committed
    scratch.rmdir()
    with pytest.raises(ValueError, match="out: a quick run"):
        results_writer.output_folder(True, committed)
    with pytest.raises(ValueError, match="out: a quick run"):
        results_writer.write_results("never_written", {"conditions": {"quick": True}})
    assert not (committed / "never_written.json").exists()


def test_results_writer_leaves_the_old_file_when_serialising_fails(results_writer, tmp_path):
    path = results_writer.write_json(tmp_path / "r.json", {"ok": 1})
    with pytest.raises(TypeError):
        results_writer.write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert not list(tmp_path.glob("*.tmp"))
