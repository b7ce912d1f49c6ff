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
executed again; an unchanged hash keeps both. Usage::

    python book/_execution_cache.py [--build _build]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shutil
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=BUILD, help=f"default: {BUILD}")
    args = parser.parse_args(argv)
    if refresh(args.build):
        print(f"{args.build}: the library, the benchmark results or the versions changed; "
              "every chapter will be executed again")


if __name__ == "__main__":
    main()
