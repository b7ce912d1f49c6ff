"""Small Transformers trained with each kind of attention on two synthetic tasks.

The same ``ea.TinyTransformer`` (2 layers, ``d_model = 64``, 4 heads) is trained with
each attention of Part II (``KINDS``: softmax, linear, performer, nystrom, fmm) on

- associative recall (``ea.AssociativeRecall``, 16 facts of one token each, then a query
  key, ``n = 17``): find the value stored with the queried key, a *content*-based look-up
  (chance 1/16);
- copying (``ea.CopyTask``, 64 positions of 8 symbols, ``n = 129``): repeat the first
  half after a separator, a *position*-based look-up ``L + 1 = 65`` tokens back (chance 1/8);

in encoder (bidirectional) and in causal (decoder) mode. Nystrom attention has no
causal form (its segment-mean landmarks mix past and future), so it is trained in
encoder mode only; the causal entries say so. The causal recurrences of Part III
(``"gated"``, ``"delta"``) are trained by ``train_recurrent.py``.

Every run uses the same seed, batches and number of steps. Reported: accuracy and
loss on 256 fresh sequences, the training curves, wall-clock and CPU time.

Run ``.venv/bin/python benchmarks/train_models.py`` (``--quick`` for a smoke test).
Writes ``benchmarks/results/train_models.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
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

TASKS = {
    "associative_recall": {
        "make": lambda: ea.AssociativeRecall(
            num_pairs=16, num_keys=16, num_values=16, one_token_per_pair=True
        ),
        "spec": "AssociativeRecall(num_pairs=16, num_keys=16, num_values=16, "
        "one_token_per_pair=True)",
        "steps": 1500,
    },
    "copy": {
        "make": lambda: ea.CopyTask(length=64, num_symbols=8),
        "spec": "CopyTask(length=64, num_symbols=8)",
        "steps": 400,
    },
}
MODES = {"encoder": False, "causal": True}
KINDS = ("softmax", "linear", "performer", "nystrom", "fmm")  # Part II's attentions
MODEL = {"d_model": 64, "num_heads": 4, "num_layers": 2}
OPTIONS = {  # attention options, spelled out (they are also make_attention's defaults)
    "softmax": {},
    "linear": {},
    "performer": {"num_features": 32, "redraw_interval": 100, "seed": 0},
    "nystrom": {"num_landmarks": 8, "pinv_iterations": 6},
    "fmm": {"bandwidth": 2},
}
TRAIN = {"batch_size": 32, "lr": 3e-3, "seed": 0}
EVAL = {"batch_size": 256, "seed": 1}
TIMING_REPEATS = 7  # extra timed steps per model; their minimum resists other load
# What each run measures after training; --quick: a smoke test of the whole pipeline (every
# task, mode and kind, one step each), seconds per run
FULL = {"timing_repeats": TIMING_REPEATS, "evaluation": EVAL}
QUICK = {"steps": 1, "timing_repeats": 1, "evaluation": {"batch_size": 8, "seed": 1}}


def fastest_step_ms(model: torch.nn.Module, task, repeats: int) -> float:
    """Minimum over ``repeats`` of the time of one training step (forward, backward, AdamW).

    The training loop's own wall time includes whatever else the machine was doing;
    the minimum of a few repeats is the standard estimate of the undisturbed cost.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: leave the model as is
    generator = torch.Generator().manual_seed(12345)
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


