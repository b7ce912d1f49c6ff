"""Approximation error of efficient attention against the number of features or landmarks.

Every method is compared with exact softmax attention ``softmax(q k^T / sqrt(d)) v`` on
inputs whose attention is far from uniform, because with near-uniform attention (iid
Gaussian inputs of unit scale) every method, and the plain mean of the values, looks
accurate. The error is measured against the *uniform baseline*

    error = ||out - exact||_F / ||exact - mean(V)||_F,

where ``mean(V)`` outputs the average value at every position (attention with equal
weights). The baseline scores exactly 1; a method is only useful below 1. Adding a
constant vector to every value changes neither the numerator (for methods whose
weights sum to one) nor the denominator, so the common part of the values, which
dominates ``||exact||`` in trained models, cannot make a method look good.

Regimes (inputs):

- ``trained_layer1``, ``trained_layer2``: queries, keys and values captured from the
  two layers of a small softmax Transformer (``ea.TinyTransformer``) trained on the
  copy task (``n = 129``), all heads.
- ``peaked_gaussian``: iid Gaussian ``q, k``, scaled so that the mean attention entropy
  is half of ``log n`` (few keys per query, in random places: a hard case).
- ``smooth_positional``: ``q, k`` = a scaled sinusoidal position code plus noise, the
  scale set for the same entropy: attention to neighbours that varies smoothly along
  the sequence (local structure: the case banded and FMM attention are designed for).
- ``topic_segments``: the sequence is cut into segments on 16 recurring topics and a
  token attends to the tokens of its topic wherever they are: non-local but nearly
  low rank (the case Nystrom attention is designed for). Same entropy.

Methods, at "size" ``m`` (8 .. 256):

- FAVOR+ positive features, orthogonal and iid frequencies (``m`` features);
- trig random Fourier features (``m/2`` frequencies, ``m`` features ``[cos, sin]``);
- Nystromformer with ``m`` landmarks (6 iterations of the iterative pseudo-inverse,
  and the exact ``torch.linalg.pinv``);
- banded softmax attention with ``w = m/2`` (each query sees ``2w + 1 ~ m`` keys);
- FMM: band ``w = m/2`` plus the two elu far fields, blended with the least-squares
  weights (an oracle: the best such blend, as trained weights could at most find);
- linear attention with ``elu + 1`` (no parameter: one value for every ``m``);
- the uniform baseline ``mean(V)`` (1 by construction).

Run ``.venv/bin/python benchmarks/approximation_error.py`` (``--quick`` for a smoke
test). Writes ``benchmarks/results/approximation_error.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from _timing import prefer_passive_wait_policy  # benchmarks/ is on sys.path

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

SIZES = (8, 16, 32, 64, 128, 256)
SEEDS = (0, 1, 2)
TARGET_ENTROPY = 0.5  # synthetic regimes: mean row entropy = 0.5 log n
SYNTHETIC = {"n": 512, "d": 64, "heads": 4}
NUM_TOPICS = 16
# The model whose attention we capture: copy task of length 64 (n = 129).
COPY = {"length": 64, "num_symbols": 8}
MODEL = {"d_model": 64, "num_heads": 4, "num_layers": 2}
# Same settings as the softmax / copy / encoder run of train_models.py (the same model).
TRAIN = {"steps": 400, "batch_size": 32, "lr": 3e-3, "seed": 0}
CAPTURE_BATCH = 4  # sequences per seed whose q, k, v are captured

METHODS = {
    "favor_positive_orthogonal": "FAVOR+ (positive, orthogonal)",
    "favor_positive_iid": "FAVOR+ (positive, iid)",
    "favor_trig": "trig RFF (orthogonal, m/2 frequencies; mostly above the plot)",
    "nystrom": "Nystromformer (6 pinv iterations)",
    "nystrom_exact_pinv": "Nystromformer (exact pinv)",
    "banded": "banded softmax (w = m/2)",
    "fmm_oracle": "FMM: band + elu far fields, least-squares weights",
    "linear_elu": "linear attention (elu + 1, no parameter)",
    "uniform": "uniform baseline: mean of V",
}


# ----------------------------------------------------------------------------- metrics


def attention_entropy_fraction(q: torch.Tensor, k: torch.Tensor) -> float:
    """Mean entropy of the rows of ``softmax(q k^T / sqrt(d))`` divided by ``log n_k``."""
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., n, n)
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (..., n)
    return (entropy.mean() / math.log(k.shape[-2])).item()


def error_vs_uniform(out: torch.Tensor, exact: torch.Tensor, v: torch.Tensor) -> float:
    """``||out - exact||_F / ||exact - mean(V)||_F`` over all heads and sequences."""
    uniform = v.mean(dim=-2, keepdim=True)  # (..., 1, d_v): the mean value
    return ((out - exact).norm() / (exact - uniform).norm()).item()


def plain_relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    """``||out - exact||_F / ||exact||_F``: the usual measure, flattered by mean(V)."""
    return ((out - exact).norm() / exact.norm()).item()


# ----------------------------------------------------------------------------- inputs


def scale_for_entropy(q: torch.Tensor, k: torch.Tensor, target: float) -> float:
    """Scale ``s`` with ``entropy(softmax(s^2 q k^T / sqrt d)) = target * log n``.

    The entropy of a softmax decreases as its inverse temperature grows, so bisection
    on ``log s`` finds the scale (to about 1e-4 relative).
    """
    low, high = math.log(1e-3), math.log(1e3)
    for _ in range(50):
        middle = 0.5 * (low + high)
        s = math.exp(middle)
        if attention_entropy_fraction(s * q, s * k) > target:
            low = middle  # too flat: scale up
        else:
            high = middle
    return math.exp(0.5 * (low + high))


def peaked_gaussian(seed: int, scale: float | None = None):
    """iid ``N(0, 1)`` queries, keys and values ``(heads, n, d)``, q and k times ``scale``."""
    g = torch.Generator().manual_seed(1000 + seed)
    shape = (SYNTHETIC["heads"], SYNTHETIC["n"], SYNTHETIC["d"])
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    if scale is None:
        scale = scale_for_entropy(q, k, TARGET_ENTROPY)
    return scale * q, scale * k, v, scale


def smooth_positional(seed: int, scale: float | None = None):
    """``q, k`` = scale * (sinusoidal code of the position + 0.3 * noise); ``v`` iid."""
    g = torch.Generator().manual_seed(2000 + seed)
    heads, n, d = SYNTHETIC["heads"], SYNTHETIC["n"], SYNTHETIC["d"]
    code = ea.sinusoidal_positional_encoding(n, d, dtype=torch.float64)  # (n, d)
    q = code + 0.3 * torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    k = code + 0.3 * torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    if scale is None:
        scale = scale_for_entropy(q, k, TARGET_ENTROPY)
    return scale * q, scale * k, v, scale


def topic_segments(seed: int, scale: float | None = None):
    """Tokens in segments of random length (8 to 40), each on one of 16 recurring topics.

    ``q, k`` = scale * (topic vector + 0.3 * noise): a query attends to the tokens of
    its topic wherever they are (non-local, nearly low rank); ``v`` iid.
    """
    g = torch.Generator().manual_seed(3000 + seed)
    heads, n, d = SYNTHETIC["heads"], SYNTHETIC["n"], SYNTHETIC["d"]
    lengths = torch.randint(8, 41, (n,), generator=g)  # more than enough segments
    ends = lengths.cumsum(0)
    segment = torch.searchsorted(ends, torch.arange(n), right=True)  # (n,): segment index
    topic_of_segment = torch.randint(NUM_TOPICS, (int(segment.max()) + 1,), generator=g)
    topics = torch.randn(heads, NUM_TOPICS, d, generator=g, dtype=torch.float64)
    centres = topics[:, topic_of_segment[segment]]  # (heads, n, d)
    q = centres + 0.3 * torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    k = centres + 0.3 * torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    if scale is None:
        scale = scale_for_entropy(q, k, TARGET_ENTROPY)
    return scale * q, scale * k, v, scale


def train_copy_model(progress: bool, steps: int) -> tuple[torch.nn.Module, dict]:
    """A softmax ``TinyTransformer`` trained (encoder mode) on the copy task."""
    task = ea.CopyTask(**COPY)
    torch.manual_seed(TRAIN["seed"])
    model = ea.TinyTransformer(task.vocab_size, max_len=task.seq_len, **MODEL)
    history = ea.train_model(
        model,
        task,
        steps,
        batch_size=TRAIN["batch_size"],
        lr=TRAIN["lr"],
        seed=TRAIN["seed"],
        progress=progress,
    )
    evaluation = ea.evaluate_model(model, task)
    return model, {"final_train_loss": history["loss"][-1], **evaluation}


@torch.no_grad()
def capture_qkv(model: torch.nn.Module, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``[(q, k, v)]`` per layer, each ``(batch, heads, n, d_head)`` float64."""
    task = ea.CopyTask(**COPY)
    captured: list[tuple[torch.Tensor, ...]] = []
    originals = []
    for block in model.blocks:
        inner = block.attention.attention
        originals.append(inner)

        def recorder(q, k, v, _inner=inner, **kwargs):
            captured.append(tuple(t.detach().double() for t in (q, k, v)))
            return _inner(q, k, v, **kwargs)

        block.attention.attention = recorder
    try:
        inputs, _ = task(CAPTURE_BATCH, generator=torch.Generator().manual_seed(3000 + seed))
        model.eval()
        model(inputs)
    finally:
        for block, inner in zip(model.blocks, originals, strict=True):
            block.attention.attention = inner
    return captured


