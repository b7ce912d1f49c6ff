"""Chapters read as prose, and run outside the repository (issue 26).

What a reader of a chapter page sees is the chapter: no test or build plumbing, and code that
fits the text column. A code cell is *visible* unless it is tagged ``hide-input``, ``hide-cell``,
``remove-input`` or ``remove-cell`` (folded or left out of the page). These rules read the stored
notebooks; tests/test_browser.py checks the same things on the built pages.

1. No nbval markers anywhere: a cell whose output varies carries the tag ``nbval-ignore-output``
   (which nbval honours) instead of a ``# NBVAL_IGNORE_OUTPUT`` line.
2. No private module of the library is used, in any cell (``efficient_attention._x``, ``ea._x``).
3. No plumbing in visible cells: no ``myst_nb``/``glue`` (numbers for the text go through
   ``store``, defined in the chapter's hidden setup cell), no ``torch.set_num_threads`` with a
   machine-sized count, no comment about the machines or their cores.
4. Visible code lines fit the column: ``COLUMN`` characters, the width of a code block of the
   built book at the browser test's viewport (1280 x 720 px; measured: 684 px of block, 16 px of
   padding each side, 8.43 px per character of the monospace font at 14 px, so 77 characters
   fit; 76 leaves a margin). ``make lint`` runs ruff's formatter on the chapters at that width.
5. Every chapter begins with a note, left out of the page (``remove-cell``) but first in the
   downloaded notebook, giving the one ``pip install`` (the wheel that ``make book`` builds and
   book/intro.md offers) that makes it run; a hidden setup cell draws figures as SVG; every
   figure has alt text saying what it shows (cell metadata ``mystnb.image.alt``).
6. A downloaded chapter runs outside the clone with only the wheel installed
   (``test_downloaded_chapter_runs_outside_the_repository``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import yaml
from notebook_files import cell_source as _source
from notebook_files import load_json as _load
from notebook_files import relative as _rel

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("*.ipynb"))
COLUMN = 76
FOLDED = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                    flags=re.MULTILINE).group(1)
WHEEL_NAME = f"efficient_attention-{VERSION}-py3-none-any.whl"
REPOSITORY = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]

NBVAL = re.compile(r"NBVAL_")
PRIVATE = re.compile(r"\b(?:from|import)\s+efficient_attention\._|\bea\._(?!_)")
PLUMBING = re.compile(
    r"\bmyst_nb\b|\bglue\(|^\s*def store\b"  # the glue plumbing
    r"|set_num_threads\(\s*[2-9]"  # a thread count sized for some machine
    r"|#.*\b(?:machines?|(?:one|two|four|\d+|CPU) cores?)\b",  # comments about the machine
    flags=re.MULTILINE,
)
# A code cell that draws a figure (as tests/test_book.py recognises one).
DRAWS_FIGURE = re.compile(r"\bplt\.(subplots|figure|show|imshow|matshow|hist|plot)\b")
PATH_LIKE = re.compile(r"^\S*\.(png|svg|jpe?g|gif|pdf)$|^\S*/\S*$", flags=re.IGNORECASE)


def _tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _code_cells(path: Path) -> list[dict]:
    return [cell for cell in _load(path)["cells"] if cell["cell_type"] == "code"]


def _visible_code_cells(path: Path) -> list[dict]:
    return [cell for cell in _code_cells(path) if not FOLDED & _tags(cell)]


def _found(pattern: re.Pattern, cells: list[dict]) -> list[str]:
    return [f"{cell.get('id')}: {match.group(0).strip()!r}"
            for cell in cells for match in pattern.finditer(_source(cell))]


def test_there_are_chapters():
    assert CHAPTERS, "book/ has no chapters"


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_no_nbval_markers(path):
    found = _found(NBVAL, _code_cells(path))
    assert not found, (f"{_rel(path)}: nbval markers in the code ({found}); tag the cell "
                       "nbval-ignore-output instead")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_no_private_library_modules(path):
    found = _found(PRIVATE, _code_cells(path))
    assert not found, (f"{_rel(path)} uses private parts of the library: {found}; make the name "
                       "public in its module (and its __all__) or move the code into the chapter")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_visible_cells_carry_no_plumbing(path):
    found = _found(PLUMBING, _visible_code_cells(path))
    assert not found, (f"{_rel(path)}: visible code cells show plumbing: {found}; it belongs in "
                       "the chapter's setup cell (tagged remove-input)")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_visible_code_fits_the_column(path):
    wide = [f"{cell.get('id')}: {len(line)} characters: {line.strip()[:60]!r}"
            for cell in _visible_code_cells(path)
            for line in _source(cell).split("\n") if len(line) > COLUMN]
    assert not wide, (f"{_rel(path)}: visible code lines wider than the {COLUMN}-character "
                      f"column ({len(wide)}):\n" + "\n".join(wide[:20]))


def test_lint_formats_the_chapters_at_the_column():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^BOOK_LINE_LENGTH\s*:?=\s*{COLUMN}\s*$", makefile, flags=re.MULTILINE), (
        f"Makefile: BOOK_LINE_LENGTH must be {COLUMN}, the column of tests/test_chapter_prose.py")
    lint = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert lint and re.search(r"ruff format --check --line-length \$\(BOOK_LINE_LENGTH\) "
                              r"\$\(CHAPTERS\)", lint.group(1)), (
        "the lint recipe must check the chapters' formatting at BOOK_LINE_LENGTH")
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run([str(ruff), "format", "--check", "--line-length", str(COLUMN),
                           *map(str, CHAPTERS)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, (f"chapters not formatted at {COLUMN} characters (ruff format "
                                  f"--line-length {COLUMN} book/*.ipynb):\n{done.stdout}")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_chapter_begins_with_its_install_note(path):
    first = _load(path)["cells"][0]
    assert first["cell_type"] == "markdown" and "remove-cell" in _tags(first), (
        f"{_rel(path)}: the first cell must be the install note, a markdown cell tagged "
        f"remove-cell; got a {first['cell_type']} cell tagged {sorted(_tags(first))}")
    note = _source(first)
    assert f"pip install {WHEEL_NAME}" in note, (
        f"{_rel(path)}: the install note must give `pip install {WHEEL_NAME}`:\n{note}")
    assert f"pip install git+{REPOSITORY}" in note, (
        f"{_rel(path)}: the install note must name the repository ({REPOSITORY}):\n{note}")
    reads_results = any("benchmarks" in _source(cell) and "results" in _source(cell)
                        for cell in _code_cells(path))
    assert reads_results == ("benchmarks/results/" in note), (
        f"{_rel(path)}: the note must say that the chapter needs benchmarks/results/ exactly "
        "when the chapter reads it")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_figures_are_svg_with_alt_text(path):
    cells = _code_cells(path)
    setup = [index for index, cell in enumerate(cells)
             if FOLDED & _tags(cell)
             and 'InlineBackend.figure_formats = ["svg"]' in _source(cell)]
    drawing = [index for index, cell in enumerate(cells) if DRAWS_FIGURE.search(_source(cell))]
    assert drawing, f"{_rel(path)} draws no figure"
    assert setup and setup[0] < drawing[0], (
        f"{_rel(path)}: a hidden setup cell must set InlineBackend.figure_formats = [\"svg\"] "
        "before the first figure")
    bad = []
    for index in drawing:
        cell = cells[index]
        alt = cell.get("metadata", {}).get("mystnb", {}).get("image", {}).get("alt", "")
        if len(alt.split()) < 8 or PATH_LIKE.match(alt.strip()) or "$" in alt:
            bad.append(f"{cell.get('id')}: {alt!r}")
    assert not bad, (f"{_rel(path)}: figures need alt text saying what they show, in plain "
                     f"words (cell metadata mystnb.image.alt): {bad}")


def test_intro_offers_the_wheel():
    intro = (BOOK / "intro.md").read_text()
    link = f"</book/_downloads/{WHEEL_NAME}>`"
    assert re.search(r"\{download\}`" + re.escape(WHEEL_NAME) + r"\s*" + re.escape(link), intro), (
        f"book/intro.md must offer the wheel: {{download}}`{WHEEL_NAME} {link}")
    makefile = (ROOT / "Makefile").read_text()
    assert "book/_downloads/efficient_attention-$(VERSION)-py3-none-any.whl" in makefile
    assert re.search(r"^book:.*\$\(WHEEL\)", makefile, flags=re.MULTILINE), (
        "make book must build the wheel first")


def test_plumbing_rules_recognise_plumbing():
    # Guards the patterns the tests above rely on.
    assert NBVAL.search("# NBVAL_IGNORE_OUTPUT\nx = 1")
    assert PRIVATE.search("from efficient_attention._blockwise import causal_prefix_products")
    assert PRIVATE.search("import efficient_attention._checks as checks")
    assert PRIVATE.search("out = ea._stabilised.run(x)")
    assert not PRIVATE.search("print(ea.__version__, ea.causal_prefix_products)")
    assert PLUMBING.search("from myst_nb import glue")
    assert PLUMBING.search("    glue(name, value, display=False)")
    assert PLUMBING.search("def store(name, value):\n    pass")
    assert PLUMBING.search("torch.set_num_threads(2)")
    assert PLUMBING.search("x = 1  # the course machines have two cores")
    assert PLUMBING.search("x = 1  # fast on 2 cores")
    assert not PLUMBING.search("peak = 312e12  # FLOP/s (fp16 tensor cores)")
    assert not PLUMBING.search("threads = torch.get_num_threads()\ntorch.set_num_threads(1)\n"
                               "torch.set_num_threads(threads)\nstore('x', 1)\nstored = 2")
    assert PATH_LIKE.match("_images/0a1b2c.svg") and PATH_LIKE.match("figure.png")
    assert not PATH_LIKE.match("A plot of the time against the length.")


@pytest.mark.parametrize("path", [p for p in CHAPTERS if "def store" in p.read_text()], ids=_rel)
def test_setup_cell_runs_without_myst_nb(path):
    """Outside the book's build ``myst_nb`` may be missing: ``store`` still works (a no-op)."""
    setup = next(cell for cell in _code_cells(path) if "def store" in _source(cell))
    assert "remove-input" in _tags(setup), f"{_rel(path)}: the setup cell must be remove-input"
    code = "\n".join(line for line in _source(setup).split("\n") if not line.startswith("%"))
    blocked = sys.modules.get("myst_nb", None), "myst_nb" in sys.modules
    sys.modules["myst_nb"] = None  # `import myst_nb` raises ImportError
    try:
        import numpy as np
        import torch

        namespace = {"np": np, "torch": torch}
        threads = torch.get_num_threads()
        try:
            exec(compile(code, f"{_rel(path)}:setup", "exec"), namespace)
        finally:
            torch.set_num_threads(threads)
        namespace["store"]("a-number", np.float64(1.5))
        namespace["store"]("a-tensor", torch.tensor(2.0))
    finally:
        if blocked[1]:
            sys.modules["myst_nb"] = blocked[0]
        else:
            del sys.modules["myst_nb"]


