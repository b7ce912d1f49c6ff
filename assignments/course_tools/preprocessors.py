"""The course's steps inside nbgrader's pipeline (configured in ``nbgrader_config.py``).

Autograde runs, for each submitted notebook, a *sanitize* pass and then an *autograde* pass.
The course adds:

- ``RepairCells`` (first in sanitize): puts the nbgrader metadata and cell types back as the
  source notebook has them, drops extra copies of read-only cells (JupyterLab copy/paste),
  turns cells with an unknown (edited) grade id into plain cells, and puts back deleted
  read-only cells (setup, grader tools, tests) where the source has them. Without it,
  nbgrader drops the whole submission on a duplicated or renamed grade id.
- ``IntegrityCheck`` (after ``OverwriteCells``): replaces every student-written code cell that
  breaks the rules of ``course_tools/integrity.py`` by a cell that raises ``IntegrityError``
  naming the rule.
- ``GuardedExecute`` (instead of ``Execute``; ``course_tools/execution.py``): runs the
  kernel in the sandbox and survives a cell that cannot be interrupted.
- ``HideHiddenTestOutputs`` (feedback): a test cell with hidden tests shows only whether it
  passed and the error type; nothing printed during or after the first hidden test shows.

Every step writes what it did to ``grading_reports/<assignment>/<student>/<notebook>.json``
(read by ``course_tools/grade.py``).
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
from pathlib import Path

import nbformat
from nbformat.notebooknode import NotebookNode
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Unicode

from . import integrity

REPORTS = "grading_reports"
# The nbgrader metadata that decides how a cell is graded (taken from the source notebook).
GRADING_FLAGS = ("grade", "grade_id", "locked", "points", "solution", "task", "schema_version")


def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


class CourseStep(NbGraderPreprocessor):
    """Shared helpers: the source notebook, the rules and the report of this submission."""

    rules_dir = Unicode("rules", help="Folder of <assignment>.json integrity rules, "
                                      "relative to the course root.").tag(config=True)

    def _paths(self, resources):
        info = resources["nbgrader"]
        coursedir = CourseDirectory(config=self.config)
        root = Path(coursedir.root)
        source = Path(coursedir.format_path(coursedir.source_directory, ".",
                                            info["assignment"])) / f"{info['notebook']}.ipynb"
        report = (root / REPORTS / info["assignment"] / str(info.get("student", "unknown"))
                  / f"{info['notebook']}.json")
        return root, source, report

    def source_notebook(self, resources):
        path = self._paths(resources)[1]
        return nbformat.read(path, as_version=4) if path.is_file() else None

    def report(self, resources, kind: str, message: str) -> None:
        path = self._paths(resources)[2]
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = json.loads(path.read_text()) if path.is_file() else []
        entries.append({"kind": kind, "message": message})
        path.write_text(json.dumps(entries, indent=1))
        self.log.warning("%s: %s", kind, message)


def _set_type(cell, cell_type):
    cell.cell_type = cell_type
    if cell_type == "code":
        cell.outputs, cell.execution_count = [], None
    else:
        cell.pop("outputs", None)
        cell.pop("execution_count", None)


class RepairCells(CourseStep):
    """Restore cell metadata and types from the source notebook before nbgrader reads them."""

    def preprocess(self, nb, resources):
        source = self.source_notebook(resources)
        if source is None:
            return nb, resources
        order = [_meta(c)["grade_id"] for c in source.cells if _meta(c).get("grade_id")]
        truth = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c).get("grade_id")}
        read_only = integrity.trusted_fingerprints(nbformat.v4.new_notebook(cells=[
            c for c in source.cells if _meta(c).get("locked") and c.cell_type == "code"]))
        last = {}
        for index, cell in enumerate(nb.cells):
            grade_id = _meta(cell).get("grade_id")
            if grade_id in truth:
                last[grade_id] = index
        cells, seen = [], set()
        for index, cell in enumerate(nb.cells):
            meta = _meta(cell)
            grade_id = meta.get("grade_id")
            if "nbgrader" in cell.get("metadata", {}) and grade_id not in truth:
                del cell.metadata["nbgrader"]
                if cell.cell_type == "code" and integrity.fingerprint(cell.source) in read_only:
                    self.report(resources, "repaired", f"removed cell {index + 1}, a copy of a "
                                f"read-only cell with the unknown grade id {grade_id!r}")
                    continue
                self.report(resources, "repaired", f"cell {index + 1} had the unknown grade id "
                            f"{grade_id!r} (edited?): graded as a plain cell")
            elif grade_id in truth:
                original = truth[grade_id]
                locked = _meta(original).get("locked")
                duplicate = grade_id in seen if locked else index != last[grade_id]
                if duplicate:
                    if locked:  # a copy of a read-only cell: the original is restored anyway
                        self.report(resources, "repaired",
                                    f"removed a copy of the read-only cell {grade_id}")
                        continue
                    del cell.metadata["nbgrader"]
                    self.report(resources, "repaired", f"cell {index + 1} repeated the grade id "
                                f"{grade_id}: the last copy is graded, this one runs as plain code")
                else:
                    if cell.cell_type != original.cell_type:
                        self.report(resources, "repaired", f"{grade_id} was turned into a "
                                    f"{cell.cell_type} cell: made {original.cell_type} again")
                        _set_type(cell, original.cell_type)
                    flags = {k: v for k, v in original.metadata["nbgrader"].items()
                             if k in GRADING_FLAGS}
                    if {k: meta.get(k) for k in GRADING_FLAGS if k in meta or k in flags} != {
                            k: flags.get(k) for k in GRADING_FLAGS if k in meta or k in flags}:
                        self.report(resources, "repaired", f"{grade_id}: nbgrader metadata "
                                    "restored from the source")
                    restored = {k: v for k, v in meta.items() if k not in GRADING_FLAGS}
                    restored.update(flags)
                    cell.metadata["nbgrader"] = restored
                    seen.add(grade_id)
            cells.append(cell)
        # put back deleted read-only cells, after the cell that precedes them in the source
        for position, grade_id in enumerate(order):
            if grade_id in seen or not _meta(truth[grade_id]).get("locked"):
                continue
            present = [_meta(c).get("grade_id") for c in cells]
            before = [g for g in order[:position] if g in present]
            at = present.index(before[-1]) + 1 if before else 0
            restored = copy.deepcopy(truth[grade_id])
            if restored.cell_type == "code":
                restored.outputs, restored.execution_count = [], None
            cells.insert(at, restored)
            seen.add(grade_id)
            self.report(resources, "repaired",
                        f"the deleted read-only cell {grade_id} was put back")
        nb.cells = cells
        return nb, resources


class IntegrityCheck(CourseStep):
    """Replace every student-written code cell that breaks the integrity rules."""

    def preprocess(self, nb, resources):
        root, _, _ = self._paths(resources)
        source = self.source_notebook(resources)
        rules = integrity.load_rules(resources["nbgrader"]["assignment"], root / self.rules_dir)
        trusted = None
        if source is not None:
            trusted = integrity.trusted_fingerprints(source)
        for index, problems in integrity.check_notebook(nb, rules, trusted).items():
            description = integrity.describe(nb, index, problems)
            nb.cells[index].source = integrity.rejected_source(description)
            nb.cells[index].outputs = []
            self.report(resources, "flagged", description)
        return nb, resources


# Exceptions whose name may show in the feedback of a hidden test (a student's own class name
# could carry data).
KNOWN_ERRORS = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)
                and issubclass(getattr(builtins, name), BaseException)} | {
    "TamperedError", "IntegrityError", "CellStoppedError", "CellTimeoutError",
    "LinAlgError", "_LinAlgError", "OutOfMemoryError", "OutputLimitError", "GuardError",
    "TimeLimitError", "DiskLimitError"}


def _is_rejected_cell(source: str) -> bool:
    """True for exactly the source IntegrityCheck writes (a student cannot imitate it to keep
    its outputs: any other text differs)."""
    last = source.rstrip().splitlines()[-1] if source.strip() else ""
    prefix = "raise IntegrityError("
    if not last.startswith(prefix):
        return False
    try:
        description = ast.literal_eval(last[len(prefix):-1])
    except (ValueError, SyntaxError):
        return False
    return isinstance(description, str) and source == integrity.rejected_source(description)


def _error(ename: str, text: str) -> NotebookNode:
    return nbformat.v4.new_output("error", ename=ename, evalue="", traceback=[text])


class HideHiddenTestOutputs(NbGraderPreprocessor):
    """Feedback: hidden tests show passed/failed and the error type, nothing else.

    Runs before ``ClearHiddenTests`` (which removes the hidden lines from the source). From
    the first test cell with hidden tests on, what student code prints could come from hidden
    inputs, so other code cells keep only their error type too.
    """

    def preprocess(self, nb, resources):
        hidden_seen = False
        for cell in nb.cells:
            meta = _meta(cell)
            is_test = cell.cell_type == "code" and meta.get("grade") and not meta.get("solution")
            if not is_test and "HIDDEN TESTS" in cell.source:  # ClearHiddenTests would fail
                cell.source = integrity.without_hidden_tests(cell.source)
            if cell.cell_type != "code":
                continue
            hidden = is_test and "BEGIN HIDDEN TESTS" in cell.source
            hidden_seen = hidden_seen or hidden
            if is_test and not hidden:
                continue  # visible tests keep their messages
            if not hidden_seen or _is_rejected_cell(cell.source):
                continue  # before any hidden test, or our own message: shown in full
            errors = [o for o in cell.outputs if o.output_type == "error"]
            failed_by_stderr = any(o.output_type == "stream" and o.name == "stderr"
                                   for o in cell.outputs)
            outputs = []
            if errors:
                ename = errors[0].ename if errors[0].ename in KNOWN_ERRORS else "Exception"
                note = " (hidden test: details are not shown)" if hidden else ""
                outputs.append(_error(ename, f"{ename}{note}"))
            elif failed_by_stderr and is_test:
                outputs.append(_error("Stderr", "Failed: output on stderr (hidden test)"))
            cell.outputs = outputs
        return nb, resources
