"""Smoke test of ``benchmarks/recurrent_speed.py``: its quick mode runs and writes results
with the documented structure; its crossover and target logic is checked on made-up
ratios. Nothing here checks a time (the numbers come from a full run on an idle machine).
About 20 s on two cores.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "recurrent_speed.py"
METHODS = ["gated chunkwise", "gated per-channel", "gated recurrent", "gated parallel",
           "delta chunkwise", "causal linear", "SDPA causal"]


@pytest.fixture(scope="module")
def recurrent_speed():
    spec = importlib.util.spec_from_file_location("recurrent_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_the_documented_structure(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    report = json.loads((tmp_path / "recurrent_speed.json").read_text())
    assert report["quick"] is True and report["benchmark"] == "recurrent_speed"
    assert report["setting"]["shape"] == [1, 8, "n", 64]  # 4-D: SDPA's fused kernel
    assert any("flash" in op for op in report["sdpa_ops"])
    assert {"load_average_start", "load_average_end", "torch"} <= set(report["conditions"])
    sizes = [str(n) for n in report["setting"]["sizes"]]
    assert list(report["time"]) == list(report["ratios"]) == list(report["memory_mib"]) == sizes
    for n in sizes:
        for workload in ("forward", "train"):
            entries = report["time"][n][workload]
            assert set(entries) == set(METHODS), (n, workload)
            for name in METHODS:  # quick sizes are below every method's limit
                assert entries[name]["median_ms"] > 0 and entries[name]["times_ms"], name
                assert report["memory_mib"][n][workload][name] >= 0, name
            ratios = report["ratios"][n][workload]
            assert ratios["gated chunkwise / causal linear"] > 0
            assert ratios["gated chunkwise / SDPA causal"] > 0
        assert report["nxn_mib"][n] == 8 * int(n) ** 2 * 4 / 2**20
    sweep = report["chunk_sweep"]
    assert set(sweep["median_ms"]) == {"gated chunkwise", "gated per-channel",
                                       "delta chunkwise"}
    for name, medians in sweep["median_ms"].items():
        assert str(sweep["default"][name]) in medians  # the default was measured
        assert str(sweep["fastest"][name]) in medians
    assert set(report["crossover"]) == {"forward", "train"}
    assert report["targets"] == {}  # n = 8192 is not in a quick run
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"recurrent_speed.{suffix}").stat().st_size > 0


def test_crossover_is_where_gated_stays_faster_than_sdpa(recurrent_speed):
    def report(values):
        return {"ratios": {str(n): {"forward": {"gated chunkwise / SDPA causal": r}}
                           for n, r in values.items()}}

    crossover = recurrent_speed.crossover
    assert crossover(report({512: 1.2, 1024: 0.9, 2048: 1.1, 4096: 0.8, 8192: 0.5}),
                     "forward") == 4096
    assert crossover(report({512: 0.9, 1024: 0.8}), "forward") == 512
    assert crossover(report({512: 0.9, 1024: 1.2}), "forward") is None


def test_target_is_checked_at_n_8192(recurrent_speed):
    label = "gated chunkwise / causal linear at n=8192"
    for ratio, met in ((1.3, True), (1.6, False)):
        report = {"ratios": {"8192": {"forward": {"gated chunkwise / causal linear": ratio}}}}
        assert recurrent_speed.check_targets(report) == {
            label: {"measured": ratio, "limit": 1.5, "met": met}}
    assert recurrent_speed.check_targets({"ratios": {"512": {"forward": {}}}}) == {}


def _train_recurrent_module(monkeypatch, name: str):
    """benchmarks/train_recurrent.py imported as module ``name`` (its siblings ``_timing`` and
    ``_results`` on ``sys.path`` for the test)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name,
                                                  ROOT / "benchmarks" / "train_recurrent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_recurrent(out: Path, *options: str) -> dict:
    """benchmarks/train_recurrent.py --quick with ``options``, writing into ``out``."""
    script = ROOT / "benchmarks" / "train_recurrent.py"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out),
                           "--no-progress", *options],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads((out / "train_recurrent.json").read_text())


