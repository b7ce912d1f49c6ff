"""Associative recall learnt with linear, gated, delta-rule and softmax attention.

The same causal ``ea.TinyTransformer`` is trained with four attentions of the library,
``linear`` (elu features, normalised prefix sums), ``gated`` (gated linear attention, one
learned decay per token), ``delta`` (DeltaNet: the delta rule on L2-normalised keys) and
``softmax`` (exact), on ``ea.AssociativeRecall``: ``P`` facts of one token each, a
(key, value) pair with distinct keys, then a query key whose value must be output. With
more facts than the dimension of a head, a recurrent state of ``d_head x d_head`` numbers
cannot hold every fact exactly (see the chapter ``gated_linear_attention``), while softmax
attention keeps every key.

Every attention is trained with the same seeds, batches, learning rate and number of steps,
once per seed (the seed sets both the initial weights and the training batches), and
evaluated on the same held-out batch of queries. Reported per run: the accuracy and loss on
the held-out queries, the training curves (means over windows of ``CURVE_WINDOW`` steps),
wall-clock time and the fastest training step; per attention, the mean and the spread of the
accuracy over seeds.

Run ``.venv/bin/python benchmarks/train_recurrent.py`` (``--quick`` for a smoke test).
Writes ``benchmarks/results/train_recurrent.json``, ``.md`` and ``.png``; the chapter
``book/gated_linear_attention.ipynb`` reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _timing import fastest, prefer_passive_wait_policy  # benchmarks/ is on sys.path

# Before torch starts its thread pool: on a shared machine, spin-waiting OpenMP threads
# stall every small parallel region (see _timing.py).
prefer_passive_wait_policy()

import torch  # noqa: E402
from _results import (  # noqa: E402  (benchmarks/ is on sys.path)
    add_output_arguments,
    output_folder,
    pyplot,
    results_path,
    run_conditions,
    write_figure,
    write_results,
)

import efficient_attention as ea  # noqa: E402

NAME = "train_recurrent"
KINDS = ("linear", "gated", "delta", "softmax")
TASK = {"num_pairs": 32, "num_keys": 32, "num_values": 8, "one_token_per_pair": True}
MODEL = {"d_model": 64, "num_heads": 4, "num_layers": 1, "causal": True}
TRAIN = {"steps": 2000, "batch_size": 64, "lr": 3e-3}
SEEDS = (0, 1, 2)
EVAL = {"batch_size": 2048, "seed": 12345}  # held out: the training batches use seeds 0, 1, 2
CURVE_WINDOW = 10  # steps per point of the stored training curves
TIMING_REPEATS = 5
# What a run trains and measures; --quick: a smoke test (every kind, two seeds), seconds per run
FULL = {"steps": TRAIN["steps"], "seeds": SEEDS, "timing_repeats": TIMING_REPEATS,
        "evaluation": EVAL}
QUICK = {"steps": 5, "seeds": SEEDS[:2], "timing_repeats": 2,
         "evaluation": {"batch_size": 256, "seed": 12345}}


def make_task() -> ea.AssociativeRecall:
    return ea.AssociativeRecall(**TASK)


def fastest_step_ms(model: torch.nn.Module, task, repeats: int) -> float:
    """Minimum over ``repeats`` of one training step (forward, backward, AdamW) in ms.

    The training loop's own wall time includes whatever else the machine was doing; the
    minimum of a few repeats is the standard estimate of the undisturbed cost.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: leave the model as is
    generator = torch.Generator().manual_seed(54321)
    model.train()

    def training_step(inputs, targets) -> None:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=ea.IGNORE_INDEX
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # a fresh batch per step, drawn outside the timed call
    return 1000 * fastest(training_step, repeats,
                          prepare=lambda: task(TRAIN["batch_size"], generator=generator))


def window_means(values: list[float], window: int) -> list[float]:
    """Means over consecutive windows of ``window`` values (the last may be shorter)."""
    return [round(statistics.fmean(values[i:i + window]), 4)
            for i in range(0, len(values), window)]


def train_one(kind: str, seed: int, progress: bool, plan: dict = FULL) -> dict:
    """Train one model from ``seed``; return its held-out evaluation, curves and timings
    (``plan``: ``FULL`` or ``QUICK``)."""
    task = make_task()
    torch.manual_seed(seed)
    model = ea.TinyTransformer(task.vocab_size, max_len=task.seq_len, attention=kind, **MODEL)
    wall, cpu = time.perf_counter(), time.process_time()
    history = ea.train_model(model, task, plan["steps"], batch_size=TRAIN["batch_size"],
                             lr=TRAIN["lr"], seed=seed, progress=progress)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    evaluation = ea.evaluate_model(model, task, **plan["evaluation"])
    return {
        "seed": seed,
        "eval_accuracy": evaluation["accuracy"],
        "eval_loss": evaluation["loss"],
        "train_wall_s": wall,
        "train_cpu_s": cpu,
        "fastest_step_ms": fastest_step_ms(model, task, plan["timing_repeats"]),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "accuracy_curve": window_means(history["accuracy"], CURVE_WINDOW),
        "loss_curve": window_means(history["loss"], CURVE_WINDOW),
    }


