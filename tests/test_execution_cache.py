"""book/_execution_cache.py: the book's execution cache is emptied when what the chapters
read besides their own cells changes, and kept otherwise."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_execution_cache",
                                               ROOT / "book" / "_execution_cache.py")
execution_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execution_cache)


def _project(root: Path) -> Path:
    (root / "src" / "efficient_attention").mkdir(parents=True)
    (root / "src" / "efficient_attention" / "core.py").write_text("x = 1\n")
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "benchmarks" / "results" / "speed.json").write_text("{}\n")
    (root / "pyproject.toml").write_text("[project]\n")
    return root


def _filled_build(build: Path) -> Path:
    for folder in (execution_cache.CACHE, execution_cache.DOCTREES):
        (build / folder / "executed").mkdir(parents=True, exist_ok=True)
        (build / folder / "executed" / "base.ipynb").write_text("{}")
    return build


def _emptied(build: Path) -> bool:
    return not any((build / folder / "executed").exists()
                   for folder in (execution_cache.CACHE, execution_cache.DOCTREES))


def _stamp(build: Path) -> str:
    return (build / execution_cache.CACHE / execution_cache.STAMP).read_text().strip()


def test_hash_follows_the_library_and_the_results_only(tmp_path):
    root = _project(tmp_path / "project")
    first = execution_cache.inputs_hash(root)
    assert execution_cache.inputs_hash(root) == first
    (root / "src" / "efficient_attention" / "__pycache__").mkdir()
    (root / "src" / "efficient_attention" / "__pycache__" / "core.pyc").write_bytes(b"\0")
    (root / "README.md").write_text("not an input\n")
    assert execution_cache.inputs_hash(root) == first
    (root / "benchmarks" / "results" / "speed.json").write_text('{"ratio": 2}\n')
    second = execution_cache.inputs_hash(root)
    assert second != first
    (root / "src" / "efficient_attention" / "core.py").write_text("x = 2\n")
    assert execution_cache.inputs_hash(root) not in (first, second)


def test_refresh_empties_a_stale_build_and_keeps_a_current_one(tmp_path):
    root = _project(tmp_path / "project")
    build = _filled_build(tmp_path / "_build")
    # A cache without a stamp was filled by an unknown state of the inputs: emptied.
    assert execution_cache.refresh(build, root) is True
    assert _emptied(build)
    assert _stamp(build) == execution_cache.inputs_hash(root)
    # Filled again under the same inputs: kept.
    _filled_build(build)
    assert execution_cache.refresh(build, root) is False
    assert not _emptied(build)
    # A library change: both emptied, and the cache stamped with the new hash.
    (root / "src" / "efficient_attention" / "core.py").write_text("x = 3\n")
    assert execution_cache.refresh(build, root) is True
    assert _emptied(build)
    assert _stamp(build) == execution_cache.inputs_hash(root)


def test_refresh_creates_a_missing_cache(tmp_path):
    root = _project(tmp_path / "project")
    build = tmp_path / "_build"
    assert execution_cache.refresh(build, root) is False  # nothing to empty
    assert _stamp(build) == execution_cache.inputs_hash(root)


PAGE = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "reads-the-library",
               "metadata": {}, "outputs": [],
               "source": "from pathlib import Path\n"
                         "print('value:', Path('src/efficient_attention/value.txt').read_text())"}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def test_a_library_change_reaches_the_built_page(tmp_path):
    """End to end, on a one-page book: without the refresh, a rebuild after a library change
    shows the old output (the fault this script mends); with it, the new one."""
    root = _project(tmp_path / "book")
    value = root / "src" / "efficient_attention" / "value.txt"
    (root / "_config.yml").write_text("title: t\nexecute:\n  execute_notebooks: cache\n"
                                      "only_build_toc_files: true\n")
    (root / "_toc.yml").write_text("format: jb-book\nroot: page\n")
    (root / "page.ipynb").write_text(json.dumps(PAGE))
    build, page = root / "_build", root / "_build" / "html" / "page.html"

    def make_book(refresh: bool) -> str:
        if refresh:
            execution_cache.refresh(build, root)
        done = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build",
                               str(root)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return re.search(r"value: (\w+)", page.read_text(encoding="utf-8")).group(1)

    value.write_text("first")
    assert make_book(refresh=True) == "first"
    value.write_text("second")
    assert make_book(refresh=False) == "first"  # jupyter-book alone: stale
    assert make_book(refresh=True) == "second"


def test_make_book_refreshes_the_cache_jupyter_book_uses():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^book:.*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert recipe.index("book/_execution_cache.py") < recipe.index("jupyter-book build"), recipe
    assert execution_cache.BUILD == ROOT / "_build"  # jupyter-book build . writes there
    assert "execute_notebooks: cache" in (ROOT / "_config.yml").read_text(encoding="utf-8")