@pytest.fixture(scope="module")
def train_recurrent_quick(tmp_path_factory) -> dict:
    return _train_recurrent(tmp_path_factory.mktemp("train_recurrent"))


def test_train_recurrent_quick_run_matches_the_committed_structure(train_recurrent_quick):
    """benchmarks/train_recurrent.py (the recall the gated chapter and the comparison read):
    its quick mode trains every kind and seed of the committed results, with sane values."""
    quick = train_recurrent_quick
    committed = json.loads((ROOT / "benchmarks/results/train_recurrent.json").read_text())
    assert quick.keys() == committed.keys()
    assert quick["config"]["attention_kinds"] == committed["config"]["attention_kinds"]
    assert sorted(quick["runs"]) == sorted(committed["runs"]) == sorted(quick["summary"])
    assert {"gated", "delta", "linear", "softmax"} <= set(quick["runs"])
    assert quick["config"]["models"] == list(quick["runs"])  # the kinds and the variants
    assert set(quick["config"]["variants"]) <= set(quick["runs"])
    queries = quick["config"]["evaluation"]["batch_size"]
    for runs in quick["runs"].values():
        for run in runs:  # one answer per held-out query, giving the stored accuracy
            assert len(run["eval_correct"]) == queries and set(run["eval_correct"]) <= {"0", "1"}
            assert run["eval_correct"].count("1") / queries == pytest.approx(run["eval_accuracy"])
    timing = quick["step_timing"]
    assert set(timing["time"]) == set(quick["runs"])
    assert set(timing["ratio_to_softmax"]) == set(quick["runs"]) - {"softmax"}
    for ratio in timing["ratio_to_softmax"].values():
        assert len(ratio["per_round"]) == timing["rounds"] and ratio["median"] > 0
    capacity = quick["capacity"]
    assert set(capacity["rules"]) == {"sum", "delta"}
    for measured in capacity["rules"].values():
        assert len(measured["error"]) == len(measured["accuracy"]) == len(capacity["widths"])
    assert capacity["bound"] == [max(0.0, 1 - d / capacity["facts"]) for d in capacity["widths"]]


def test_short_convolution_looks_back_only(monkeypatch):
    """The short convolution of train_recurrent.py: causal, width 4, one weight per channel,
    head and shift, then SiLU; with the weight 1 on the current token it is SiLU alone."""
    import torch

    module = _train_recurrent_module(monkeypatch, "train_recurrent_module")
    seen = {}

    def inner(q, k, v, *, causal, key_padding_mask=None):
        seen.update(q=q, k=k, v=v, causal=causal)
        return v

    conv = module.ShortConvolution(inner, num_heads=2, dim_head=3, width=4)
    q, k, v = torch.randn(3, 5, 2, 10, 3, dtype=torch.float64).unbind(0)
    conv.double()
    out = conv(q, k, v, causal=True)
    changed = v.clone()
    changed[..., 6:, :] += 1.0  # later tokens change: the first six outputs do not
    assert torch.equal(conv(q, k, changed, causal=True)[..., :6, :], out[..., :6, :])
    expected = sum(conv.weight[2, ..., s] * torch.nn.functional.pad(v, (0, 0, s, 0))[..., :10, :]
                   for s in range(4))  # x_{t-s}, zero before the sequence
    assert torch.allclose(out, torch.nn.functional.silu(expected))
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[..., 0] = 1.0
    assert torch.allclose(conv(q, k, v, causal=True), torch.nn.functional.silu(v))
    assert seen["causal"] is True
    with pytest.raises(ValueError):
        conv(q, k, v, causal=False)


