"""One way to time calls for every benchmark script: warm-up, calls taking turns in rounds,
medians, paired ratios, and the thread settings the times were taken under.

Why the calls take turns: on a shared virtual machine the speed of the whole machine drifts by
10-30 % within minutes. If method A were timed five times and then method B five times, a burst
of load during B's calls would show up as "B is slower". Here every call is warmed up once, then
the calls run in rounds, one call of each per round, so that the calls of one round ran side by
side under the same load; a ratio of two methods is the median over the rounds of the ratio of
their two calls in that round (``paired_ratio``), which keeps the drift out of the ratio.

Usage (``benchmarks/`` is on ``sys.path`` when a script runs as ``benchmarks/x.py``)::

    import _timing
    _timing.prefer_passive_wait_policy()   # before torch is imported: OpenMP reads it once
    import torch

    timings = _timing.time_in_turns({"a": lambda: f(x), "b": lambda: g(x)}, repeats=5)
    timings["a"].median_s, timings["a"].summary("ms")   # {"median_ms": ..., "times_ms": [...]}
    _timing.paired_ratio(timings["a"], timings["b"])    # a / b, round by round

API:

- ``prefer_passive_wait_policy()``: ``OMP_WAIT_POLICY=PASSIVE`` unless set (idle OpenMP threads
  sleep instead of spinning; spinning threads starve each other on a busy two-core machine).
- ``thread_settings()``: torch's thread count, ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY``, as
  recorded with every result (``_results.machine_info``).
- ``rounds_after_warm_up(warm_up_s, repeats)``: how many rounds a call gets, and whether its
  warm-up counts as a sample: ``repeats`` rounds for a call under ``SLOW_S`` (2 s),
  ``min(repeats, SLOW_ROUNDS)`` (3) under ``VERY_SLOW_S`` (10 s), and beyond that one round with
  the warm-up as a second sample (its one-off costs are milliseconds against seconds).
- ``time_in_turns(calls, repeats, clock=time.perf_counter, fewer_rounds_when_slow=True)``: warm
  every zero-argument call up (in order), then time them in rounds, in the order given, a call
  leaving the rounds once it has had its count; returns a ``Timing`` per key. With
  ``fewer_rounds_when_slow=False`` every call gets ``repeats`` rounds whatever its warm-up took
  (for calls of microseconds, whose first call may pay a one-off cost of seconds).
- ``Timing``: ``warm_up_s``, ``times_s`` (in the order taken), ``rounds`` (the round of each
  sample, ``WARM_UP_ROUND`` for a warm-up counted as one), ``median_s``, ``summary(unit)``.
- ``paired_ratio(a, b)``: the median over rounds of ``a``'s time over ``b``'s when both were
  timed in exactly the same rounds (more than one), else ``median_ratio(a, b)``, the ratio of
  the medians.
- ``fastest(step, repeats, prepare=None, clock=time.perf_counter)``: the minimum time of
  ``step(*prepare())`` over ``repeats`` calls, ``prepare`` untimed (the estimate of the
  undisturbed cost of a training step; the training scripts' ``fastest_step_ms``).

``clock`` is a parameter so that tests can drive the module with a fake clock.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

Key = TypeVar("Key", bound=Hashable)

SLOW_S = 2.0  # a call slower than this (its warm-up) gets at most SLOW_ROUNDS rounds
SLOW_ROUNDS = 3
VERY_SLOW_S = 10.0  # slower than this: one round, and the warm-up counts as a sample
WARM_UP_ROUND = -1  # the round of a warm-up that counts as a sample
UNITS = {"s": 1.0, "ms": 1e3}

__all__ = [
    "SLOW_ROUNDS", "SLOW_S", "VERY_SLOW_S", "WARM_UP_ROUND", "Timing", "fastest", "median_ratio",
    "paired_ratio", "prefer_passive_wait_policy", "rounds_after_warm_up", "thread_settings",
    "time_in_turns",
]


def prefer_passive_wait_policy() -> None:
    """Idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the policy is set.

    Call it before torch is imported: the OpenMP runtime reads the policy once, when it starts.
    On a shared machine with more busy processes than cores, threads that spin-wait make every
    small parallel region wait for a descheduled partner (FAVOR+ ran 10-30 times slower).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def thread_settings() -> dict[str, Any]:
    """The threads the times were taken with: torch's count and the two OpenMP variables
    (``None`` where unset), stored with every result so that runs can be compared."""
    import torch  # here, not at the top: scripts import this module before torch

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


