"""One writer for the benchmark scripts: where results go, how they are written, and the
conditions (machine, versions, load) stored with them.

Every script in ``benchmarks/`` writes ``<name>.json`` (and, when it has them, ``<name>.md``
and ``<name>.png``) into ``benchmarks/results/`` or the folder given by its ``--out``::

    import _results  # benchmarks/ is on sys.path when a script runs as benchmarks/x.py

    parser = argparse.ArgumentParser()
    _results.add_output_arguments(parser)          # --quick and --out
    args = parser.parse_args()
    out = _results.output_folder(args.quick, args.out)  # a scratch folder for --quick
    conditions = _results.run_conditions()          # at the start: machine, versions, load
    report = {"conditions": conditions, ...}        # ... measure ...
    report["conditions"].update(_results.run_conditions(end=True))
    _results.write_results("my_bench", report, out=out,
                           markdown="# My benchmark\\n...", figure=make_figure(report))
    # make_figure: build it with ``plt = _results.pyplot()``; write_results saves and closes it

API:

- ``RESULTS_DIR``: ``benchmarks/results/``, where the committed results live.
- ``results_path(name, suffix="json", out=None)``: the file ``<out>/<name>.<suffix>``.
- ``add_output_arguments(parser)``: the shared options ``--quick`` and ``--out FOLDER``.
- ``output_folder(quick, out)``: the folder to write to: ``out`` if given, else
  ``RESULTS_DIR`` for a full run and a fresh temporary folder for a quick one.
- ``load_average()``: ``os.getloadavg()`` (1, 5, 15 minutes) rounded, or ``None``.
- ``machine_info()``: versions, processor, cores, CUDA, and the thread settings of
  ``_timing.thread_settings()`` (torch threads, ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``).
- ``run_conditions(end=False)``: ``machine_info()`` plus start time and load average
  (``load_average_start``); with ``end=True`` only ``finished`` and ``load_average_end``.
- ``pyplot()``: matplotlib's ``pyplot`` on the non-interactive Agg backend.
- ``write_json(path, data)``, ``write_text(path, text)``, ``write_figure(path, figure)``:
  atomic writes (a ``.tmp`` file beside the target, then ``os.replace``), so that a run
  that dies half way never leaves a truncated result for the book to read.
- ``write_results(name, data, *, out=None, markdown=None, figure=None)``: all of them at
  once; returns the paths written.

A quick run (``--quick``) never overwrites the committed results: without ``--out`` it
writes to a temporary folder (``output_folder``), ``output_folder`` refuses
``--quick --out benchmarks/results``, and ``write_results`` refuses to write a report whose
``quick`` flag (top level or under ``conditions``) is true into ``RESULTS_DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests): the
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling _timing must import
from _timing import thread_settings  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

__all__ = [
    "RESULTS_DIR", "add_output_arguments", "load_average", "machine_info", "output_folder",
    "pyplot", "results_path", "run_conditions", "write_figure", "write_json", "write_results",
    "write_text",
]


def results_path(name: str, suffix: str = "json", out: Path | str | None = None) -> Path:
    """``<out>/<name>.<suffix>``; ``out`` defaults to ``benchmarks/results/``."""
    return Path(out if out is not None else RESULTS_DIR) / f"{name}.{suffix}"


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark script shares: ``--quick`` and ``--out FOLDER``."""
    parser.add_argument("--quick", action="store_true",
                        help="a fast smoke test (small sizes, few repeats)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: benchmarks/results/, or a temporary "
                             "folder with --quick)")


def output_folder(quick: bool, out: Path | str | None) -> Path:
    """Where a run writes: ``out`` if given, else ``RESULTS_DIR`` (full run) or a new
    temporary folder (quick run). A quick run aimed at ``RESULTS_DIR`` raises ``ValueError``.
    """
    if out is None:
        if not quick:
            return RESULTS_DIR
        folder = Path(tempfile.mkdtemp(prefix="bench_quick_"))
        print(f"quick run: results go to {folder}", flush=True)
        return folder
    folder = Path(out)
    if quick and folder.resolve() == RESULTS_DIR:
        raise ValueError(f"out: a quick run would overwrite the committed results in "
                         f"{RESULTS_DIR}; expected another folder")
    return folder


# --- conditions of a measurement ------------------------------------------------------------

def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (other work on the machine), or ``None``."""
    if not hasattr(os, "getloadavg"):
        return None
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    """Versions, processor, cores, CUDA, and the threads the times were taken with (torch's
    count, ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``: ``_timing.thread_settings()``)."""
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        **thread_settings(),
    }
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name()
    return info


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_conditions(end: bool = False) -> dict[str, Any]:
    """Date, machine and load average: the conditions of a measurement.

    At the start: ``started``, every field of :func:`machine_info` and
    ``load_average_start``. With ``end=True`` only ``finished`` and ``load_average_end``
    (merge them into the first with ``dict.update``).
    """
    if end:
        return {"finished": _now(), "load_average_end": load_average()}
    return {"started": _now(), **machine_info(), "load_average_start": load_average()}


# --- atomic writes --------------------------------------------------------------------------

def _replace_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Write through ``write(tmp)`` into ``<path>.tmp``, then move it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path | str, text: str) -> Path:
    """Write ``text`` (a final newline added if missing) atomically."""
    text = text if text.endswith("\n") else text + "\n"
    return _replace_atomically(Path(path), lambda tmp: tmp.write_text(text))


def write_json(path: Path | str, data: Any, indent: int | None = 1) -> Path:
    """Write ``data`` as JSON atomically (serialised first, so a bad value writes nothing)."""
    return write_text(path, json.dumps(data, indent=indent))


def pyplot():
    """matplotlib's ``pyplot``, on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figure(path: Path | str, figure, dpi: int = 120) -> Path:
    """Save a matplotlib ``figure`` as PNG atomically, then close it."""
    try:
        return _replace_atomically(
            Path(path), lambda tmp: figure.savefig(tmp, dpi=dpi, format="png"))
    finally:
        pyplot().close(figure)


def _is_quick(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    conditions = data.get("conditions")
    return bool(data.get("quick")) or (isinstance(conditions, dict)
                                       and bool(conditions.get("quick")))


def write_results(name: str, data: Any, *, out: Path | str | None = None,
                  markdown: str | None = None, figure=None, dpi: int = 120,
                  indent: int | None = 1) -> dict[str, Path]:
    """Write ``<name>.json`` (and ``<name>.md``, ``<name>.png`` when given) into ``out``.

    ``markdown`` is the text of the table file; ``figure`` a matplotlib figure (closed
    after saving). The JSON is written last, so that its presence means the run finished.
    Raises ``ValueError`` when a quick run (``data["quick"]`` or
    ``data["conditions"]["quick"]`` true) would land in the committed ``RESULTS_DIR``.
    Returns ``{"json": path, "md": path, "png": path}`` for the files written.
    """
    folder = Path(out if out is not None else RESULTS_DIR)
    if _is_quick(data) and folder.resolve() == RESULTS_DIR:
        raise ValueError(f"out: a quick run would overwrite the committed results in "
                         f"{RESULTS_DIR}; expected another folder (pass --out)")
    written: dict[str, Path] = {}
    if markdown is not None:
        written["md"] = write_text(results_path(name, "md", folder), markdown)
    if figure is not None:
        written["png"] = write_figure(results_path(name, "png", folder), figure, dpi=dpi)
    written["json"] = write_json(results_path(name, "json", folder), data, indent=indent)
    return written
