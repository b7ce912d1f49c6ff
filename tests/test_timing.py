"""benchmarks/_timing.py, the one timing module of the benchmark scripts.

Driven by a fake clock: each call advances it by a set cost, so medians and ratios are exact
and nothing sleeps. The order of the calls (warm-up, then rounds taking turns), the rounds a
slow call gets, the paired ratio (median over rounds of the ratio of one round's two calls),
the minimum of ``fastest`` with its untimed preparation, and the thread settings recorded with
the results are checked; so is that every benchmark script times through the module.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = ("attention_speed.py", "recurrent_speed.py", "decode_speed.py", "tiled_attention.py",
           "train_models.py", "train_recurrent.py", "sparse_speed.py", "ring_speed.py",
           "gpu_speed.py")


def _load(name: str):
    """A module of benchmarks/ by path, registered under its name (dataclasses need that)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


timing = _load("_timing")


class FakeClock:
    """A clock that only moves when a fake call spends time on it."""

    def __init__(self):
        self.now = 100.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def call(self, name: str, *costs: float):
        """A zero-argument call named ``name`` costing ``costs[i]`` seconds at its i-th call
        (the last cost repeats)."""
        sequence = itertools.chain(costs, itertools.repeat(costs[-1]))

        def run():
            self.log.append(name)
            self.now += next(sequence)
        return run


def test_paired_ratio_of_a_call_twice_as_slow_is_two():
    clock = FakeClock()
    calls = {"once": clock.call("once", 0.001), "twice": clock.call("twice", 0.002)}
    timed = timing.time_in_turns(calls, 5, clock=clock)
    assert timed["once"].median_s == pytest.approx(0.001)
    assert timed["twice"].median_s == pytest.approx(0.002)
    assert timing.paired_ratio(timed["twice"], timed["once"]) == pytest.approx(2.0)
    assert timing.median_ratio(timed["once"], timed["twice"]) == pytest.approx(0.5)
    assert timed["once"].rounds == (0, 1, 2, 3, 4) and len(timed["once"].times_s) == 5


def test_calls_warm_up_then_take_turns_round_by_round():
    clock = FakeClock()
    calls = {name: clock.call(name, 0.01) for name in ("a", "b", "c")}
    timing.time_in_turns(calls, 3, clock=clock)
    assert clock.log == ["a", "b", "c"] + ["a", "b", "c"] * 3


def test_the_warm_up_is_not_a_sample_of_a_fast_call():
    clock = FakeClock()
    timed = timing.time_in_turns({"a": clock.call("a", 1.5, 0.01)}, 4, clock=clock)["a"]
    assert timed.warm_up_s == pytest.approx(1.5)
    assert timed.times_s == pytest.approx((0.01,) * 4)


def test_paired_ratio_is_the_median_of_the_ratios_of_each_round():
    a = timing.Timing(0.0, (1.0, 2.0, 9.0), (0, 1, 2))
    b = timing.Timing(0.0, (2.0, 1.0, 3.0), (0, 1, 2))
    # round by round: 0.5, 2, 3 -> median 2; the medians (2 and 2) would give 1
    assert timing.paired_ratio(a, b) == pytest.approx(2.0)
    assert timing.median_ratio(a, b) == pytest.approx(1.0)


def test_load_on_one_round_does_not_move_the_paired_ratio():
    clock = FakeClock()  # the machine is 5 times slower during round 1, for both calls
    calls = {"a": clock.call("a", 1.0, 1.0, 5.0, 1.0, 1.0),  # warm-up, then rounds 0..3
             "b": clock.call("b", 0.5, 0.5, 2.5, 0.5, 0.5)}
    timed = timing.time_in_turns(calls, 4, clock=clock)
    assert timed["a"].times_s[1] == pytest.approx(5.0)
    assert timing.paired_ratio(timed["a"], timed["b"]) == pytest.approx(2.0)


def test_slow_calls_get_fewer_rounds_and_take_the_first_ones():
    clock = FakeClock()
    calls = {"fast": clock.call("fast", 0.1), "slow": clock.call("slow", 3.0),
             "very slow": clock.call("very slow", 12.0)}
    timed = timing.time_in_turns(calls, 5, clock=clock)
    assert timed["fast"].rounds == (0, 1, 2, 3, 4)
    assert timed["slow"].rounds == (0, 1, 2)  # min(repeats, SLOW_ROUNDS)
    assert timed["very slow"].rounds == (timing.WARM_UP_ROUND, 0)  # warm-up counted
    assert timed["very slow"].times_s == pytest.approx((12.0, 12.0))
    assert clock.log == (["fast", "slow", "very slow"] * 2 + ["fast", "slow"] * 2
                         + ["fast"] * 2)
    # not timed in the same rounds: the ratio of the medians, not mismatched pairs
    assert timing.paired_ratio(timed["slow"], timed["fast"]) == pytest.approx(30.0)
    assert timing.paired_ratio(timed["very slow"], timed["slow"]) == pytest.approx(4.0)