def train_one(task_name: str, kind: str, causal: bool, steps: int, progress: bool,
              plan: dict = FULL) -> dict:
    """Train one model; return its evaluation, curves and timings (``plan``: ``FULL`` or
    ``QUICK``)."""
    task = TASKS[task_name]["make"]()
    torch.manual_seed(TRAIN["seed"])
    model = ea.TinyTransformer(
        task.vocab_size,
        max_len=task.seq_len,
        attention=kind,
        causal=causal,
        attention_options=OPTIONS[kind],
        **MODEL,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    history = ea.train_model(
        model,
        task,
        steps,
        batch_size=TRAIN["batch_size"],
        lr=TRAIN["lr"],
        seed=TRAIN["seed"],
        progress=progress,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    evaluation = ea.evaluate_model(model, task, **plan["evaluation"])
    step_ms = fastest_step_ms(model, task, plan["timing_repeats"])
    return {
        "status": "trained",
        "eval_accuracy": evaluation["accuracy"],
        "eval_loss": evaluation["loss"],
        "chance_accuracy": 1 / (task.num_values if task_name == "associative_recall"
                                else task.num_symbols),
        "seq_len": task.seq_len,
        "vocab_size": task.vocab_size,
        "train_wall_s": wall,
        "train_cpu_s": cpu,
        "ms_per_step": 1000 * wall / steps,
        "fastest_step_ms": step_ms,  # min over TIMING_REPEATS timed steps
        "unloaded_estimate_s": step_ms * steps / 1000,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        # per-step curves, rounded to keep the committed JSON small
        "loss": [float(f"{x:.4g}") for x in history["loss"]],
        "accuracy": [round(x, 4) for x in history["accuracy"]],
    }


def not_applicable(kind: str) -> dict:
    try:
        ea.make_attention(kind, MODEL["d_model"] // MODEL["num_heads"], causal=True)
    except ValueError as error:  # the library's own reason
        return {"status": "not applicable", "reason": str(error)}
    raise AssertionError(f"{kind} unexpectedly supports causal attention")


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict):
    """The figure of ``train_models.png``."""
    plt = pyplot()
    kinds = results["config"]["attention_kinds"]
    settings = [(t, m) for m in MODES for t in TASKS]
    fig = plt.figure(figsize=(4.0 * len(settings), 7.0))
    grid = fig.add_gridspec(2, len(settings))
    top = [fig.add_subplot(grid[0, col]) for col in range(len(settings))]
    half = len(settings) // 2
    bottom = [fig.add_subplot(grid[1, :half]), fig.add_subplot(grid[1, half:])]
    for col, (task, mode) in enumerate(settings):
        ax = top[col]
        for index, kind in enumerate(kinds):
            run = results["runs"][task][mode][kind]
            if run["status"] == "trained":
                ax.plot(smooth(run["loss"], 20), color=f"C{index}", label=kind)
        ax.set(title=f"{task}, {mode}", xlabel="step", ylabel="training loss (smoothed)",
               yscale="log")
        ax.grid(True, alpha=0.3)
    top[0].legend(fontsize=8)
    width = 0.8 / len(settings)
    for ax, (key, label) in zip(bottom, (("eval_accuracy", "accuracy on fresh data"),
                                         ("fastest_step_ms", "fastest training step (ms)")),
                                strict=True):
        for s, (task, mode) in enumerate(settings):
            values = [results["runs"][task][mode][k].get(key, float("nan")) for k in kinds]
            positions = [i + (s - (len(settings) - 1) / 2) * width for i in range(len(kinds))]
            ax.bar(positions, values, width, label=f"{task}, {mode}")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set(ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(results_path("train_models", out=args.out).read_text())
        write_figure(results_path("train_models", "png", out=args.out), plot(results))
        return results
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(2)
    progress = not args.no_progress
    conditions = run_conditions()
    start = time.perf_counter()
    plan = QUICK if args.quick else FULL
    runs: dict[str, dict[str, dict[str, dict]]] = {}
    for task_name, spec in TASKS.items():
        steps = plan.get("steps", spec["steps"])
        runs[task_name] = {}
        for mode, causal in MODES.items():
            runs[task_name][mode] = {}
            for kind in KINDS:
                if causal and kind == "nystrom":
                    runs[task_name][mode][kind] = not_applicable(kind)
                    continue
                if progress:
                    print(f"{task_name} / {mode} / {kind}", flush=True)
                run = train_one(task_name, kind, causal, steps, progress, plan)
                runs[task_name][mode][kind] = run
                print(f"  {task_name:18s} {mode:7s} {kind:9s} accuracy {run['eval_accuracy']:.3f}"
                      f"  {run['train_wall_s']:.0f} s", flush=True)
    results = {
        "benchmark": "train_models",
        "conditions": {**conditions, "wall_time_s": time.perf_counter() - start,
                       "quick": args.quick},
        "config": {
            "attention_kinds": list(KINDS),
            "tasks": {name: {"spec": t["spec"], "steps": plan.get("steps", t["steps"])}
                      for name, t in TASKS.items()},
            "modes": MODES,
            "model": MODEL,
            "attention_options": OPTIONS,
            "training": TRAIN,
            "evaluation": plan["evaluation"],
        },
        "runs": runs,
    }
    results["conditions"].update(run_conditions(end=True))
    write_results("train_models", results, out=out, figure=plot(results), indent=None)
    print(f"wrote {out / 'train_models.json'} and .png "
          f"in {results['conditions']['wall_time_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
