"""Build an nbgrader assignment notebook from a list of cells, with the metadata right.

An assignment's source notebook (``assignments/source/<name>/<name>.ipynb``) is the
single source of truth; this helper only saves typing the nbgrader metadata by hand.
Write a small builder script *outside* ``assignments/source/`` (nbgrader copies every
file of a source folder into the student release), for example::

    from make_notebook import autotest, build, grader_tools, md, setup, solution, written

    cells = [
        md("# Argmax attention\\n\\nOne sentence on what the assignment covers."),
        setup(),
        grader_tools(),
        md("## Part 1 (2 points): ..."),
        solution("part1-solution", '''def f(x):
    ### BEGIN SOLUTION
    return x + 1
    ### END SOLUTION'''),
        autotest("part1-test", 2, '''assert f(1) == 2
### BEGIN HIDDEN TESTS
assert f(41) == 42
### END HIDDEN TESTS'''),
        written("part2-written", 2, '''### BEGIN SOLUTION
Model answer.

**Rubric (2 points).** ...
### END SOLUTION'''),
    ]
    build(cells, "assignments/source/<name>/<name>.ipynb")

``python assignments/make_notebook.py --refresh assignments/source/*/*.ipynb`` puts the
current ``grader_tools.py`` and the integrity rules into existing notebooks (those two only).
``python assignments/make_notebook.py --check assignments/source/*/*.ipynb`` checks
existing notebooks against the conventions ("Authoring an assignment" in
``assignments/README.md``): unique ``part<N>-<slug>`` grade ids, 4 to 7 graded parts with
points, a locked seeding first code cell, hidden tests in every autograded test cell, a
model answer and rubric in every written cell, cell ids, no stored outputs.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SCHEMA_VERSION = 3
GRADE_ID = re.compile(r"^part(\d+)-[a-z0-9-]+$")

DEFAULT_SETUP = """\
# Setup (read-only): imports and seeds. Run this cell first.
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

torch.manual_seed(0)
np.random.seed(0)"""


def _nbgrader(grade_id: str, *, solution: bool, grade: bool, locked: bool,
              points: float | None = None, task: bool = False) -> dict:
    meta = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": SCHEMA_VERSION,
        "solution": solution,
        "task": task,
    }
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def md(source: str):
    """Instructions: a plain markdown cell, no nbgrader metadata."""
    return new_markdown_cell(source.strip("\n"))


def setup(source: str = DEFAULT_SETUP, grade_id: str = "setup"):
    """The read-only first code cell: imports and seeds (restored by nbgrader when edited)."""
    cell = new_code_cell(source.strip("\n"))
    cell.metadata.update(_nbgrader(grade_id, solution=False, grade=False, locked=True))
    return cell


GRADER_TOOLS_ID = "grader-tools"
GRADER_TOOLS_FILE = Path(__file__).with_name("grader_tools.py")


def grader_tools():
    """The read-only second code cell: ``_grader``, the private checkers the tests use.

    Its source is ``grader_tools.py`` (kept as a file so that it is linted and tested).
    """
    cell = new_code_cell(GRADER_TOOLS_FILE.read_text().strip("\n"))
    cell.metadata.update(_nbgrader(GRADER_TOOLS_ID, solution=False, grade=False, locked=True))
    return cell


def code(source: str):
    """A plain code cell (demonstrations, plots); no nbgrader metadata, not graded."""
    return new_code_cell(source.strip("\n"))


def solution(grade_id: str, source: str):
    """A code answer cell: the student's code goes where ``### BEGIN/END SOLUTION`` are."""
    _check_delimiters(source, "SOLUTION", grade_id)
    cell = new_code_cell(source.strip("\n"))
    cell.metadata.update(_nbgrader(grade_id, solution=True, grade=False, locked=False))
    return cell


def autotest(grade_id: str, points: float, source: str):
    """A read-only autograded test cell worth ``points``: visible asserts, then hidden ones."""
    _check_delimiters(source, "HIDDEN TESTS", grade_id)
    cell = new_code_cell(source.strip("\n"))
    cell.metadata.update(
        _nbgrader(grade_id, solution=False, grade=True, locked=True, points=points)
    )
    return cell


def written(grade_id: str, points: float, source: str):
    """A manually graded markdown answer cell; model answer and rubric inside SOLUTION."""
    _check_delimiters(source, "SOLUTION", grade_id)
    cell = new_markdown_cell(source.strip("\n"))
    cell.metadata.update(
        _nbgrader(grade_id, solution=True, grade=True, locked=False, points=points)
    )
    return cell


def _check_delimiters(source: str, word: str, grade_id: str) -> None:
    begins = source.count(f"### BEGIN {word}")
    ends = source.count(f"### END {word}")
    if begins == 0 or begins != ends:
        raise ValueError(
            f"cell {grade_id!r}: expected matching '### BEGIN {word}' / '### END {word}' "
            f"lines, got {begins} BEGIN and {ends} END"
        )


