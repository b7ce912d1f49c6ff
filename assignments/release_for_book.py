"""Ship the student version of every assignment with the book.

Run from anywhere, before ``jupyter-book build`` (the Makefile's ``book`` target does)::

    python assignments/release_for_book.py

In a scratch copy of ``assignments/`` (the real course folder and its gradebook are never
touched) it runs ``nbgrader generate_assignment "*" --no-db --force``, which strips the
solutions, hidden tests and rubrics, then copies each release notebook to
``book/_downloads/assignments/<name>.ipynb``, writes the integrity check students run before
submitting (``check_notebook.py``, every assignment's rules built in), the students'
``nbgrader_config.py`` (course id, exchange folder from ``NBGRADER_EXCHANGE``, and
``check_notebook.py`` run by nbgrader's *Validate*: ``fetch_assignment``, ``validate`` and
``submit`` work with these two files alone) and writes ``book/_downloads/assignments/list.md``:
one entry per assignment, with a ``{download}`` link, its title, the summary sentence of its
first cell and its points, and ``rules.md``: what each assignment's rules file allows and
forbids. ``book/assignments.md`` includes both, so an assignment added under
``assignments/source/`` appears in the book with no other edit, and the book never links a
file that does not exist. ``book/_downloads/`` is generated (git-ignored).
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from course_tools import integrity  # noqa: E402

COURSE = Path(__file__).resolve().parent
ROOT = COURSE.parent
OUT = ROOT / "book" / "_downloads" / "assignments"
# The course order; assignments not listed here follow in alphabetical order.
ORDER = [
    "purification",
    "argmax_attention",
    "scaled_dot_product",
    "kernelized_attention",
    "random_feature_attention",
    "performer",
    "nystrom",
    "fmmformer",
    "online_softmax",
    "chunkwise_linear_attention",
    "ring_attention",
]


def assignment_names(course: Path = COURSE) -> list[str]:
    """Names of the assignments: folders ``source/<name>/`` holding ``<name>.ipynb``."""
    found = {p.name for p in (course / "source").iterdir() if (p / f"{p.name}.ipynb").is_file()}
    return [n for n in ORDER if n in found] + sorted(found - set(ORDER))


def describe(nb) -> tuple[str, str, float]:
    """(title, summary sentence, total points) from the notebook's first markdown cell."""
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    paragraphs = [p.strip() for p in (first.source if first else "").split("\n\n") if p.strip()]
    title = paragraphs[0].lstrip("#").strip() if paragraphs else "Untitled"
    summary = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""
    points = sum(float(c.metadata.get("nbgrader", {}).get("points", 0)) for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("grade"))
    return title, summary, points


def copy_course_files(scratch: Path) -> None:
    """The configuration and what it loads (course_tools/, rules/) into a scratch course."""
    shutil.copy(COURSE / "nbgrader_config.py", scratch)
    for folder in ("course_tools", "rules"):
        shutil.copytree(COURSE / folder, scratch / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))


def write_checker(path: Path) -> None:
    """``check_notebook.py``: the integrity check, with every assignment's rules built in."""
    catalogue = integrity.course_catalogue(COURSE)
    source = (COURSE / "course_tools" / "integrity.py").read_text()
    marker = "EMBEDDED_RULES: dict = {}"
    assert marker in source, "integrity.py lost its EMBEDDED_RULES line"
    path.write_text(source.replace(marker, "EMBEDDED_RULES: dict = " + json.dumps(
        catalogue, indent=1, sort_keys=True), 1))


# The exchange folder students use when NBGRADER_EXCHANGE is not set: the one
# assignments/README.md sets up on a JupyterHub ("A class on JupyterHub").
STUDENT_EXCHANGE = "/srv/nbgrader/exchange"
# Settings of the course's nbgrader_config.py that students' nbgrader needs as well: the course
# id (fetch, submit and the exchange's folders), and validation's limits per cell.
SHARED_SETTINGS = (("CourseDirectory", "course_id"), ("Execute", "timeout"),
                   ("Execute", "interrupt_on_timeout"))

STUDENT_CONFIG = '''"""nbgrader configuration for students of the Efficient Attention course.

Put this file (named nbgrader_config.py) and check_notebook.py, both from the course's
Assignments page, in the folder you work in and run nbgrader or JupyterLab from (or both in
~/.jupyter/). With the exchange folder your instructor names (NBGRADER_EXCHANGE, default
{exchange}):

    export NBGRADER_EXCHANGE=/path/the/instructor/gives
    nbgrader list                                  # what has been released
    nbgrader fetch_assignment argmax_attention     # into ./argmax_attention/
    nbgrader validate argmax_attention/argmax_attention.ipynb
    nbgrader submit argmax_attention               # as often as you like before the deadline
    nbgrader fetch_feedback argmax_attention       # once the feedback is released

Validation (the command above, or the Validate button of JupyterLab) also runs the course's
integrity check (check_notebook.py, the same as `python check_notebook.py <notebook>`) and
fails with the lines the grader would reject.

Generated by assignments/release_for_book.py; do not edit.
"""

import importlib.util
import os

c = get_config()  # noqa: F821  (nbgrader's config loader defines get_config)

{settings}
c.Exchange.root = os.environ.get("NBGRADER_EXCHANGE", {exchange!r})

CHECKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_notebook.py")


def _checker_missing(notebook=None, **_):
    if os.environ.get("NBGRADER_EXECUTION") == "validate":
        raise FileNotFoundError(
            f"{{CHECKER}} is missing: download check_notebook.py from the course's Assignments "
            "page and put it next to this nbgrader_config.py; validation runs its integrity "
            "check")


if os.path.isfile(CHECKER):
    _spec = importlib.util.spec_from_file_location("check_notebook", CHECKER)
    check_notebook = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(check_notebook)
    c.Execute.on_notebook_start = check_notebook.make_validate_hook()
else:
    c.Execute.on_notebook_start = _checker_missing
'''