def summarise(runs: list[dict]) -> dict:
    """Mean, sample standard deviation, minimum and maximum of the held-out accuracy."""
    accuracies = [run["eval_accuracy"] for run in runs]
    return {
        "mean": statistics.fmean(accuracies),
        "std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
        "min": min(accuracies),
        "max": max(accuracies),
    }


def plot(results: dict):
    """Training curves (mean over seeds) and held-out accuracy per seed."""
    plt = pyplot()
    kinds = results["config"]["attention_kinds"]
    window = results["config"]["curve_window"]
    fig, (ax_curve, ax_bar) = plt.subplots(1, 2, figsize=(11, 4))
    for index, kind in enumerate(kinds):
        curves = [run["accuracy_curve"] for run in results["runs"][kind]]
        mean = [statistics.fmean(points) for points in zip(*curves, strict=True)]
        ax_curve.plot([window * (i + 0.5) for i in range(len(mean))], mean,
                      color=f"C{index}", label=kind)
        summary = results["summary"][kind]
        ax_bar.bar(index, summary["mean"], color=f"C{index}", alpha=0.8)
        for run in results["runs"][kind]:
            ax_bar.plot(index, run["eval_accuracy"], "k.", ms=8)
    chance = 1 / results["config"]["task"]["num_values"]
    for ax in (ax_curve, ax_bar):
        ax.axhline(chance, color="grey", ls=":", lw=1)
        ax.set_ylim(0, 1.02)
        ax.grid(True, axis="y", alpha=0.3)
    ax_curve.set(xlabel="training step", ylabel="training accuracy (mean over seeds)")
    ax_curve.legend(fontsize=8)
    ax_bar.set_xticks(range(len(kinds)), kinds)
    ax_bar.set(ylabel="held-out accuracy (bars: mean, dots: seeds)")
    fig.tight_layout()
    return fig


def markdown(results: dict) -> str:
    """A table of the held-out accuracy per attention."""
    lines = ["# Associative recall: linear, gated, delta-rule and softmax attention", "",
             f"Task `{results['config']['task_spec']}`, model {results['config']['model']}, "
             f"{results['config']['training']['steps']} steps, seeds "
             f"{results['config']['seeds']}, {results['config']['evaluation']['batch_size']} "
             "held-out queries.", "",
             "| attention | mean accuracy | std over seeds | min | max | fastest step (ms) |",
             "|---|---|---|---|---|---|"]
    for kind in results["config"]["attention_kinds"]:
        s = results["summary"][kind]
        step = min(run["fastest_step_ms"] for run in results["runs"][kind])
        lines.append(f"| {kind} | {s['mean']:.3f} | {s['std']:.3f} | {s['min']:.3f} | "
                     f"{s['max']:.3f} | {step:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(results_path(NAME, out=args.out).read_text())
        write_figure(results_path(NAME, "png", out=args.out), plot(results))
        return results
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(2)
    progress = not args.no_progress
    plan = QUICK if args.quick else FULL
    conditions = run_conditions()
    start = time.perf_counter()
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for seed in plan["seeds"]:  # seed by seed, so that a disturbance of the machine hits every kind
        for kind in KINDS:
            if progress:
                print(f"{kind} / seed {seed}", flush=True)
            run = train_one(kind, seed, progress, plan)
            runs[kind].append(run)
            print(f"  {kind:8s} seed {seed}: held-out accuracy {run['eval_accuracy']:.3f}  "
                  f"{run['train_wall_s']:.0f} s", flush=True)
    results = {
        "benchmark": NAME,
        "conditions": {**conditions, "wall_time_s": time.perf_counter() - start,
                       "quick": args.quick},
        "config": {
            "attention_kinds": list(KINDS),
            "task": TASK,
            "task_spec": repr(make_task()),
            "model": MODEL,
            "training": {**TRAIN, "steps": plan["steps"], "optimizer": "AdamW (ea.train_model)"},
            "seeds": list(plan["seeds"]),
            "evaluation": plan["evaluation"],
            "curve_window": CURVE_WINDOW,
        },
        "runs": runs,
        "summary": {kind: summarise(kind_runs) for kind, kind_runs in runs.items()},
    }
    results["conditions"].update(run_conditions(end=True))
    write_results(NAME, results, out=out, markdown=markdown(results), figure=plot(results),
                  indent=None)
    print(f"wrote {results_path(NAME, out=out)} (.md, .png) "
          f"in {results['conditions']['wall_time_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