# --- the library outside the repository ------------------------------------------------------

# The chapter run outside the clone: the quickest (16 s), with a setup cell like every other.
OUTSIDE_CHAPTER = BOOK / "kernels.ipynb"
DRIVER = textwrap.dedent("""
    import sys
    import nbformat
    from nbclient import NotebookClient

    notebook_path, workdir, clone_src = sys.argv[1], sys.argv[2], sys.argv[3]
    nb = nbformat.read(notebook_path, as_version=4)
    # Where the kernel found the library, and whether the clone's src/ was on its path.
    nb.cells.append(nbformat.v4.new_code_cell(
        "import sys, efficient_attention\\n"
        "print('LIBRARY', efficient_attention.__file__)\\n"
        f"print('SRC_ON_PATH', {clone_src!r} in [p.rstrip('/') for p in sys.path])"))
    client = NotebookClient(nb, kernel_name="wheel-python", timeout=600,
                            resources={"metadata": {"path": workdir}})
    client.execute()
    print(nb.cells[-1].outputs[0]["text"], end="")
""")


@pytest.mark.slow
def test_downloaded_chapter_runs_outside_the_repository(tmp_path):
    """Build the wheel as ``make book`` does (from a scratch copy of the sources), install it in
    a virtual environment outside the clone whose only other packages are the third-party ones
    of .venv (added by a .pth line: .venv's own .pth files, among them the editable install that
    puts src/ on the path, are not read), and run a chapter, as downloaded, from a folder outside
    the clone with nbclient. The kernel must import the library from the wheel."""
    wheels, sources = tmp_path / "wheels", tmp_path / "sources"
    sources.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, sources / name)
    shutil.copytree(ROOT / "src", sources / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "-w", str(wheels), str(sources)],
                           capture_output=True, text=True)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stderr[-3000:]}"
    wheel = wheels / WHEEL_NAME
    assert wheel.is_file(), f"no {WHEEL_NAME} in {sorted(p.name for p in wheels.iterdir())}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "third_party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                                "--quiet", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, f"pip install failed:\n{installed.stderr[-3000:]}"

    kernel = tmp_path / "jupyter" / "kernels" / "wheel-python"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "the wheel", "language": "python"}))
    workdir = tmp_path / "downloads"
    workdir.mkdir()
    notebook = workdir / OUTSIDE_CHAPTER.name
    shutil.copy2(OUTSIDE_CHAPTER, notebook)  # the file the page's download button serves
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "JUPYTER_PATH")}
    env.update(JUPYTER_PATH=str(tmp_path / "jupyter"), OMP_NUM_THREADS="1")
    done = subprocess.run([str(python), "-c", DRIVER, str(notebook), str(workdir),
                           str(ROOT / "src")],
                          capture_output=True, text=True, cwd=workdir, env=env, timeout=900)
    assert done.returncode == 0, (f"{OUTSIDE_CHAPTER.name} failed outside the repository:\n"
                                  f"{done.stderr[-4000:]}")
    report = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines()[-2:])
    library = Path(report["LIBRARY"])
    assert library.is_relative_to(venv), f"the kernel imported the library from {library}"
    assert not library.is_relative_to(ROOT), library
    assert report["SRC_ON_PATH"] == "False", "the clone's src/ was on the kernel's path"