def copy_attention_profile(q: torch.Tensor, k: torch.Tensor) -> dict[str, list[float]]:
    """Where each head of a copy-task layer looks, averaged over sequences.

    ``copy_offset``: mean weight that an answer position ``i`` (the blanks) puts on the
    symbol it must copy, ``i - (L + 1)``; ``local``: mean weight within ``|i - j| <= 2``;
    ``top``: mean largest weight of a row. One value per head.
    """
    length = COPY["length"]
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    n = weights.shape[-1]
    answers = torch.arange(length + 1, n)  # the blanks
    copy_offset = weights[..., answers, answers - (length + 1)]  # (B, h, L)
    position = torch.arange(n)
    local = (position[:, None] - position[None, :]).abs() <= 2  # (n, n)
    return {
        "copy_offset": copy_offset.mean(dim=(0, -1)).tolist(),
        "local": (weights * local).sum(-1).mean(dim=(0, -1)).tolist(),
        "top": weights.amax(-1).mean(dim=(0, -1)).tolist(),
    }


# ----------------------------------------------------------------------------- methods


def _nonnegative_blend(parts: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """``sum_i c_i parts_i`` with the ``c >= 0`` that minimises ``||. - target||_F``.

    Non-negative least squares by brute force over the active sets (``2^P - 1`` small
    least-squares problems for ``P`` parts): the best unconstrained solution on some
    subset of the parts is the constrained optimum (the KKT conditions).
    FMMAttention keeps its weights positive, hence ``c >= 0``.
    """
    design = torch.stack([p.reshape(-1) for p in parts], dim=-1)  # (N, P)
    target = target.reshape(-1, 1)
    best, best_residual = None, float("inf")
    for subset in range(1, 2 ** len(parts)):
        columns = [i for i in range(len(parts)) if subset >> i & 1]
        coef = torch.linalg.lstsq(design[:, columns], target).solution  # (|S|, 1)
        if (coef < 0).any():
            continue
        residual = (design[:, columns] @ coef - target).norm().item()
        if residual < best_residual:
            best, best_residual = design[:, columns] @ coef, residual
    return best.reshape(parts[0].shape)


def approximations(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int, seed: int, exact: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every method's output at size ``m`` (frequencies drawn with ``seed``)."""
    d, n = q.shape[-1], q.shape[-2]
    g = torch.Generator().manual_seed(seed)
    opts = {"generator": g, "dtype": q.dtype}
    w_orth = ea.gaussian_random_matrix(m, d, orthogonal=True, **opts)
    w_iid = ea.gaussian_random_matrix(m, d, **opts)
    w_trig = ea.gaussian_random_matrix(max(m // 2, 1), d, orthogonal=True, **opts)
    out = {
        "favor_positive_orthogonal": ea.favor_attention(q, k, v, w_orth),
        "favor_positive_iid": ea.favor_attention(q, k, v, w_iid),
        "favor_trig": ea.favor_attention(q, k, v, w_trig, features="trig"),
    }
    if m <= n:
        out["nystrom"] = ea.nystrom_attention(q, k, v, m)
        out["nystrom_exact_pinv"] = ea.nystrom_attention(q, k, v, m, pinv_iterations=None)
    band = ea.banded_attention(q, k, v, m // 2)
    out["banded"] = band
    far_maps = (ea.elu_feature_map, ea.elu_negative_feature_map)
    far = [ea.linear_attention(q, k, v, feature_map) for feature_map in far_maps]
    out["fmm_oracle"] = _nonnegative_blend([band, *far], exact)
    return out


def evaluate_regime(
    inputs_for_seed, sizes: tuple[int, ...], seeds: tuple[int, ...], progress: bool, name: str
) -> dict:
    """Errors of every method for every size and seed on one regime."""
    from tqdm.auto import tqdm

    per_seed: dict[str, list[list[float]]] = {key: [] for key in METHODS}
    plain: dict[str, list[float]] = {"uniform": [], "linear_elu": []}
    entropies, sq_norms = [], []
    for seed in tqdm(seeds, desc=f"approximation error: {name}", disable=not progress):
        q, k, v = inputs_for_seed(seed)
        exact = ea.softmax_attention(q, k, v)
        entropies.append(attention_entropy_fraction(q, k))
        # FAVOR+'s relative variance grows like exp(|x + y|^2), x = d^-1/4 q: keep the sizes
        sq_norms.append(((q.square().sum(-1).mean() + k.square().sum(-1).mean()) / 2
                         / math.sqrt(q.shape[-1])).item())
        linear = ea.linear_attention(q, k, v)
        uniform = v.mean(dim=-2, keepdim=True).expand_as(exact)
        plain["uniform"].append(plain_relative_error(uniform, exact))
        plain["linear_elu"].append(plain_relative_error(linear, exact))
        rows: dict[str, list[float]] = {key: [] for key in METHODS}
        for m in sizes:
            outs = approximations(q, k, v, m, seed, exact)
            outs["linear_elu"], outs["uniform"] = linear, uniform
            for key in METHODS:
                value = error_vs_uniform(outs[key], exact, v) if key in outs else None
                rows[key].append(value)
        for key in METHODS:
            per_seed[key].append(rows[key])
    summary = {}
    for key, runs in per_seed.items():
        columns = list(zip(*runs, strict=True))  # one tuple of seeds per size
        mean = [None if None in c else sum(c) / len(c) for c in columns]
        std = [
            None if None in c else math.sqrt(sum((x - mu) ** 2 for x in c) / len(c))
            for c, mu in zip(columns, mean, strict=True)
        ]
        summary[key] = {"label": METHODS[key], "mean": mean, "std": std, "per_seed": runs}
    return {
        "entropy_fraction": sum(entropies) / len(entropies),
        "mean_scaled_sq_norm": sum(sq_norms) / len(sq_norms),  # mean |d^-1/4 q|^2, |.. k|^2
        "plain_relative_error": {key: sum(x) / len(x) for key, x in plain.items()},
        "methods": summary,
    }


# ----------------------------------------------------------------------------- plot


def plot(results: dict):
    """The figure of ``approximation_error.png``."""
    plt = pyplot()
    regimes = results["regimes"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.2 * len(regimes), 4.0), sharey=True)
    styles = {
        "favor_positive_orthogonal": ("C0", "o", "-"),
        "favor_positive_iid": ("C0", "o", ":"),
        "favor_trig": ("C1", "s", "-"),
        "nystrom": ("C2", "^", "-"),
        "nystrom_exact_pinv": ("C2", "^", ":"),
        "banded": ("C3", "v", "-"),
        "fmm_oracle": ("C4", "D", "-"),
        "linear_elu": ("C5", None, "--"),
        "uniform": ("k", None, "--"),
    }
    for ax, (name, regime) in zip(axes, regimes.items(), strict=True):
        sizes = regime["sizes"]
        for key, entry in regime["methods"].items():
            pairs = [(m, e) for m, e in zip(sizes, entry["mean"], strict=True) if e is not None]
            color, marker, line = styles[key]
            ax.plot(*zip(*pairs, strict=True), color=color, marker=marker, ls=line,
                    label=entry["label"], ms=4)
        ax.set(xscale="log", yscale="log", xlabel="m (features, landmarks, keys per query)",
               title=f"{name} (n={regime['n']}, H={regime['entropy_fraction']:.2f} log n)")
        ax.set_xticks(sizes, [str(m) for m in sizes])
        ax.set_ylim(1e-2, 10)  # trig features lie mostly above: see the JSON
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("||out - exact|| / ||exact - mean(V)||")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(results_path("approximation_error", out=args.out).read_text())
        write_figure(results_path("approximation_error", "png", out=args.out), plot(results))
        return results
    out = output_folder(args.quick, args.out)
    torch.set_num_threads(2)
    progress = not args.no_progress
    sizes = (8, 32) if args.quick else SIZES
    seeds = (0,) if args.quick else SEEDS
    steps = 4 if args.quick else TRAIN["steps"]
    conditions = run_conditions()
    start = time.perf_counter()

    regimes: dict[str, dict] = {}
    model, training = train_copy_model(progress, steps)
    n_trained = 2 * COPY["length"] + 1
    trained_sizes = tuple(m for m in sizes if m < n_trained)
    captures = {seed: capture_qkv(model, seed) for seed in seeds}
    for layer in range(MODEL["num_layers"]):
        result = evaluate_regime(
            lambda seed, layer=layer: captures[seed][layer],
            trained_sizes, seeds, progress, f"trained layer {layer + 1}",
        )
        regimes[f"trained_layer{layer + 1}"] = {
            "description": (
                f"q, k, v of layer {layer + 1} of a softmax TinyTransformer trained on "
                f"CopyTask(length={COPY['length']}) ({steps} steps; eval accuracy "
                f"{training['accuracy']:.3f}); {CAPTURE_BATCH} sequences x "
                f"{MODEL['num_heads']} heads, d_head={MODEL['d_model'] // MODEL['num_heads']}"
            ),
            "n": n_trained,
            "sizes": list(trained_sizes),
            "attention_profile": copy_attention_profile(*captures[seeds[0]][layer][:2]),
            **result,
        }
    for name, make in (("peaked_gaussian", peaked_gaussian),
                       ("smooth_positional", smooth_positional),
                       ("topic_segments", topic_segments)):
        scale = make(0)[3]
        result = evaluate_regime(
            lambda seed, make=make, scale=scale: make(seed, scale)[:3],
            sizes, seeds, progress, name,
        )
        regimes[name] = {
            "description": (make.__doc__ or "").strip().splitlines()[0]
            + f" Scale {scale:.4f} (entropy target {TARGET_ENTROPY} log n).",
            "n": SYNTHETIC["n"],
            "d": SYNTHETIC["d"],
            "heads": SYNTHETIC["heads"],
            "scale": scale,
            "sizes": list(sizes),
            **result,
        }

    results = {
        "benchmark": "approximation_error",
        "metric": "||out - exact||_F / ||exact - mean(V)||_F (uniform baseline = 1)",
        "conditions": {**conditions, "wall_time_s": time.perf_counter() - start,
                       "quick": args.quick},
        "config": {"sizes": list(sizes), "seeds": list(seeds), "target_entropy": TARGET_ENTROPY,
                   "synthetic": SYNTHETIC, "copy_task": COPY, "model": MODEL,
                   "training": {**TRAIN, "steps": steps}, "dtype": "float64"},
        "trained_model": training,
        "methods": METHODS,
        "regimes": regimes,
    }
    results["conditions"].update(run_conditions(end=True))
    write_results("approximation_error", results, out=out, figure=plot(results), indent=1)
    print(f"wrote {out / 'approximation_error.json'} and .png "
          f"in {results['conditions']['wall_time_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