def shared_settings(config: Path = COURSE / "nbgrader_config.py") -> dict[tuple[str, str], object]:
    """The values of SHARED_SETTINGS in the course's config (``c.Section.name = literal``
    statements, read without running it)."""
    found = {}
    for node in ast.walk(ast.parse(config.read_text())):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                    and isinstance(target.value.value, ast.Name) and target.value.value.id == "c"
                    and (target.value.attr, target.attr) in SHARED_SETTINGS):
                found[(target.value.attr, target.attr)] = ast.literal_eval(node.value)
    missing = [".".join(key) for key in SHARED_SETTINGS if key not in found]
    assert not missing, f"{config} sets no literal {missing}"
    return found


def write_student_config(path: Path) -> None:
    """``nbgrader_config.py`` for students: the course id and validation limits of the course's
    config, the exchange from ``NBGRADER_EXCHANGE``, and the integrity check of the
    ``check_notebook.py`` beside it in *Validate* (what ``make_validate_hook`` does in the
    course's config, without course_tools/, which students do not have)."""
    settings = "\n".join(f"c.{section}.{name} = {value!r}"
                         for (section, name), value in shared_settings().items())
    path.write_text(STUDENT_CONFIG.format(settings=settings, exchange=STUDENT_EXCHANGE))


def write_rules(names: list[str], path: Path) -> None:
    """``rules.md``: each assignment's allowed modules and forbidden names (rules/<name>.json,
    else the defaults), as the integrity check applies them."""
    lines = ["<!-- Generated by assignments/release_for_book.py from assignments/rules/; "
             "do not edit. -->", ""]
    for name in names:
        rules = integrity.load_rules(name, COURSE / "rules")
        allowed = ", ".join(f"`{m}`" for m in sorted(rules["allowed_modules"]))
        forbidden = ", ".join(f"`{a}`" for a in rules["forbidden_attributes"])
        lines.append(f"- `{name}`: may import {allowed}"
                     + (f"; may not use {forbidden}." if forbidden else "; no name forbidden."))
    path.write_text("\n".join(lines) + "\n")


def generate_releases(scratch: Path) -> None:
    copy_course_files(scratch)
    shutil.copytree(COURSE / "source", scratch / "source",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", "generate_assignment", "*", "--no-db", "--force"],
        cwd=scratch, capture_output=True, text=True,
    )
    if result.returncode != 0:
        sys.exit(f"nbgrader generate_assignment failed:\n{result.stdout}\n{result.stderr}")


def write_list(entries: list[tuple[str, str, str, float]], path: Path) -> None:
    lines = [
        "<!-- Generated by assignments/release_for_book.py; do not edit. -->",
        "",
    ]
    for name, title, summary, points in entries:
        link = f"{{download}}`{name}.ipynb </book/_downloads/assignments/{name}.ipynb>`"
        lines.append(f"- **{title}** ({points:g} points), {link}. {summary}")
    if not entries:
        lines.append("No assignment has been released yet.")
    else:
        lines += ["", "The integrity check, to run on your notebook before you submit it: "
                  "{download}`check_notebook.py </book/_downloads/assignments/check_notebook.py>` "
                  "(`python check_notebook.py <name>.ipynb`). The packages you need, and "
                  "nothing that solves a part: {download}`student-requirements.txt "
                  "</book/_downloads/assignments/student-requirements.txt>`. For nbgrader's "
                  "exchange (fetch, validate, submit from a terminal or JupyterLab): "
                  "{download}`nbgrader_config.py </book/_downloads/assignments/nbgrader_config.py>`"
                  " (keep it next to `check_notebook.py`)."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    names = assignment_names()
    if OUT.exists():
        shutil.rmtree(OUT)  # drop releases of assignments that no longer exist
    OUT.mkdir(parents=True)
    entries = []
    with tempfile.TemporaryDirectory(prefix="nbgrader-release-") as tmp:
        scratch = Path(tmp)
        if names:
            generate_releases(scratch)
        for name in names:
            release = scratch / "release" / name / f"{name}.ipynb"
            if not release.is_file():
                sys.exit(f"no release was generated for {name} ({release})")
            shutil.copy(release, OUT / f"{name}.ipynb")
            entries.append((name, *describe(nbformat.read(release, as_version=4))))
    write_checker(OUT / "check_notebook.py")
    write_student_config(OUT / "nbgrader_config.py")
    shutil.copy(COURSE / "student-requirements.txt", OUT / "student-requirements.txt")
    write_list(entries, OUT / "list.md")
    write_rules(names, OUT / "rules.md")
    print(f"released {len(entries)} assignment(s) to {OUT}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