def build(cells: list, path: str | Path) -> Path:
    """Write ``cells`` as an nbformat 4.5 notebook at ``path`` with stable cell ids."""
    nb = new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nb.nbformat, nb.nbformat_minor = 4, 5
    for index, cell in enumerate(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell.id = grade_id if grade_id else f"cell-{index:02d}"
    problems = check(nb)
    if problems:
        raise ValueError("notebook breaks the conventions:\n  " + "\n  ".join(problems))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def check(nb) -> list[str]:
    """Problems with ``nb`` against the assignment conventions (empty list: none)."""
    problems = []
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
    ids = [i for i in ids if i]
    if len(ids) != len(set(ids)):
        problems.append(f"grade_ids are not unique: {sorted(ids)}")
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if not code_cells or "torch.manual_seed(0)" not in code_cells[0].source:
        problems.append("the first code cell must seed: torch.manual_seed(0)")
    elif not code_cells[0].metadata.get("nbgrader", {}).get("locked"):
        problems.append("the first code cell (setup) must be locked")
    tools = [c for c in code_cells[1:2]
             if c.metadata.get("nbgrader", {}).get("grade_id") == GRADER_TOOLS_ID]
    if not tools or not tools[0].metadata["nbgrader"].get("locked"):
        problems.append(f"the second code cell must be the locked {GRADER_TOOLS_ID!r} cell")
    elif tools[0].source.strip() != GRADER_TOOLS_FILE.read_text().strip():
        problems.append(f"the {GRADER_TOOLS_ID!r} cell differs from grader_tools.py")
    parts = set()
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if not cell.get("id"):
            problems.append("a cell has no id")
        if cell.cell_type == "code" and cell.get("outputs"):
            problems.append(f"cell {cell.get('id')} has stored outputs")
        if not meta:
            continue
        grade_id = meta["grade_id"]
        if grade_id in ("setup", GRADER_TOOLS_ID):
            continue
        match = GRADE_ID.match(grade_id)
        if not match:
            problems.append(f"grade_id {grade_id!r} is not 'part<N>-<slug>'")
            continue
        if meta.get("grade"):
            parts.add(int(match.group(1)))
            if not meta.get("points", 0) > 0:
                problems.append(f"{grade_id}: a graded cell needs points > 0")
            if meta.get("solution"):
                if "### BEGIN SOLUTION" not in cell.source:
                    problems.append(f"{grade_id}: written answer without a model answer/rubric")
            elif "### BEGIN HIDDEN TESTS" not in cell.source:
                problems.append(f"{grade_id}: autograded test without hidden tests")
    if not 4 <= len(parts) <= 7:
        problems.append(f"an assignment has 4 to 7 graded parts, found {sorted(parts)}")
    return problems


INSTRUCTIONS_RULES = (
    "Answer cells may import only `torch`, `math` and `numpy` (and their submodules), never "
    "the course library `efficient_attention`. They may not change attributes of modules or "
    "builtins (`torch.testing.assert_close = ...`), use IPython features (`get_ipython`, "
    "`%` magics, `!` commands), `exec`, `eval` or `__import__`, or read the notebook's own "
    "cells (`In`, `_ih`): an integrity check rejects such cells when the notebook is graded "
    "(a rejected cell is not run, and the parts that use it score zero). Check your notebook "
    "before you submit it with `python check_notebook.py {name}.ipynb` (the script is on the "
    "book's Assignments page) or with *Validate*."
)
_OLD_RULES = re.compile(r"Use `torch`.*?in your answers\.", re.S)


def refresh(path: str | Path) -> bool:
    """Put ``grader_tools.py`` into the notebook's grader-tools cell and the integrity rules
    into its instructions; no other cell changes. True if the file changed."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    tools = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id")
             == GRADER_TOOLS_ID]
    for cell in tools:
        cell.source = GRADER_TOOLS_FILE.read_text().strip("\n")
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    rules = INSTRUCTIONS_RULES.format(name=path.stem)
    if rules not in " ".join(first.source.split()):
        paragraphs = _OLD_RULES.sub(lambda _: rules, first.source, count=1).split("\n\n")
        first.source = "\n\n".join(
            textwrap.fill(" ".join(p.split()), width=92, break_long_words=False,
                          break_on_hyphens=False) if p.startswith("**Instructions.**") else p
            for p in paragraphs)
    if nbformat.writes(nb) == before:
        return False
    nbformat.write(nb, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", nargs="+", metavar="NOTEBOOK")
    group.add_argument("--refresh", nargs="+", metavar="NOTEBOOK",
                       help="update the grader-tools cell and the integrity instructions")
    args = parser.parse_args(argv)
    if args.refresh:
        for path in args.refresh:
            print(f"{path}: {'updated' if refresh(path) else 'unchanged'}")
        return 0
    status = 0
    for path in args.check:
        problems = check(nbformat.read(path, as_version=4))
        for problem in problems:
            print(f"{path}: {problem}")
        status |= bool(problems)
    if status == 0:
        print(f"{len(args.check)} notebook(s) follow the conventions")
    return status


if __name__ == "__main__":
    sys.exit(main())
