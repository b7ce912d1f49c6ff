"""Smoke test of ``benchmarks/decode_speed.py``: its quick mode writes what
``book/kv_cache.ipynb`` reads, and the states it times are the states the library builds.
No time is checked (the numbers come from a full run of the script, not from tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import efficient_attention as ea

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "decode_speed.py"
METHODS = ["mha", "sdpa_mha", "gqa", "mqa", "window", "linear", "gated"]
DIAGNOSTICS = ["mha_1thread", "gqa_1thread", "mqa_1thread"]  # the same steps on one thread
CACHES = ["mha", "sdpa_mha", "gqa", "mqa", "window"]  # the steps that read a KV cache


@pytest.fixture(scope="module")
def decode_speed():
    spec = importlib.util.spec_from_file_location("decode_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_times_and_exact_state_sizes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    command = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path),
               "--sizes", "64", "1100"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "decode_speed.json").read_text())
    assert report["quick"] is True and report["conditions"]["load_average_end"]
    assert report["setting"]["sizes"] == [64, 1100] and report["setting"]["window"] == 1024
    assert sorted(report["methods"]) == sorted(METHODS) and report["skipped"] == {}
    assert sorted(report["diagnostics"]) == sorted(DIAGNOSTICS)
    repeats = report["setting"]["repeats"]
    for n in ("64", "1100"):
        for name in METHODS + DIAGNOSTICS:
            entry = report["time"][n][name]
            assert entry["median_ms"] > 0 and len(entry["times_ms"]) == repeats
        assert report["ratios"][n]["mha / mha"] == 1.0
        assert set(report["ratios"][n]) == {f"{name} / mha" for name in METHODS + DIAGNOSTICS}
    number = 4  # float32 bytes; 8 query heads of 64
    for n in (64, 1100):
        held = report["state_bytes"][str(n)]
        assert held["mha"] == held["sdpa_mha"] == 2 * 8 * n * 64 * number
        assert held["gqa"] == 2 * 2 * n * 64 * number and held["mqa"] == 2 * n * 64 * number
        assert held["window"] == 2 * 8 * min(n, 1025) * 64 * number  # w + 1 positions
        assert held["linear"] == 8 * (64 * 64 + 64) * number  # S and z
        assert held["gated"] == 8 * 64 * 64 * number
    assert set(report["growth"]) == set(METHODS)
    # the roofline of every cache step: bytes of keys and values read, 4 h_q d m operations
    for n in (64, 1100):
        memory = report["memory"][str(n)]
        assert memory["bytes"] == 2 * 8 * n * 64 * number  # the MHA cache's bytes
        for name, moved in (("read", 1), ("copy", 2)):
            entry = memory[name]
            assert len(entry["times_ms"]) == repeats
            assert entry["gbs"] == pytest.approx(moved * memory["bytes"] / entry["median_ms"] / 1e6)
        rows = report["roofline"][str(n)]
        assert set(rows) == set(CACHES + DIAGNOSTICS)
        for name, row in rows.items():
            heads = {"gqa": 2, "mqa": 1}.get(name.removesuffix("_1thread"), 8)
            positions = min(n + 1, 1025) if name == "window" else n + 1
            seconds = report["time"][str(n)][name]["median_ms"] / 1e3
            assert row["positions"] == positions
            assert row["bytes_read"] == 2 * heads * positions * 64 * number
            assert row["flop"] == 4 * 8 * 64 * positions
            assert row["intensity"] == pytest.approx(8 / heads / 2)  # 2 h_q / (h_kv b)
            assert row["gbs"] == pytest.approx(row["bytes_read"] / seconds / 1e9)
            assert row["gflops"] == pytest.approx(row["flop"] / seconds / 1e9)
    for name, threads in (("matmul", 2), ("matmul_1thread", 1)):
        entry = report["machine"][name]
        assert entry["threads"] == threads and entry["flop"] == 2 * entry["size"] ** 3
        assert len(entry["times_ms"]) == repeats
        assert entry["gflops"] == pytest.approx(entry["flop"] / entry["median_ms"] / 1e6)
    for suffix in ("md", "png"):
        assert (tmp_path / f"decode_speed.{suffix}").stat().st_size > 0


def test_prefilled_states_are_those_of_the_library(decode_speed, monkeypatch):
    monkeypatch.setattr(decode_speed, "HEADS", 2)
    monkeypatch.setattr(decode_speed, "HEAD_DIM", 4)
    n = 9
    rnn = decode_speed.linear_state(n, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, n, 4, generator=gen) for _ in range(2))
    stepped = ea.RecurrentLinearAttention(ea.elu_feature_map)
    stepped(k, k, v)
    torch.testing.assert_close(rnn.state, stepped.state)
    torch.testing.assert_close(rnn.normalizer, stepped.normalizer)

    from efficient_attention.recurrent import gated_linear_attention

    state, new_log_decay = decode_speed.gated_state(n, torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 2, n, 4, generator=gen) for _ in range(2))
    log_decay = torch.nn.functional.logsigmoid(torch.randn(1, 2, n + 1, 4, generator=gen)) / 16
    _, expected = gated_linear_attention(k, k, v, log_decay[..., :n, :], return_state=True,
                                         form="recurrent")
    torch.testing.assert_close(state, expected)
    assert torch.equal(new_log_decay, log_decay[..., n, :]) and (new_log_decay < 0).all()


def test_cache_steps_see_exactly_n_tokens(decode_speed):
    gen = torch.Generator().manual_seed(3)
    cache = decode_speed.filled(ea.KVCache(2000), 1500, 1, gen)  # two prefill blocks
    token = decode_speed.random_token(gen, 1)
    step = decode_speed.cache_step(cache, token, 1500)
    first, second = step(), step()
    assert cache.length == 1501 and torch.equal(first, second)  # rewound before each call
    keys = torch.cat([cache.keys[:, :, :1500], token["k"]], dim=2)
    values = torch.cat([cache.values[:, :, :1500], token["v"]], dim=2)
    expected = ea.softmax_attention(token["q"], keys, values)  # broadcast over 8 query heads
    torch.testing.assert_close(first, expected)


def test_one_thread_diagnostic_runs_the_same_step_and_restores_the_threads(decode_speed):
    threads = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(decode_speed.THREADS)
        call = decode_speed.one_thread(lambda: seen.append(torch.get_num_threads()) or 7)
        assert call() == 7 and seen == [1]
        assert torch.get_num_threads() == decode_speed.THREADS
    finally:
        torch.set_num_threads(threads)
