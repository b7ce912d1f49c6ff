"""Keep the book's execution cache true to the code the chapters run.

jupyter-book (``execute_notebooks: cache``) keeps each chapter's outputs in
``_build/.jupyter_cache`` and reuses them while the chapter's code cells are unchanged, even
when the library the chapter imports, or the committed benchmark results it reads, have
changed since. The book would then show figures and numbers that the current code no longer
makes, and a chapter that a library change breaks would still build.

This script runs before ``jupyter-book build`` (``make book`` does it). It hashes what the
chapters depend on besides their own cells (``INPUTS``, and the versions of Python and
PyTorch). When the hash differs from the one stored with the cache, it empties the cache and
removes Sphinx's saved environment (``_build/.doctrees``): without the second, Sphinx would not
even read the unchanged notebooks again, and nothing would be executed. Every chapter is then
executed again; an unchanged hash keeps both.

It then executes, ``--jobs`` at a time, every chapter of the table of contents that the cache
lacks, and stores each in the cache exactly as jupyter-book would (``myst_nb``'s cache mode:
same executor, working folder, cell timeout, and a match by the hash of the code cells), so that
``jupyter-book build`` finds them all and executes nothing: on two cores the chapters, which
spend much of their time in one thread, are executed in about half the time one at a time
takes (179 s against about 350 s). A chapter that fails is left out of the cache;
jupyter-book then executes it again and reports the error as usual. ``--jobs 1`` executes
them one at a time (for timings printed by the chapters on a quiet machine, when publishing).
Usage::

    python book/_execution_cache.py [--build _build] [--jobs N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "_build"
CACHE = ".jupyter_cache"  # in the build folder: jupyter-book 1.x's execution cache
DOCTREES = ".doctrees"  # in the build folder: Sphinx's saved environment
STAMP = "inputs.sha256"  # in the cache
# What the chapters read besides their own cells: the library, the committed benchmark results
# (``ea.find_results``), and the pins of the installed packages.
INPUTS = ("src/efficient_attention", "benchmarks/results", "pyproject.toml", "constraints.txt")


def _files(root: Path) -> list[Path]:
    paths = []
    for name in INPUTS:
        path = root / name
        if path.is_file():
            paths.append(path)
        elif path.is_dir():
            paths.extend(p for p in path.rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts)
    return sorted(paths)


def inputs_hash(root: Path = ROOT) -> str:
    """SHA-256 over the path and bytes of every file of ``INPUTS`` under ``root``, and the
    versions of Python and PyTorch."""
    digest = hashlib.sha256()
    for path in _files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    digest.update(f"python {platform.python_version()} torch {torch_version}".encode())
    return digest.hexdigest()


def refresh(build: Path = BUILD, root: Path = ROOT) -> bool:
    """Empty the execution cache of the build folder ``build``, and remove its Sphinx
    environment, unless the cache was filled with the current inputs; return whether they were
    removed. Afterwards the cache (existing or not) is stamped with the current hash."""
    current = inputs_hash(root)
    cache = build / CACHE
    stamp = cache / STAMP
    stored = stamp.read_text().strip() if stamp.is_file() else None
    stale = stored != current and (cache.exists() or (build / DOCTREES).exists())
    if stale:
        for folder in (cache, build / DOCTREES):
            shutil.rmtree(folder, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    stamp.write_text(current + "\n")
    return stale


def chapters(root: Path = ROOT) -> list[Path]:
    """The notebooks of the table of contents (``_toc.yml``), in its order."""
    import yaml

    found = []

    def walk(node):
        if isinstance(node, dict):
            for key in ("root", "file"):
                if isinstance(node.get(key), str):
                    found.append(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8")))
    paths = [root / f"{entry.removesuffix('.ipynb')}.ipynb" for entry in found]
    return list(dict.fromkeys(p for p in paths if p.is_file()))


def cell_timeout_s(root: Path = ROOT) -> int:
    """The per-cell timeout of ``_config.yml`` (``execute.timeout``; jupyter-book's default,
    30 s, when it sets none)."""
    import yaml

    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8")) or {}
    return int((config.get("execute") or {}).get("timeout", 30))


def _execute(path: Path, notebook, timeout_s: int):
    """Execute one chapter (``notebook``, read from ``path``) as myst_nb's cache mode does, in
    place: (path, the executed notebook or None, seconds, error text)."""
    from jupyter_cache.executors.utils import single_nb_execution

    result = single_nb_execution(notebook, cwd=str(path.parent), allow_errors=False,
                                 timeout=timeout_s, meta_override=True)
    if result.err is not None:
        return path, None, result.time, f"{type(result.err).__name__}: {result.err}"[:300]
    return path, notebook, result.time, ""


def execute_missing(build: Path = BUILD, root: Path = ROOT, jobs: int = 1) -> dict:
    """Execute, ``jobs`` at a time, the chapters with no match in the execution cache of
    ``build`` and store those that run without an error; returns ``{path: error or ""}``."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(str(build / CACHE))
    missing = []  # (path, notebook): each read once, matched, then executed
    for path in chapters(root):
        notebook = nbformat.read(path, as_version=4)
        try:
            cache.match_cache_notebook(notebook)
        except KeyError:
            missing.append((path, notebook))
    if not missing:
        return {}
    timeout_s, outcome, start = cell_timeout_s(root), {}, time.perf_counter()
    print(f"executing {len(missing)} chapter(s), {jobs} at a time", flush=True)
    # threads are enough: each chapter runs in a kernel process of its own; a thread only
    # passes its messages
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        running = [pool.submit(_execute, path, notebook, timeout_s)
                   for path, notebook in missing]
        for done in concurrent.futures.as_completed(running):
            path, notebook, seconds, error = done.result()
            outcome[path] = error
            if notebook is not None:
                cache.add_nb_to_project(str(path))
                cache.cache_notebook_bundle(
                    CacheBundleIn(notebook, str(path), data={"execution_seconds": seconds}),
                    check_validity=False, overwrite=True)
            state = f"failed ({error}); jupyter-book will run it again" if error else "done"
            print(f"  [{len(outcome)}/{len(missing)}] {path.relative_to(root)}: {seconds:.0f} s,"
                  f" {state}", flush=True)
    print(f"executed in {time.perf_counter() - start:.0f} s", flush=True)
    return outcome


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=BUILD, help=f"default: {BUILD}")
    parser.add_argument("--jobs", type=int, default=1,
                        help="chapters executed at a time (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if refresh(args.build):
        print(f"{args.build}: the library, the benchmark results or the versions changed; "
              "every chapter will be executed again")
    execute_missing(args.build, ROOT, args.jobs)


if __name__ == "__main__":
    main()
