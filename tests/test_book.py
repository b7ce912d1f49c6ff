"""Static checks of the book: notebooks as stored, table of contents, configuration, citations.

These run without building the book (the build itself is `make book`; the built site is checked
by tests/test_browser.py). Each test names the file and the rule it breaks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from notebook_files import cell_source as _source
from notebook_files import load_json as _load
from notebook_files import relative as _rel

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("*.ipynb"))
SOURCES = sorted((ROOT / "assignments" / "source").glob("*/*.ipynb"))
NOTEBOOKS = CHAPTERS + SOURCES
MARKDOWN = sorted(BOOK.glob("*.md"))


def _toc_files(node) -> list[str]:
    """Every `file:` (and the `root:`) named anywhere in a parsed _toc.yml."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("file", "root") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(_toc_files(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_toc_files(item))
    return found


def _toc_path(entry: str) -> Path | None:
    """The file a toc entry names (entries may omit the suffix), or None if there is none."""
    candidates = [ROOT / entry] if Path(entry).suffix else []
    candidates += [ROOT / f"{entry}{suffix}" for suffix in (".ipynb", ".md")]
    return next((path for path in candidates if path.is_file()), None)


def test_there_are_chapters():
    assert CHAPTERS, "book/ has no .ipynb chapters"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_is_stored_clean(path):
    nb = _load(path)
    dirty = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("outputs"):
            dirty.append(f"cell {index} has outputs")
        if cell.get("execution_count") is not None:
            dirty.append(f"cell {index} has execution_count {cell['execution_count']}")
    assert not dirty, (
        f"{_rel(path)} must be stored without outputs "
        f"(jupyter nbconvert --clear-output --inplace): " + "; ".join(dirty)
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_cells_have_ids(path):
    nb = _load(path)
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5), (
        f"{_rel(path)} is nbformat {nb['nbformat']}.{nb['nbformat_minor']}, expected >= 4.5"
    )
    missing = [index for index, cell in enumerate(nb["cells"]) if not cell.get("id")]
    assert not missing, f"{_rel(path)}: cells {missing} have no id"
    ids = [cell["id"] for cell in nb["cells"]]
    assert len(ids) == len(set(ids)), f"{_rel(path)}: duplicate cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_first_code_cell_seeds(path):
    code_cells = [_source(c) for c in _load(path)["cells"] if c["cell_type"] == "code"]
    if not code_cells:  # nothing runs, nothing to seed
        return
    assert "manual_seed" in code_cells[0], (
        f"{_rel(path)}: the first code cell must fix the seeds (torch.manual_seed(0), ...), "
        f"got:\n{code_cells[0][:300]}"
    )


def test_toc_lists_existing_files_and_every_chapter():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    entries = _toc_files(toc)
    assert toc.get("root"), "_toc.yml has no root"
    missing = [entry for entry in entries if _toc_path(entry) is None]
    assert not missing, f"_toc.yml lists files that do not exist: {missing}"
    listed = {_toc_path(entry).resolve() for entry in entries}
    unlisted = [_rel(p) for p in CHAPTERS + MARKDOWN if p.resolve() not in listed]
    assert not unlisted, f"pages in book/ missing from _toc.yml (never built): {unlisted}"
    assert len(entries) == len(set(entries)), f"_toc.yml lists a file twice: {entries}"


def test_pages_workflow_builds_the_book():
    path = ROOT / ".github" / "workflows" / "pages.yml"
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    # YAML 1.1 reads the key `on` as the boolean True.
    triggers = workflow.get("on", workflow.get(True))
    assert triggers and "push" in triggers, f"{_rel(path)} must run on push, got {triggers}"
    steps = [step for job in workflow["jobs"].values() for step in job.get("steps", [])]
    runs = [step.get("run", "") for step in steps]
    uses = [step.get("uses", "") for step in steps]
    assert any(re.search(r"\bmake book\b", run) for run in runs), f"no `make book` step: {runs}"
    assert any(u.startswith("actions/upload-pages-artifact") for u in uses), uses
    assert any(u.startswith("actions/deploy-pages") for u in uses), uses
    artifact = next(s for s in steps if s.get("uses", "").startswith("actions/upload-pages"))
    assert artifact.get("with", {}).get("path") == "_build/html", artifact


