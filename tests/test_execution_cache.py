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


def _waiting_page(mine: str, other: str) -> dict:
    """A page that says it started, then waits (at most 60 s) until ``other`` has started:
    two of them finish only when they run at the same time."""
    page = json.loads(json.dumps(PAGE))
    page["cells"][0]["source"] = (
        "import time\nfrom pathlib import Path\n"
        f"Path('{mine}.started').touch()\n"
        "end = time.monotonic() + 60\n"
        f"while not Path('{other}.started').exists():\n"
        "    assert time.monotonic() < end, 'the other page never ran beside this one'\n"
        "    time.sleep(0.05)\n"
        f"print('value: {mine}')")
    return page


def test_missing_chapters_run_side_by_side_and_jupyter_book_reuses_them(tmp_path):
    """``--jobs 2`` executes two chapters at once (each page waits for the other: one at a
    time, the first would fail), stores them as jupyter-book's cache mode would, so that the
    build executes nothing; a second call finds nothing to do; a chapter that fails is left
    out of the cache and named."""
    root = _project(tmp_path / "book")
    (root / "_config.yml").write_text("title: t\nexecute:\n  execute_notebooks: cache\n"
                                      "  timeout: 120\nonly_build_toc_files: true\n")
    (root / "_toc.yml").write_text("format: jb-book\nroot: first\nchapters:\n"
                                   "  - file: second.ipynb\n  - file: broken\n")
    (root / "first.ipynb").write_text(json.dumps(_waiting_page("first", "second")))
    (root / "second.ipynb").write_text(json.dumps(_waiting_page("second", "first")))
    broken = json.loads(json.dumps(PAGE))
    broken["cells"][0]["source"] = "raise ValueError('a broken chapter')"
    (root / "broken.ipynb").write_text(json.dumps(broken))
    build = root / "_build"
    assert [p.name for p in execution_cache.chapters(root)] == [
        "first.ipynb", "second.ipynb", "broken.ipynb"]
    assert execution_cache.cell_timeout_s(root) == 120

    outcome = execution_cache.execute_missing(build, root, jobs=2)
    assert {p.name: error for p, error in outcome.items()} == {
        "first.ipynb": "", "second.ipynb": "",
        "broken.ipynb": outcome[root / "broken.ipynb"]}
    assert "a broken chapter" in outcome[root / "broken.ipynb"]
    assert list(execution_cache.execute_missing(build, root, jobs=2)) == [root / "broken.ipynb"]

    (root / "broken.ipynb").write_text(json.dumps(PAGE))  # mended: only it is executed
    (root / "src" / "efficient_attention" / "value.txt").write_text("mended")
    done = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build",
                           str(root)], capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert log.count("Using cached notebook") == 2, log[-3000:]
    assert log.count("Executing notebook") == 1, log[-3000:]
    for name, value in (("first", "first"), ("second", "second"), ("broken", "mended")):
        page = (build / "html" / f"{name}.html").read_text(encoding="utf-8")
        assert f"value: {value}" in page, name


def test_make_book_executes_chapters_on_every_core():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("book", "pdf"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
        assert "book/_execution_cache.py --jobs $(BOOK_JOBS)" in recipe, recipe
    assert re.search(r"^BOOK_JOBS \?= \$\(shell nproc", makefile, flags=re.M)
