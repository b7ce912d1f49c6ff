"""nbgrader configuration of the Efficient Attention course.

Paths are relative to this file's folder, so the course works from any checkout
and from scratch copies (the grading tests copy this folder to a temporary one).
Run nbgrader commands from this folder: ``cd assignments && nbgrader ...``.
"""

import os
import sys

from nbconvert.preprocessors import ClearMetadataPreprocessor, CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import (
    AssignLatePenalties,
    CheckCellMetadata,
    ClearHiddenTests,
    ClearOutput,
    DeduplicateIds,
    GetGrades,
    IgnorePattern,
    LimitOutput,
    OverwriteCells,
    OverwriteKernelspec,
    SaveAutoGrades,
)
from nbgrader.preprocessors.base import NbGraderPreprocessor

c = get_config()  # noqa: F821  (nbgrader's config loader defines get_config)

COURSE_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, COURSE_ROOT)  # the course's own steps: course_tools/

from course_tools.exchange import CourseReleaseFeedback  # noqa: E402
from course_tools.execution import GuardedExecute  # noqa: E402
from course_tools.integrity import make_validate_hook  # noqa: E402
from course_tools.preprocessors import (  # noqa: E402
    HideHiddenTestOutputs,
    IntegrityCheck,
    RepairCells,
)

c.CourseDirectory.course_id = "efficient-attention"
c.CourseDirectory.root = COURSE_ROOT
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(COURSE_ROOT, "gradebook.db")

# Execution at autograde time (course_tools/execution.py, course_tools/timekeeping.py). A cell
# is limited by the CPU time its processes use, not by the clock: a busy grading machine
# (other kernels, a build) makes honest cells slower by the clock, never by CPU time. A cell
# past its CPU limit, or past the wall-clock limit while mostly waiting (sleeping, blocked),
# is interrupted (a TimeLimitError under it); one that ignores the interrupt (it catches
# KeyboardInterrupt, or sits in one long native call) or kills the kernel is *stopped*: the
# notebook runs again in a fresh kernel with that cell replaced by an error. Either costs
# only the parts that depend on that cell (tests/test_grading.py checks both). A cell that a
# busy machine keeps from running goes on up to busy_limit_s; the read-only cells before the
# first answer (setup, grader tools: kernel start and first imports) have no CPU limit. Past
# those the machine is at fault: the notebook is run once more, alone, then reported not
# graded (FAILED TO GRADE), never scored. A whole solution notebook uses about 10 s of CPU.
c.GuardedExecute.cpu_limit_s = 30  # CPU seconds per cell
c.GuardedExecute.wall_limit_s = 120  # wall-clock seconds for a cell that waits
c.GuardedExecute.busy_limit_s = 900  # a cell starved by a busy machine: then rerun alone
c.GuardedExecute.instructor_limit_s = 600  # setup and grader-tools cells: then rerun alone
c.GuardedExecute.notebook_limit_s = 600  # all student cells together: CPU plus waiting
# `nbgrader validate` (students' machines, the source checks) runs nbgrader's plain Execute,
# with this wall-clock limit per cell.
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True

# The sandbox (course_tools/sandbox.py; assignments/README.md, "Sandboxed autograding"):
# autograde runs each submission's kernel under bubblewrap, with no access to this folder,
# no network, and the limits below (a limit reached costs only the parts that depend on it
# and is reported by the grade command). Without bubblewrap, autograding stops with the
# command that installs it (`apt-get install -y bubblewrap`). The only way to grade without
# the sandbox is to say so here: c.Sandbox.enabled = False (for machines without user
# namespaces; student code then runs with your rights). `nbgrader validate` is not sandboxed.
c.Sandbox.enabled = True
c.Sandbox.memory_limit_mb = 4096  # RLIMIT_DATA of the kernel (torch imported: ~300 MiB)
c.Sandbox.max_processes = 256  # RLIMIT_NPROC: processes and threads (a fork bomb stops here)
c.Sandbox.max_file_mb = 64  # RLIMIT_FSIZE: largest file the kernel may write
c.Sandbox.tmp_size_mb = 256  # the sandbox's private /tmp
c.Sandbox.disk_limit_mb = 512  # what the kernel's files may take in all (besides /tmp)
c.Sandbox.max_files = 10000  # files and folders it may make
c.GuardedExecute.max_output_bytes = 2 * 1024 * 1024  # output per cell, then OutputLimitError