@dataclass(frozen=True)
class Timing:
    """The samples of one call: its warm-up, then one time per round it took part in."""

    warm_up_s: float
    times_s: tuple[float, ...]
    rounds: tuple[int, ...]  # the round of each sample (WARM_UP_ROUND: the warm-up)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def summary(self, unit: str = "s") -> dict[str, Any]:
        """``{"median_<unit>": float, "times_<unit>": [...]}``, the form the results store."""
        scale = UNITS[unit]
        return {f"median_{unit}": scale * self.median_s,
                f"times_{unit}": [scale * t for t in self.times_s]}


def rounds_after_warm_up(warm_up_s: float, repeats: int) -> tuple[int, bool]:
    """(rounds, whether the warm-up counts as a sample) for a call whose warm-up took
    ``warm_up_s``: slow calls get fewer rounds, so that a run stays within its time budget."""
    if warm_up_s < SLOW_S:
        return repeats, False
    if warm_up_s < VERY_SLOW_S:
        return min(repeats, SLOW_ROUNDS), False
    return 1, True


def _duration(call: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    call()
    return clock() - start


def time_in_turns(calls: Mapping[Key, Callable[[], object]], repeats: int, *,
                  clock: Callable[[], float] = time.perf_counter,
                  fewer_rounds_when_slow: bool = True) -> dict[Key, Timing]:
    """Warm each call up once, then time them in rounds, each call once per round.

    Calls run in the order of ``calls``, in the warm-up and in every round; a call timed in
    fewer rounds (a slow one, see ``rounds_after_warm_up``) takes part in the first ones.
    ``fewer_rounds_when_slow=False``: ``repeats`` rounds for every call.
    """
    if repeats < 1:
        raise ValueError(f"repeats: at least one timed round is needed, got {repeats}")
    warm_up = {key: _duration(call, clock) for key, call in calls.items()}
    plan = {key: rounds_after_warm_up(seconds, repeats) if fewer_rounds_when_slow
            else (repeats, False) for key, seconds in warm_up.items()}
    times: dict[Key, list[float]] = {}
    rounds: dict[Key, list[int]] = {}
    for key, (_, warm_up_counts) in plan.items():
        times[key] = [warm_up[key]] if warm_up_counts else []
        rounds[key] = [WARM_UP_ROUND] if warm_up_counts else []
    for r in range(max((count for count, _ in plan.values()), default=0)):
        for key, call in calls.items():
            if r < plan[key][0]:
                times[key].append(_duration(call, clock))
                rounds[key].append(r)
    return {key: Timing(warm_up[key], tuple(times[key]), tuple(rounds[key])) for key in calls}


def median_ratio(a: Timing, b: Timing) -> float:
    """The median time of ``a`` over the median time of ``b``."""
    return a.median_s / b.median_s


def paired_ratio(a: Timing, b: Timing) -> float:
    """Time of ``a`` over time of ``b``, round by round.

    When both were timed in the same rounds (more than one), the median over those rounds of
    the ratio of their two calls (side by side, under the same load); otherwise (a slow call
    timed in fewer rounds than a fast one) the ratio of the medians.
    """
    if a.rounds == b.rounds and len(a.rounds) > 1:
        return statistics.median(x / y for x, y in zip(a.times_s, b.times_s, strict=True))
    return median_ratio(a, b)


def fastest(step: Callable[..., object], repeats: int,
            prepare: Callable[[], tuple] | None = None, *,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """The minimum over ``repeats`` calls of the time of ``step(*prepare())`` (seconds).

    ``prepare`` (untimed) makes the arguments of each call, e.g. a fresh batch. The minimum of a
    few calls is the usual estimate of a call's undisturbed cost on a machine doing other work.
    """
    best = float("inf")
    for _ in range(repeats):
        arguments = prepare() if prepare is not None else ()
        best = min(best, _duration(lambda arguments=arguments: step(*arguments), clock))
    return best
