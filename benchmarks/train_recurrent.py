"""Associative recall learnt with linear, gated, delta-rule and softmax attention.

The same causal ``ea.TinyTransformer`` is trained with four attentions of the library,
``linear`` (elu features, normalised prefix sums), ``gated`` (gated linear attention, one
learned decay per token), ``delta`` (DeltaNet: the delta rule on L2-normalised keys) and
``softmax`` (exact), on ``ea.AssociativeRecall``: ``P`` facts of one token each, a
(key, value) pair with distinct keys, then a query key whose value must be output. Three
variants of the delta rule are trained beside them (``VARIANTS``): ``gated delta`` (Gated
DeltaNet, the library's ``DeltaRuleAttention(gated=True)``), ``gated delta, output gate``
(Gated DeltaNet with its output normalisation and gate, ``OutputGate``) and ``delta, short
conv`` (DeltaNet with a causal depthwise convolution of width 4 and a SiLU on the queries, keys
and values of every head, the "short convolutions" of DeltaNet, Gated DeltaNet and Mamba): two
small ablations of what these models add around the recurrence, defined here (the library has
neither).

Every model is trained with the same seeds, batches, learning rate and number of steps,
once per seed (the seed sets both the initial weights and the training batches), and
evaluated on the same held-out batch of queries. Reported per run: the accuracy and loss on
the held-out queries, whether each held-out query was answered correctly (``eval_correct``,
one character ``0``/``1`` per query, in the order of the batch: every run sees the same
queries, so two models can be compared query by query), the training curves (means over
windows of ``CURVE_WINDOW`` steps), wall-clock time and the fastest training step; per model,
the mean and the spread of the accuracy over seeds. At the end, one training step of every
model (fresh weights, one fixed batch) is timed in turns (``_timing.time_in_turns``,
``STEP_ROUNDS`` rounds), so that the steps of one round ran side by side under the same load
(``step_timing``: every time, and the ratio to softmax attention's step round by round).

A second, smaller experiment (``capacity``) is the setting of the chapter's capacity bound: a
single head whose state ``S`` (``d_k x d_v``) is written with all ``CAPACITY["facts"]`` facts
of a sequence, in a random order, by the sum of linear attention or by the delta rule, and read
linearly, ``S^T q``, with no MLP. Keys and queries are learned vectors (one per key), the values
the centred one-hot codes of ``CAPACITY["num_values"]`` answers; trained on the squared recall
error for every ``d_k`` of ``CAPACITY["widths"]`` (all widths at once, as independent
parameters). Reported: the relative squared error of the read-out on held-out sequences, which
no state can bring below ``1 - d_k / facts`` in expectation, and the accuracy of its largest
coordinate.

Run ``.venv/bin/python benchmarks/train_recurrent.py`` (``--quick`` for a smoke test).
Writes ``benchmarks/results/train_recurrent.json``, ``.md`` and ``.png``; the chapter
``book/gated_linear_attention.ipynb`` reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _timing import (  # benchmarks/ is on sys.path
    fastest,
    paired_ratio,
    prefer_passive_wait_policy,
    time_in_turns,
)

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
KINDS = ("linear", "gated", "delta", "softmax")  # the library's kinds, with default options
# Models beyond the four kinds: name -> the kind, its options, a short convolution or not, and
# (output_gate) the output normalisation and gate or not
VARIANTS = {
    "gated delta": {"attention": "delta", "attention_options": {"gated": True},
                    "short_convolution": False},
    "delta, short conv": {"attention": "delta", "attention_options": {},
                          "short_convolution": True},
    "gated delta, output gate": {"attention": "delta", "attention_options": {"gated": True},
                                 "short_convolution": False, "output_gate": True},
}
MODELS = ("linear", "gated", "delta", "gated delta", "gated delta, output gate",
          "delta, short conv", "softmax")
CONV_WIDTH = 4  # tokens seen by the short convolution (the width of DeltaNet's and Mamba's)
# The capacity experiment: one head, linear read-out, every fact of the sequence asked for
CAPACITY = {"facts": 32, "num_values": 8, "widths": [4, 8, 16, 24, 32], "steps": 400,
            "batch_size": 64, "lr": 2e-2, "seed": 0, "eval_sequences": 1024, "eval_seed": 1}
CAPACITY_QUICK = {**CAPACITY, "steps": 3, "eval_sequences": 16}
TASK = {"num_pairs": 32, "num_keys": 32, "num_values": 8, "one_token_per_pair": True}
MODEL = {"d_model": 64, "num_heads": 4, "num_layers": 1, "causal": True}
TRAIN = {"steps": 2000, "batch_size": 64, "lr": 3e-3}
SEEDS = (0, 1, 2)
EVAL = {"batch_size": 2048, "seed": 12345}  # held out: the training batches use seeds 0, 1, 2
CURVE_WINDOW = 10  # steps per point of the stored training curves
TIMING_REPEATS = 5
STEP_ROUNDS = 20  # rounds of the final timing of one training step of every model
# What a run trains and measures; --quick: a smoke test (every model, two seeds), seconds per
# run
FULL = {"steps": TRAIN["steps"], "seeds": SEEDS, "timing_repeats": TIMING_REPEATS,
        "evaluation": EVAL, "step_rounds": STEP_ROUNDS}
QUICK = {"steps": 2, "seeds": SEEDS[:2], "timing_repeats": 1,
         "evaluation": {"batch_size": 64, "seed": 12345}, "step_rounds": 2}


def make_task() -> ea.AssociativeRecall:
    return ea.AssociativeRecall(**TASK)


class ShortConvolution(torch.nn.Module):
    """A causal depthwise convolution of ``width`` tokens, then SiLU, on the queries, keys and
    values of every head, before the attention ``inner`` (the short convolutions of DeltaNet,
    Gated DeltaNet and Mamba): ``x'_t = silu(sum_{s < width} w_s * x_{t-s})``, one weight
    per channel, head and shift, no bias, ``x_t = 0`` before the sequence. Inputs ``(B, h, n,
    d)``; ``forward`` takes and passes on ``causal`` (only causal use: the convolution looks
    back)."""

    def __init__(self, inner, num_heads: int, dim_head: int, width: int = CONV_WIDTH) -> None:
        super().__init__()
        self.inner = inner
        self.width = width
        bound = 1 / width**0.5  # the initialisation of torch.nn.Conv1d (depthwise: fan-in K)
        self.weight = torch.nn.Parameter(
            torch.empty(3, num_heads, 1, dim_head, width).uniform_(-bound, bound))

    def _convolve(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        padded = torch.nn.functional.pad(x, (0, 0, self.width - 1, 0))  # zeros before t = 0
        # shift s: x_{t-s} for every t, i.e. rows width-1-s .. width-1-s+n of the padded input
        out = sum(weight[..., s] * padded[..., self.width - 1 - s:self.width - 1 - s + n, :]
                  for s in range(self.width))
        return torch.nn.functional.silu(out)

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None):
        if not causal:
            raise ValueError("the short convolution looks back: use it with causal=True")
        q, k, v = (self._convolve(x, w) for x, w in zip((q, k, v), self.weight, strict=True))
        return self.inner(q, k, v, causal=True, key_padding_mask=key_padding_mask)


class NormalisedHeads(torch.nn.Module):
    """The attention ``inner`` followed by RMSNorm over each head's ``d_head`` channels (one
    learned scale per channel, shared by the heads): inputs and output ``(B, h, n, d)``."""

    def __init__(self, inner, dim_head: int) -> None:
        super().__init__()
        self.inner = inner
        self.norm = torch.nn.RMSNorm(dim_head, eps=1e-6)

    def forward(self, q, k, v, **kwargs):
        return self.norm(self.inner(q, k, v, **kwargs))


class OutputGate(torch.nn.Module):
    """The output normalisation and gate of Gated DeltaNet around the multi-head attention
    ``heads``: every head's output is normalised, then multiplied by a gate computed from the
    token, before the output projection: ``o_t <- RMSNorm(o_t) * silu(W_g x_t)``
    (``NormalisedHeads``; ``W_g``: ``d_model x d_model``, no bias), then ``W_O``. Cost:
    ``O(n d_model^2)`` more per layer (the gate's projection). ``forward(x, **kwargs)`` as
    ``heads``'s. Reference: Yang et al. 2025, Gated Delta Networks."""

    def __init__(self, heads: ea.MultiHeadAttention) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(heads.d_model, heads.d_model, bias=False)
        self.out_proj = heads.out_proj  # applied here, after the gate
        heads.out_proj = torch.nn.Identity()  # heads(x): the normalised heads, concatenated
        heads.attention = NormalisedHeads(heads.attention, heads.d_head)
        self.heads = heads

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        heads = self.heads(x, **kwargs)  # (..., n, h d_head): RMSNorm(o_t) of every head
        return self.out_proj(heads * torch.nn.functional.silu(self.gate(x)))


def make_model(name: str, task: ea.AssociativeRecall) -> torch.nn.Module:
    """The causal ``TinyTransformer`` of model ``name`` (a kind of ``KINDS`` or a variant)."""
    variant = VARIANTS.get(name, {"attention": name, "attention_options": {},
                                  "short_convolution": False})
    model = ea.TinyTransformer(task.vocab_size, max_len=task.seq_len,
                               attention=variant["attention"],
                               attention_options=variant["attention_options"], **MODEL)
    if variant["short_convolution"]:
        for block in model.blocks:
            heads = block.attention
            heads.attention = ShortConvolution(heads.attention, heads.num_heads, heads.d_head)
    if variant.get("output_gate"):
        for block in model.blocks:
            block.attention = OutputGate(block.attention)
    return model


def capacity(settings: dict) -> dict:
    """The capacity experiment (see the module): relative squared recall error and accuracy of
    a single head with a linear read-out, per rule (``sum``, ``delta``) and width ``d_k``."""
    F = torch.nn.functional
    facts, num_values, widths = settings["facts"], settings["num_values"], settings["widths"]
    d_max = max(widths)
    # (widths, 1, 1, d_max): channel r belongs to the model of width d_k when r < d_k
    used = (torch.arange(d_max) < torch.tensor(widths)[:, None]).float()[:, None, None, :]

    def sequences(size, generator):
        keys = torch.rand(size, facts, generator=generator).argsort(-1)  # every key, shuffled
        answers = torch.randint(num_values, (size, facts), generator=generator)
        values = F.one_hot(answers, num_values).float() - 1 / num_values  # centred one-hot
        return keys, values, answers

    def recall(params, rule, keys, values):
        write = params["write"][:, keys] * used  # (widths, B, facts, d_max)
        read = params["read"][:, keys] * used
        if rule == "sum":  # linear attention: S = sum_j k_j v_j^T
            state = write.transpose(-2, -1) @ values
        else:  # the delta rule on unit keys, beta_t = sigmoid(b_key), in the order given
            write = F.normalize(write, dim=-1)
            _, state = ea.delta_rule_attention(
                write, write, values.expand(len(widths), *values.shape),
                torch.sigmoid(params["beta"][:, keys]), return_state=True)
        return read @ state  # (widths, B, facts, num_values): S^T q for every key

    def relative_error(out, values):  # (widths,): sum of squared errors over sum of squares
        return ((out - values) ** 2).sum(dim=(1, 2, 3)) / (values**2).sum()

    results = {"rules": {}, "bound": [max(0.0, 1 - d / facts) for d in widths]}
    start = time.perf_counter()
    for rule in ("sum", "delta"):
        generator = torch.Generator().manual_seed(settings["seed"])
        params = {name: (torch.randn(len(widths), facts, d_max, generator=generator) / 4)
                  .requires_grad_() for name in ("write", "read")}
        params["beta"] = torch.zeros(len(widths), facts, requires_grad=True)
        optimizer = torch.optim.Adam(params.values(), lr=settings["lr"])
        for _ in range(settings["steps"]):
            keys, values, _ = sequences(settings["batch_size"], generator)
            loss = relative_error(recall(params, rule, keys, values), values).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            keys, values, answers = sequences(
                settings["eval_sequences"], torch.Generator().manual_seed(settings["eval_seed"]))
            out = recall(params, rule, keys, values)
            results["rules"][rule] = {
                "error": relative_error(out, values).tolist(),
                "accuracy": (out.argmax(-1) == answers).float().mean(dim=(1, 2)).tolist(),
            }
    results["wall_s"] = time.perf_counter() - start
    return {**settings, **results}


def training_step(model: torch.nn.Module, optimizer) -> object:
    """One step (forward, backward, AdamW) on a batch, as ``ea.train_model`` takes it."""

    def step(inputs, targets) -> None:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=ea.IGNORE_INDEX
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


@torch.no_grad()
def correct_queries(model: torch.nn.Module, task, batch_size: int, seed: int) -> str:
    """``"0"``/``"1"`` per held-out query (the batch of ``ea.evaluate_model`` with the same
    ``batch_size`` and ``seed``): whether the model's answer is right."""
    inputs, targets = task(batch_size, generator=torch.Generator().manual_seed(seed))
    was_training = model.training
    model.eval()
    right = model(inputs)[:, -1].argmax(dim=-1) == targets[:, -1]
    model.train(was_training)
    return "".join("1" if r else "0" for r in right.tolist())


def fastest_step_ms(model: torch.nn.Module, task, repeats: int) -> float:
    """Minimum over ``repeats`` of one training step (forward, backward, AdamW) in ms.

    The training loop's own wall time includes whatever else the machine was doing; the
    minimum of a few repeats is the standard estimate of the undisturbed cost.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: leave the model as is
    generator = torch.Generator().manual_seed(54321)
    model.train()
    # a fresh batch per step, drawn outside the timed call
    return 1000 * fastest(training_step(model, optimizer), repeats,
                          prepare=lambda: task(TRAIN["batch_size"], generator=generator))


def step_timing(rounds: int) -> dict:
    """One training step of every model (fresh weights, seed 0, one fixed batch, AdamW with
    lr 0), timed in turns: ``rounds`` rounds, each model once per round, in ``MODELS`` order.
    Returns every time (ms), the medians and, per model, its time over softmax attention's
    in each round and the median of those ratios."""
    task = make_task()
    inputs, targets = task(TRAIN["batch_size"], generator=torch.Generator().manual_seed(54321))
    calls = {}
    for name in MODELS:
        torch.manual_seed(0)
        model = make_model(name, task)
        model.train()
        step = training_step(model, torch.optim.AdamW(model.parameters(), lr=0.0))
        calls[name] = lambda step=step: step(inputs, targets)
    timings = time_in_turns(calls, rounds, fewer_rounds_when_slow=False)
    base = timings["softmax"]
    return {
        "rounds": rounds,
        "batch_size": TRAIN["batch_size"],
        "time": {name: timing.summary("ms") for name, timing in timings.items()},
        "ratio_to_softmax": {
            name: {"per_round": [a / b for a, b in zip(timing.times_s, base.times_s,
                                                       strict=True)],
                   "median": paired_ratio(timing, base)}
            for name, timing in timings.items() if name != "softmax"},
    }


def window_means(values: list[float], window: int) -> list[float]:
    """Means over consecutive windows of ``window`` values (the last may be shorter)."""
    return [round(statistics.fmean(values[i:i + window]), 4)
            for i in range(0, len(values), window)]


def train_one(kind: str, seed: int, progress: bool, plan: dict = FULL) -> dict:
    """Train model ``kind`` (one of ``MODELS``) from ``seed``; return its held-out evaluation,
    curves and timings (``plan``: ``FULL`` or ``QUICK``)."""
    task = make_task()
    torch.manual_seed(seed)
    model = make_model(kind, task)
    wall, cpu = time.perf_counter(), time.process_time()
    history = ea.train_model(model, task, plan["steps"], batch_size=TRAIN["batch_size"],
                             lr=TRAIN["lr"], seed=seed, progress=progress)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    evaluation = ea.evaluate_model(model, task, **plan["evaluation"])
    correct = correct_queries(model, task, **plan["evaluation"])
    if abs(correct.count("1") / len(correct) - evaluation["accuracy"]) > 1e-12:
        raise RuntimeError(f"{kind}, seed {seed}: the per-query answers disagree with "
                           "ea.evaluate_model")
    return {
        "seed": seed,
        "eval_accuracy": evaluation["accuracy"],
        "eval_loss": evaluation["loss"],
        "eval_correct": correct,
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
    kinds = results["config"]["models"]
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
    ax_bar.set_xticks(range(len(kinds)), kinds, rotation=20, ha="right")
    ax_bar.set(ylabel="held-out accuracy (bars: mean, dots: seeds)")
    fig.tight_layout()
    return fig


def markdown(results: dict) -> str:
    """A table of the held-out accuracy per attention."""
    timing = results["step_timing"]
    lines = ["# Associative recall: linear, gated, delta-rule and softmax attention", "",
             f"Task `{results['config']['task_spec']}`, model {results['config']['model']}, "
             f"{results['config']['training']['steps']} steps, seeds "
             f"{results['config']['seeds']}, {results['config']['evaluation']['batch_size']} "
             "held-out queries.", "",
             f"Training step: median over {timing['rounds']} rounds in turns (fresh weights, "
             "one batch); ratio: median over the rounds of the step's time over softmax's.", "",
             "| model | mean accuracy | std over seeds | min | max | step (ms) | "
             "step / softmax |",
             "|---|---|---|---|---|---|---|"]
    for kind in results["config"]["models"]:
        s = results["summary"][kind]
        step = timing["time"][kind]["median_ms"]
        ratio = timing["ratio_to_softmax"].get(kind, {"median": 1.0})["median"]
        lines.append(f"| {kind} | {s['mean']:.3f} | {s['std']:.3f} | {s['min']:.3f} | "
                     f"{s['max']:.3f} | {step:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def run_config(plan: dict) -> dict:
    """The ``config`` of a run with ``plan``."""
    return {
        "attention_kinds": list(KINDS),
        "variants": {**VARIANTS, "delta, short conv": {
            **VARIANTS["delta, short conv"], "width": CONV_WIDTH}},
        "models": list(MODELS),
        "task": TASK,
        "task_spec": repr(make_task()),
        "model": MODEL,
        "training": {**TRAIN, "steps": plan["steps"], "optimizer": "AdamW (ea.train_model)"},
        "seeds": list(plan["seeds"]),
        "evaluation": plan["evaluation"],
        "curve_window": CURVE_WINDOW,
    }


def load_earlier(path: Path, plan: dict, kept: list[str]) -> dict:
    """An earlier run to add models to (``--add-to``): it must have been made with the same
    task, model, training, seeds and evaluation, and hold the runs of the models ``kept``."""
    earlier = json.loads(Path(path).read_text())
    ours = run_config(plan)
    for key in ours.keys() - {"variants", "models"}:
        if earlier["config"].get(key) != ours[key]:
            raise SystemExit(f"--add-to: {path} has config[{key!r}] = "
                             f"{earlier['config'].get(key)!r}, this script {ours[key]!r}: "
                             "rerun every model instead")
    missing = [kind for kind in kept if kind not in earlier["runs"]]
    if missing:
        raise SystemExit(f"--add-to: {path} has no runs of {missing}: add them to --models")
    return earlier


def check_reproduced(earlier: dict, plan: dict, kind: str, progress: bool) -> dict:
    """Train model ``kind``, kept from ``earlier``, again with its first seed, and require
    the same answer to every held-out query: the kept runs are what this script would train
    now (training on a CPU is deterministic for a given torch and thread count)."""
    seed = plan["seeds"][0]
    stored = next(run for run in earlier["runs"][kind] if run["seed"] == seed)
    again = train_one(kind, seed, progress, plan)
    if again["eval_correct"] != stored["eval_correct"]:
        raise SystemExit(f"--add-to: {kind}, seed {seed} trained again answers "
                         f"{again['eval_accuracy']:.4f} of the queries, the stored run "
                         f"{stored['eval_accuracy']:.4f}: not reproducible here, rerun every "
                         "model instead")
    print(f"  {kind}, seed {seed}: trained again, the same answers to all "
          f"{len(stored['eval_correct'])} held-out queries", flush=True)
    return {"model": kind, "seed": seed, "eval_accuracy": again["eval_accuracy"],
            "identical": True}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    parser.add_argument("--models", nargs="+", choices=MODELS, metavar="MODEL",
                        help="with --add-to: the models to train")
    parser.add_argument("--add-to", type=Path, metavar="JSON",
                        help="an earlier run (its JSON) to add --models to: the other models' "
                             "runs and the capacity experiment are kept (one kept run is "
                             "trained again first and must give the same answers), the step "
                             "timing of every model is measured again")
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(results_path(NAME, out=args.out).read_text())
        write_figure(results_path(NAME, "png", out=args.out), plot(results))
        return results
    if bool(args.models) != bool(args.add_to):
        parser.error("--models and --add-to go together")
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(2)
    progress = not args.no_progress
    plan = QUICK if args.quick else FULL
    models = list(args.models or MODELS)
    kept = [kind for kind in MODELS if kind not in models]  # from the earlier run
    if args.add_to and not kept:
        parser.error("--add-to: --models names every model, so nothing is kept; run without "
                     "--add-to and --models")
    earlier = load_earlier(args.add_to, plan, kept) if args.add_to else None
    conditions = run_conditions()
    start = time.perf_counter()
    reproduced = check_reproduced(earlier, plan, kept[0], progress) if earlier else None
    runs: dict[str, list[dict]] = {kind: [] for kind in models}
    for seed in plan["seeds"]:  # seed by seed, so that a disturbance of the machine hits every kind
        for kind in models:
            if progress:
                print(f"{kind} / seed {seed}", flush=True)
            run = train_one(kind, seed, progress, plan)
            runs[kind].append(run)
            print(f"  {kind:17s} seed {seed}: held-out accuracy {run['eval_accuracy']:.3f}  "
                  f"{run['train_wall_s']:.0f} s", flush=True)
    if earlier:
        runs = {kind: runs[kind] if kind in models else earlier["runs"][kind]
                for kind in MODELS}
    if progress:
        print(f"timing one training step of every model, {plan['step_rounds']} rounds",
              flush=True)
    timing = step_timing(plan["step_rounds"])
    if earlier:
        memory = earlier["capacity"]
    else:
        if progress:
            print("capacity of one head", flush=True)
        memory = capacity(CAPACITY_QUICK if args.quick else CAPACITY)
    results = {
        "benchmark": NAME,
        "conditions": {**conditions, "wall_time_s": time.perf_counter() - start,
                       "quick": args.quick},
        "config": run_config(plan),
        "runs": runs,
        "summary": {kind: summarise(kind_runs) for kind, kind_runs in runs.items()},
        "step_timing": timing,
        "capacity": memory,
    }
    if earlier:  # where the kept runs come from
        results["conditions"]["earlier"] = {
            "conditions": earlier["conditions"], "reproduced": reproduced,
            "models": kept}
    results["conditions"].update(run_conditions(end=True))
    write_results(NAME, results, out=out, markdown=markdown(results), figure=plot(results),
                  indent=None)
    print(f"wrote {results_path(NAME, out=out)} (.md, .png) "
          f"in {results['conditions']['wall_time_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
