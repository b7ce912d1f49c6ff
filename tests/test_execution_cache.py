"""book/_execution_cache.py: the book's execution cache is emptied when what the chapters
read besides their own cells changes, and kept otherwise."""

from __future__ import annotations

import importlib.util
import re
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


def _filled_cache(path: Path) -> Path:
    (path / "executed" / "abc").mkdir(parents=True)
    (path / "executed" / "abc" / "base.ipynb").write_text("{}")
    return path


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


def test_refresh_empties_a_stale_cache_and_keeps_a_current_one(tmp_path):
    root = _project(tmp_path / "project")
    cache = _filled_cache(tmp_path / "cache")
    # A cache without a stamp was filled by an unknown state of the inputs: emptied.
    assert execution_cache.refresh(cache, root) is True
    assert not (cache / "executed").exists()
    assert (cache / execution_cache.STAMP).read_text().strip() == execution_cache.inputs_hash(root)
    # Filled again under the same inputs: kept.
    _filled_cache(cache)
    assert execution_cache.refresh(cache, root) is False
    assert (cache / "executed" / "abc" / "base.ipynb").is_file()
    # A library change: emptied, and stamped with the new hash.
    (root / "src" / "efficient_attention" / "core.py").write_text("x = 3\n")
    assert execution_cache.refresh(cache, root) is True
    assert not (cache / "executed").exists()
    assert (cache / execution_cache.STAMP).read_text().strip() == execution_cache.inputs_hash(root)


def test_refresh_creates_a_missing_cache(tmp_path):
    root = _project(tmp_path / "project")
    cache = tmp_path / "build" / ".jupyter_cache"
    assert execution_cache.refresh(cache, root) is False  # nothing to empty
    assert (cache / execution_cache.STAMP).is_file()


def test_make_book_refreshes_the_cache_jupyter_book_uses():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^book:.*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert recipe.index("book/_execution_cache.py") < recipe.index("jupyter-book build"), recipe
    # jupyter-book 1.x keeps its cache in <build folder>/.jupyter_cache, the default here
    assert execution_cache.CACHE == ROOT / "_build" / ".jupyter_cache"
    assert "execute_notebooks: cache" in (ROOT / "_config.yml").read_text(encoding="utf-8")
