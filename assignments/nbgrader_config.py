"""nbgrader configuration of the Efficient Attention course.

Paths are relative to this file's folder, so the course works from any checkout
and from scratch copies (the grading tests copy this folder to a temporary one).
Run nbgrader commands from this folder: ``cd assignments && nbgrader ...``.
"""

import os

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import ClearHiddenTests, GetGrades, NbGraderPreprocessor

c = get_config()  # noqa: F821  (nbgrader's config loader defines get_config)

COURSE_ROOT = os.path.dirname(os.path.abspath(__file__))

c.CourseDirectory.course_id = "efficient-attention"
c.CourseDirectory.root = COURSE_ROOT
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(COURSE_ROOT, "gradebook.db")

# Execution at validate/autograde time. A cell that runs longer than `timeout` seconds is
# interrupted (the kernel is not killed): it gets a CellTimeoutError and execution goes on
# with the next cell (nbgrader's Execute always runs with allow_errors), so a student's
# infinite loop costs only the parts that depend on that cell (tests/test_grading.py checks
# this). A whole solution notebook runs in about 10 s.
c.Execute.timeout = 30
c.Execute.interrupt_on_timeout = True

# Test cells are read-only; whatever a student did to them, autograde restores the
# original source and points from the gradebook (OverwriteCells), and puts back a
# graded cell the student deleted.
c.OverwriteCells.add_missing_cells = True

# Long outputs (a print in a loop) would bloat feedback files.
c.LimitOutput.max_lines = 200

# Files copied into each release besides the notebook: none expected; keep caches out.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback"]


# Feedback. The autograded notebooks contain the hidden tests (nbgrader restores them to
# grade), and nbgrader's feedback HTML would show them. Here the feedback strips the hidden
# test regions and shortens a failed test's traceback (which quotes the failing line) to
# the error type and message. The message can still show values: see assignments/README.md.


class ShortenTestTracebacks(NbGraderPreprocessor):  # enabled by default, unlike nbconvert's
    """Keep only ``ename: evalue`` of the errors in autograded test cells."""

    def preprocess_cell(self, cell, resources, index):
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources


c.GenerateFeedback.preprocessors = [
    GetGrades,
    ClearHiddenTests,
    ShortenTestTracebacks,
    CSSHTMLHeaderPreprocessor,
]