def test_config_executes_with_cache_and_timeout():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    execute = config.get("execute", {})
    assert execute.get("execute_notebooks") == "cache", execute
    timeout = execute.get("timeout")
    assert isinstance(timeout, int) and timeout > 30, (
        f"_config.yml needs an explicit execute.timeout above the 30 s default, got {timeout!r}"
    )
    extensions = config.get("sphinx", {}).get("extra_extensions", [])
    assert "sphinx-mathjax-offline" in extensions, f"offline math missing: {extensions}"
    assert config.get("html", {}).get("use_download_button") is True, (
        "html.use_download_button must be true: chapter pages offer their notebook"
    )
    assert config.get("only_build_toc_files") is True


# {cite}`a,b`, {cite:p}`a`, {cite:t}`a`, {cite:ps}`a` ... (sphinxcontrib-bibtex roles)
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
DOC = re.compile(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`")


def _prose(path: Path) -> str:
    """The markdown a reader sees: markdown cells of a notebook, or the whole .md file."""
    if path.suffix == ".ipynb":
        return "\n".join(_source(c) for c in _load(path)["cells"] if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


def _bib_keys() -> list[str]:
    text = (BOOK / "references.bib").read_text(encoding="utf-8")
    return re.findall(r"^\s*@\w+\s*\{\s*([^,\s]+)\s*,", text, flags=re.MULTILINE)


def test_bibliography_keys_are_unique():
    keys = _bib_keys()
    assert keys, "book/references.bib has no entries"
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    assert not duplicates, f"book/references.bib defines these keys twice: {duplicates}"


@pytest.mark.parametrize("path", CHAPTERS + MARKDOWN, ids=_rel)
def test_cited_keys_exist(path):
    keys = set(_bib_keys())
    cited = {key.strip() for group in CITE.findall(_prose(path)) for key in group.split(",")}
    unknown = sorted(cited - keys)
    assert not unknown, f"{_rel(path)} cites keys absent from book/references.bib: {unknown}"


@pytest.mark.parametrize("path", CHAPTERS + MARKDOWN, ids=_rel)
def test_doc_links_point_to_pages(path):
    def page(target: str) -> str:  # {doc} targets are relative to the page, or to ROOT with "/"
        base = ROOT if target.startswith("/") else path.parent
        return str((base / target.lstrip("/")).resolve().relative_to(ROOT))

    broken = [target for target in DOC.findall(_prose(path)) if _toc_path(page(target)) is None]
    assert not broken, f"{_rel(path)} links with {{doc}} to missing pages: {broken}"


def test_citation_pattern_finds_every_role_form():
    # Guards the regular expression the citation test relies on.
    text = "{cite}`a` and {cite:p}`b,c` and {cite:t}`d` and {cite:ps}`e, f`"
    found = [key.strip() for group in CITE.findall(text) for key in group.split(",")]
    assert found == ["a", "b", "c", "d", "e", "f"]


# A code cell that draws a figure: it creates or shows a matplotlib figure.
DRAWS_FIGURE = re.compile(r"\bplt\.(subplots|figure|show|imshow|matshow|hist|plot)\b")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_figure_cells_fold_their_code(path):
    # The stored-notebook side of the browser check (tests/test_browser.py, rule 3): a cell that
    # draws a figure carries the tag hide-input, so the page shows the figure and folds the code.
    unfolded = []
    for index, cell in enumerate(_load(path)["cells"]):
        if cell["cell_type"] != "code" or not DRAWS_FIGURE.search(_source(cell)):
            continue
        if "hide-input" not in cell.get("metadata", {}).get("tags", []):
            unfolded.append(f"cell {index} ({cell.get('id')})")
    assert not unfolded, (
        f"{_rel(path)}: these cells draw a figure but are not tagged hide-input "
        f"(move teaching code into a visible cell before the figure): {unfolded}"
    )


def test_bibliography_titles_have_no_tex_math():
    # pybtex prints maths in a BibTeX field verbatim ("$O(N \log N)$" on the page): write titles
    # in plain text or Unicode (O(N log N), ℋ) instead.
    text = (BOOK / "references.bib").read_text(encoding="utf-8")
    titles = re.findall(r"^\s*title\s*=\s*(.+)$", text, flags=re.MULTILINE)
    assert titles, "book/references.bib has no title fields"
    with_tex = [title for title in titles if "$" in title or re.search(r"\\[A-Za-z]", title)]
    assert not with_tex, f"book/references.bib: titles with TeX that would show raw: {with_tex}"


def test_figure_rule_recognises_drawing_cells():
    # Guards the pattern the figure test relies on.
    assert DRAWS_FIGURE.search("fig, ax = plt.subplots(figsize=(6, 4))")
    assert DRAWS_FIGURE.search("_ = plt.plot(x)")
    assert not DRAWS_FIGURE.search("assert torch.allclose(a, b)  # no figure here")


# Issue 19: the reading flow of the chapters revised for it (flash_attention, comparison,
# performer, fmmformer). The other chapters are not yet held to these two rules.
REVISED_CHAPTERS = [BOOK / f"{name}.ipynb"
                    for name in ("flash_attention", "comparison", "performer", "fmmformer")]
FOLDED_TAGS = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
# Development bookkeeping that belongs in folded cells: nbval markers, the search for the
# stored results, the glue plumbing, the load of the machine that ran a benchmark.
PLUMBING = re.compile(r"NBVAL_|def find_results|def store\b|\bglue\(|load_average|loadavg")


def _code_cells(path: Path) -> list[dict]:
    return [c for c in _load(path)["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", REVISED_CHAPTERS, ids=_rel)
def test_visible_code_cells_carry_no_bookkeeping(path):
    shown = []
    for cell in _code_cells(path):
        if FOLDED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        found = PLUMBING.search(_source(cell))
        if found:
            shown.append(f"{cell.get('id')}: {found.group(0)!r}")
    assert not shown, (
        f"{_rel(path)}: visible code cells show development bookkeeping (move it into a cell "
        f"tagged hide-input): {shown}"
    )


@pytest.mark.parametrize("path", REVISED_CHAPTERS, ids=_rel)
def test_every_figure_is_cited_in_the_text(path):
    names = [c["metadata"]["mystnb"]["figure"]["name"] for c in _load(path)["cells"]
             if c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("name")]
    uncited = [name for name in names if f"{{numref}}`{name}`" not in _prose(path)]
    assert names and not uncited, f"{_rel(path)}: figures never cited with {{numref}}: {uncited}"


def test_bookkeeping_rule_recognises_plumbing():
    # Guards the pattern the bookkeeping test relies on.
    assert PLUMBING.search("# NBVAL_IGNORE_OUTPUT\nx = 1")
    assert PLUMBING.search("RESULTS = find_results()\ndef find_results():")
    assert PLUMBING.search("    glue(name, value, display=False)")
    assert not PLUMBING.search("store = {}  # a dictionary named store\nstored = glued = 1")


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_no_chapter_keeps_its_own_memory_tracker(path):
    # One tracker for the whole course: ea.TensorMemoryTracker / ea.peak_tensor_memory. A
    # private one drifts (the flash chapter's ignored views and under-counted standard attention).
    code = "\n".join(_source(c) for c in _code_cells(path))
    private = re.findall(r"class \w+\([^)]*DispatchMode[^)]*\)|_python_dispatch", code)
    assert not private, (
        f"{_rel(path)} defines its own memory tracker: {private}; use ea.TensorMemoryTracker"
    )


def test_causal_comparisons_have_their_causal_baseline():
    # Every causal method of the speed benchmark is compared with SDPA called with
    # is_causal=True ("SDPA causal"), timed in the same run at every length it was timed.
    speed = json.loads((ROOT / "benchmarks" / "results" / "attention_speed.json").read_text())
    causal = [name for name in speed["methods"]
              if name.endswith("causal") and name != "SDPA causal"]
    assert causal and "SDPA causal" in speed["methods"], speed["methods"]
    unmatched = []
    for n, result in speed["results"].items():
        for mode in ("forward", "train"):
            timed = {name for name, entry in result[mode]["time"].items()
                     if entry and "median_s" in entry}
            unmatched += [(n, mode, name) for name in causal
                          if name in timed and "SDPA causal" not in timed]
    assert not unmatched, f"causal methods timed without SDPA causal beside them: {unmatched}"
    code = "\n".join(_source(c) for c in _code_cells(BOOK / "comparison.ipynb"))
    assert '["SDPA causal"]' in code, "the comparison chapter must read the SDPA causal timings"


# Chapters and assignments point to each other. The table of book/assignments.md ("| `name` |
# {doc}`chapter`, ... |") is the record: every assignment under assignments/source/ has a row
# naming its chapters, each of those chapters names the assignment in a paragraph that links the
# Assignments page, and book/intro.md names exactly the chapters that have none.
ASSIGNMENTS_PAGE = BOOK / "assignments.md"
ASSIGNMENT_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|(.+)\|\s*$", flags=re.MULTILINE)


def _assignment_names() -> list[str]:
    return sorted(path.stem for path in SOURCES if path.stem == path.parent.name)


def _chapters_of_assignments() -> dict[str, list[str]]:
    """Assignment name -> the chapters (book/<name>) its row of the Assignments page links."""
    return {name: DOC.findall(cells)
            for name, cells in ASSIGNMENT_ROW.findall(_prose(ASSIGNMENTS_PAGE))}


def _paragraphs(path: Path) -> list[str]:
    return re.split(r"\n\s*\n", _prose(path))


def test_assignments_page_names_the_chapter_of_every_assignment():
    table = _chapters_of_assignments()
    assert sorted(table) == _assignment_names(), (
        f"{_rel(ASSIGNMENTS_PAGE)}: its table of chapters lists {sorted(table)}, the assignments "
        f"are {_assignment_names()}")
    chapter_names = {path.stem for path in CHAPTERS}
    for name, chapters in table.items():
        assert chapters, f"{_rel(ASSIGNMENTS_PAGE)}: no {{doc}} link to a chapter for {name}"
        unknown = [chapter for chapter in chapters if chapter not in chapter_names]
        assert not unknown, f"{_rel(ASSIGNMENTS_PAGE)}: {name} links {unknown}, not chapters"


@pytest.mark.parametrize("name", _assignment_names())
def test_chapters_point_to_their_assignment(name):
    chapters = _chapters_of_assignments().get(name, [])
    silent = [chapter for chapter in chapters
              if not any(f"`{name}`" in paragraph and "{doc}`assignments`" in paragraph
                         for paragraph in _paragraphs(BOOK / f"{chapter}.ipynb"))]
    assert not silent, (
        f"book/assignments.md says {name} goes with {silent}, but no paragraph of theirs names "
        f"`{name}` and links {{doc}}`assignments`")


def test_intro_names_the_chapters_without_an_assignment():
    with_assignment = {chapter for chapters in _chapters_of_assignments().values()
                       for chapter in chapters}
    without = sorted(path.stem for path in CHAPTERS if path.stem not in with_assignment)
    claims = [paragraph for paragraph in _paragraphs(BOOK / "intro.md")
              if "none of their own" in paragraph]
    assert len(claims) == 1, "book/intro.md should say once which chapters have no assignment"
    chapter_names = {path.stem for path in CHAPTERS}
    named = sorted(target for target in DOC.findall(claims[0]) if target in chapter_names)
    assert named == without, (
        f"book/intro.md names {named} as the chapters without an assignment; they are {without}")