# Exchange (nbgrader release_assignment / fetch / submit / collect): a folder the instructor
# names in NBGRADER_EXCHANGE, by default exchange/ inside this course folder (git-ignored).
# On a shared JupyterHub every user must see the same folder: see assignments/README.md.
c.Exchange.root = os.environ.get("NBGRADER_EXCHANGE", os.path.join(COURSE_ROOT, "exchange"))
# release_feedback: nbgrader's own stops with a traceback at a submission that did not come
# through the exchange (zip_collect, copied by hand), after releasing part of the class. This
# one releases nothing then, and says what to do: release the others with --student=<id>,
# send those students their HTML feedback file (course_tools/exchange.py).
c.ExchangeFactory.release_feedback = CourseReleaseFeedback

# zip_collect: submissions downloaded from an LMS (one archive, or the files themselves) go
# into downloaded/<assignment>/archive/, named `<student id>_<assignment>.ipynb` (a student
# id has no underscore), e.g. `jdoe_argmax_attention.ipynb`; see assignments/README.md.
c.ZipCollectApp.collector_plugin = "nbgrader.plugins.FileNameCollectorPlugin"
# (the plugin matches the whole path of each extracted file)
c.FileNameCollectorPlugin.named_regexp = (
    r"^(?:.*/)?(?P<student_id>[^_/]+)_(?P<file_id>[^/]+)\.ipynb$"
)

# The course's steps (course_tools/preprocessors.py): repair the cell metadata, apply the
# integrity check after the read-only cells are restored, and execute so that a cell that
# cannot be interrupted is stopped instead of losing the whole submission.
c.Autograde.sanitize_preprocessors = [
    ClearOutput,
    RepairCells,
    DeduplicateIds,
    OverwriteKernelspec,
    OverwriteCells,
    IntegrityCheck,
    CheckCellMetadata,
]
c.Autograde.autograde_preprocessors = [
    GuardedExecute,
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]
# `nbgrader validate`: a notebook with a rejected cell fails with the reasons.
c.Execute.on_notebook_start = make_validate_hook()

# Test cells are read-only; whatever a student did to them, autograde restores the
# original source and points from the gradebook (OverwriteCells), and puts back a
# graded cell the student deleted (RepairCells already puts back every read-only cell).
c.OverwriteCells.add_missing_cells = True

# Long outputs (a print in a loop) would bloat feedback files.
c.LimitOutput.max_lines = 200

# Files copied into each release besides the notebook: none expected; keep caches out.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback"]


# Feedback. The autograded notebooks contain the hidden tests (nbgrader restores them to
# grade), and nbgrader's feedback HTML would show them. Here the feedback keeps only
# passed/failed and the error type of every test cell with hidden tests (and of whatever
# student code prints after the first of them: it could print hidden inputs), then strips
# the hidden test regions; visible-only tests keep their messages.

c.GenerateFeedback.preprocessors = [
    GetGrades,
    HideHiddenTestOutputs,
    ClearHiddenTests,
    CSSHTMLHeaderPreprocessor,
]
# nbconvert's HTML exporter configures NbConvertBase.display_data_priority, which every
# preprocessor inherits; nbgrader's preprocessors redefine that trait without making it
# configurable, so each of them but GetGrades printed "Config option `display_data_priority`
# not recognized" (twice per generate_feedback: HideHiddenTestOutputs, ClearHiddenTests).
# None of them reads it; making it configurable (as GetGrades' is) silences them.
NbGraderPreprocessor.display_data_priority.tag(config=True)