def test_output_gate_normalises_each_head_then_gates(monkeypatch):
    """The output gate of train_recurrent.py equals, in float64, the formula written out:
    ``W_O (RMSNorm(o_t) * silu(W_g x_t))`` with RMSNorm over each head's channels."""
    import torch

    import efficient_attention as ea

    module = _train_recurrent_module(monkeypatch, "train_recurrent_gate")
    torch.manual_seed(0)
    heads = ea.MultiHeadAttention(12, 3).double()
    w_q, w_k, w_v = (p.weight.detach().clone() for p in (heads.q_proj, heads.k_proj,
                                                          heads.v_proj))
    b_q, b_k, b_v = (p.bias.detach().clone() for p in (heads.q_proj, heads.k_proj,
                                                        heads.v_proj))
    gated = module.OutputGate(heads).double()
    with torch.no_grad():
        gated.heads.attention.norm.weight.uniform_(0.5, 1.5)  # not the initial ones
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    out = gated(x, causal=True)

    def split(y):  # (2, 7, 12) -> (2, 3, 7, 4)
        return y.reshape(2, 7, 3, 4).transpose(1, 2)

    q, k, v = split(x @ w_q.T + b_q), split(x @ w_k.T + b_k), split(x @ w_v.T + b_v)
    scores = q @ k.transpose(-2, -1) / 2.0  # sqrt(d_head) = 2
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    o = scores.softmax(-1) @ v  # (2, 3, 7, 4)
    weight = gated.heads.attention.norm.weight.detach()
    normalised = o / torch.sqrt((o**2).mean(-1, keepdim=True) + 1e-6) * weight
    merged = normalised.transpose(1, 2).reshape(2, 7, 12)
    gate = torch.nn.functional.silu(x @ gated.gate.weight.detach().T)
    expected = (merged * gate) @ gated.out_proj.weight.detach().T + gated.out_proj.bias.detach()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert isinstance(gated.heads.out_proj, torch.nn.Identity)  # W_O applied once, after the gate


def test_train_recurrent_adds_a_model_to_an_earlier_run(train_recurrent_quick, tmp_path,
                                                       monkeypatch, capsys):
    """--add-to: a model trained into an earlier run gives the runs a full run gives it (the
    training is deterministic), keeps the earlier runs of the others, checks that by training
    one of them again, and times every model's step anew; a changed setting is refused."""
    added = "gated delta, output gate"
    earlier = copy.deepcopy(train_recurrent_quick)
    del earlier["runs"][added], earlier["summary"][added]
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    merged = _train_recurrent(tmp_path / "merged", "--add-to", str(tmp_path / "earlier.json"),
                              "--models", added)
    full = train_recurrent_quick
    assert list(merged["runs"]) == full["config"]["models"]
    for kind, runs in full["runs"].items():
        assert [r["eval_correct"] for r in merged["runs"][kind]] == [
            r["eval_correct"] for r in runs], kind
    provenance = merged["conditions"]["earlier"]
    assert provenance["models"] == [k for k in full["config"]["models"] if k != added]
    assert provenance["reproduced"]["identical"] is True
    assert set(merged["step_timing"]["time"]) == set(full["runs"])
    assert merged["capacity"] == full["capacity"]
    # an earlier run made with other settings is refused, and --models needs --add-to: the
    # script's main, called here (both refusals come before any training; a process of its
    # own would spend its time importing torch), must exit with the message
    import torch

    earlier["config"]["training"]["lr"] *= 2
    (tmp_path / "other.json").write_text(json.dumps(earlier))
    module = _train_recurrent_module(monkeypatch, "train_recurrent_refusals")
    threads = torch.get_num_threads()  # main sets two threads before it reads --add-to
    for options, message in (
            (["--add-to", str(tmp_path / "other.json"), "--models", added],
             "--add-to: " + str(tmp_path / "other.json") + " has config['training']"),
            (["--models", added], "--models and --add-to go together")):
        try:
            with pytest.raises(SystemExit) as refused:
                module.main(["--quick", "--no-progress", "--out", str(tmp_path / "refused"),
                             *options])
        finally:
            torch.set_num_threads(threads)
        said = capsys.readouterr().err + str(refused.value.code)  # argparse's, or the exit's
        assert refused.value.code not in (0, None) and message in said, said[-2000:]