def test_rounds_after_warm_up_thresholds():
    assert timing.rounds_after_warm_up(0.5, 5) == (5, False)
    assert timing.rounds_after_warm_up(timing.SLOW_S, 5) == (timing.SLOW_ROUNDS, False)
    assert timing.rounds_after_warm_up(5.0, 2) == (2, False)  # never more than asked
    assert timing.rounds_after_warm_up(timing.VERY_SLOW_S, 5) == (1, True)


def test_a_single_pair_and_no_rounds():
    a = timing.Timing(0.0, (3.0,), (0,))
    b = timing.Timing(0.0, (1.0,), (0,))
    assert timing.paired_ratio(a, b) == pytest.approx(3.0)
    assert timing.time_in_turns({}, 3) == {}
    with pytest.raises(ValueError, match="repeats"):
        timing.time_in_turns({"a": lambda: None}, 0)


def test_summary_in_seconds_and_milliseconds():
    entry = timing.Timing(0.1, (0.002, 0.001, 0.003), (0, 1, 2))
    assert entry.summary("s") == {"median_s": 0.002, "times_s": [0.002, 0.001, 0.003]}
    ms = entry.summary("ms")
    assert set(ms) == {"median_ms", "times_ms"} and ms["median_ms"] == pytest.approx(2.0)
    assert ms["times_ms"] == pytest.approx([2.0, 1.0, 3.0])


def test_fastest_times_only_the_step():
    clock = FakeClock()
    costs = iter([0.3, 0.1, 0.2])
    batches = iter(range(3))
    seen = []

    def prepare():
        clock.now += 50.0  # drawing a batch costs time, which is not counted
        return next(batches), "targets"

    def step(batch, targets):
        seen.append((batch, targets))
        clock.now += next(costs)

    assert timing.fastest(step, 3, prepare=prepare, clock=clock) == pytest.approx(0.1)
    assert seen == [(0, "targets"), (1, "targets"), (2, "targets")]
    assert timing.fastest(clock.call("plain", 0.4, 0.2), 2, clock=clock) == pytest.approx(0.2)


def test_thread_settings_and_wait_policy(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    timing.prefer_passive_wait_policy()
    settings = timing.thread_settings()
    assert settings["omp_num_threads"] == "3" and settings["omp_wait_policy"] == "PASSIVE"
    assert settings["torch_threads"] >= 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    timing.prefer_passive_wait_policy()  # a policy already set is kept
    assert timing.thread_settings()["omp_wait_policy"] == "ACTIVE"


def test_results_record_the_thread_settings(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    results = _load("_results")
    info = results.machine_info()
    for key in ("torch_threads", "omp_num_threads", "omp_wait_policy"):
        assert key in info, key
    assert info["omp_num_threads"] == "2"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_script_times_through_the_module(script):
    source = (BENCHMARKS / script).read_text()
    assert "from _timing import" in source, f"{script} does not use benchmarks/_timing.py"
    assert "prefer_passive_wait_policy()" in source, script
    markers = ("statistics.median(", "best = min(", 'setdefault("OMP_WAIT_POLICY"')
    own_loops = [marker for marker in markers if marker in source]
    assert not own_loops, f"{script} keeps its own timing code: {own_loops}"


def test_module_imports_without_torch():
    """Scripts import _timing before torch (the wait policy must be set first), so importing
    it must not import torch."""
    probe = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import _timing; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "importing _timing imported torch"


def test_every_call_can_keep_all_its_rounds():
    clock = FakeClock()  # a one-off slow first call, then microseconds (a decoding step)
    calls = {"step": clock.call("step", 3.0, 1e-5), "other": clock.call("other", 1e-5)}
    timed = timing.time_in_turns(calls, 5, clock=clock, fewer_rounds_when_slow=False)
    assert timed["step"].rounds == timed["other"].rounds == (0, 1, 2, 3, 4)
    assert timed["step"].warm_up_s == pytest.approx(3.0)
    assert timed["step"].median_s == pytest.approx(1e-5)
