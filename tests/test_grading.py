"""The nbgrader pipeline, end to end, for every assignment under assignments/source.

For each assignment (found by discovery, so new ones are covered automatically) a scratch
copy of the course is made in a temporary folder, with the real ``nbgrader_config.py``
(whose paths are relative to its own folder). Then:

- ``nbgrader generate_assignment`` makes the student release, which must contain no
  solution, no hidden test and no rubric, and must not import the graded functions;
- ``nbgrader validate`` passes on the source (the instructor's solution);
- ``nbgrader autograde`` grades two students in one call: "solution" (the source) must get
  every autograded point and "blank" (the untouched release) none, read from the gradebook.

On ``argmax_attention`` four more students check robustness: an infinite loop (stopped by
the execution timeout; only that part is lost), an edited read-only test cell (graded with
the original test), a cell that raises (only the parts that depend on it are lost) and a
deleted test cell (put back and graded). For every student the gradebook must agree with
the autograded notebook: score = sum of the points of the test cells that passed.

Cost: about 3 s per kernel start (torch import) plus nbgrader's own start-up (~3 s per
command): about 20-30 s per assignment on two idle cores, about 65 s for argmax_attention
(six students, one of them waits for a 10 s timeout, and the feedback), two to three times
that on a loaded machine.
"""

from __future__ import annotations

import copy
import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
BIN = Path(sys.executable).parent  # nbgrader, jupyter and alembic live next to python
NAMES = sorted(
    p.name for p in (COURSE / "source").iterdir() if (p / f"{p.name}.ipynb").is_file()
)
ROBUSTNESS = "argmax_attention"
# The robustness run uses a short per-cell timeout so the infinite loop costs seconds; the
# course's own value (30 s) is checked separately in test_config_*.
ROBUSTNESS_TIMEOUT_S = 10
TIMINGS: dict[str, float] = {}

_spec = importlib.util.spec_from_file_location("make_notebook", COURSE / "make_notebook.py")
make_notebook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_notebook)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # Gradebook runs `alembic`
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, as students have it
    return env


def _nbgrader(course: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(BIN / "nbgrader"), *args],
        cwd=course, env=_env(), capture_output=True, text=True, timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"nbgrader {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _cell(nb, grade_id: str):
    matches = [c for c in nb.cells if _meta(c).get("grade_id") == grade_id]
    assert len(matches) == 1, f"no unique cell {grade_id!r}"
    return matches[0]


def _is_autograded_test(cell) -> bool:
    meta = _meta(cell)
    return cell.cell_type == "code" and meta.get("grade") and not meta.get("solution")


def _replace(cell, old: str, new: str) -> None:
    assert old in cell.source, f"{_meta(cell)['grade_id']}: {old!r} not found"
    cell.source = cell.source.replace(old, new, 1)


def _robustness_students(source) -> dict[str, tuple[object, set[str]]]:
    """Broken submissions of argmax_attention and the test cells each must lose."""
    students = {}

    nb = copy.deepcopy(source)  # an infinite loop inside the Part 4 function
    _replace(_cell(nb, "part4-grads-solution"), "    ### BEGIN SOLUTION",
             "    while True:\n        pass\n    ### BEGIN SOLUTION")
    students["loop"] = (nb, {"part4-grads-test"})

    nb = copy.deepcopy(source)  # wrong Part 2, and its locked test replaced, points inflated
    _replace(_cell(nb, "part2-argmax-solution"), "return weights @ v", "return 0 * weights @ v")
    test = _cell(nb, "part2-argmax-test")
    test.source = "pass  # the student emptied the test"
    test.metadata["nbgrader"]["points"] = 100
    students["edited"] = (nb, {"part2-argmax-test"})

    nb = copy.deepcopy(source)  # Part 1's cell raises: Part 2 (which calls it) fails too
    _replace(_cell(nb, "part1-scores-solution"), "def attention_scores",
             'raise RuntimeError("a bug")\n\n\ndef attention_scores')
    students["raises"] = (nb, {"part1-scores-test", "part2-argmax-test"})

    nb = copy.deepcopy(source)  # wrong Part 5 and its test cell deleted
    _replace(_cell(nb, "part5-softmax-solution"), "return torch.softmax(scores, dim=-1) @ v",
             "return torch.zeros(*q.shape[:-1], v.shape[-1])")
    nb.cells.remove(_cell(nb, "part5-softmax-test"))
    students["deleted"] = (nb, {"part5-softmax-test"})
    return students


@pytest.fixture(scope="module", params=NAMES)
def graded(request, tmp_path_factory):
    """Generate, validate and autograde one assignment in a scratch course."""
    name = request.param
    course = tmp_path_factory.mktemp(f"course-{name}")
    shutil.copy(COURSE / "nbgrader_config.py", course)
    shutil.copytree(COURSE / "source" / name, course / "source" / name)
    timings = {}

    start = time.perf_counter()
    _nbgrader(course, "generate_assignment", name, "--force")
    timings["generate"] = time.perf_counter() - start
    source = nbformat.read(course / "source" / name / f"{name}.ipynb", as_version=4)
    release_path = course / "release" / name / f"{name}.ipynb"
    release = nbformat.read(release_path, as_version=4)

    start = time.perf_counter()
    validate = _nbgrader(course, "validate", str(course / "source" / name / f"{name}.ipynb"),
                         check=False)
    timings["validate"] = time.perf_counter() - start

    students = {"solution": (source, set()), "blank": (release, None)}  # None: loses all
    extra = []
    if name == ROBUSTNESS:
        students.update(_robustness_students(source))
        extra = [f"--Execute.timeout={ROBUSTNESS_TIMEOUT_S}"]
    for student, (nb, _) in students.items():
        folder = course / "submitted" / student / name
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{name}.ipynb")

    start = time.perf_counter()
    autograde = _nbgrader(course, "autograde", name, *extra)
    timings["autograde"] = time.perf_counter() - start
    if name == ROBUSTNESS:
        start = time.perf_counter()
        _nbgrader(course, "generate_feedback", name)
        timings["feedback"] = time.perf_counter() - start
    TIMINGS[name] = sum(timings.values())
    print(f"\n[{name}] " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
          + f" ({len(students)} students)")
    return {
        "name": name, "course": course, "source": source, "release": release,
        "validate": validate, "autograde": autograde, "students": students,
        "timings": timings,
    }


def _regions(source: str) -> tuple[list[str], list[str]]:
    """Stripped lines inside ``### BEGIN SOLUTION|HIDDEN TESTS`` ... ``### END ...`` regions,
    and the lines outside them."""
    inside, outside, within = [], [], False
    for line in source.splitlines():
        if re.search(r"BEGIN (SOLUTION|HIDDEN TESTS)", line):
            within = True
        elif re.search(r"END (SOLUTION|HIDDEN TESTS)", line):
            within = False
        else:
            (inside if within else outside).append(line.strip())
    return inside, outside


def test_source_follows_conventions(graded):
    assert make_notebook.check(graded["source"]) == []


MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS", "Rubric")


def _leaks(source, release) -> list[str]:
    """Markers, solution lines and hidden-test lines of ``source`` found in ``release``."""
    release_text = "\n".join(c.source for c in release.cells)
    found = [marker for marker in MARKERS if marker in release_text]
    secret, public = [], []
    for cell in source.cells:
        inside, outside = _regions(cell.source)
        secret += inside
        public += outside
    # a secret line that also occurs outside any region (e.g. `return out`) proves nothing
    secret = {line for line in secret if len(line) >= 8} - set(public)
    assert secret, "no solution or hidden-test lines found in the source"
    release_lines = {line.strip() for line in release_text.splitlines()}
    return found + sorted(secret & release_lines)


def _library_uses(source, release) -> list[str]:
    """Release code lines that take a function the student must write from the library."""
    graded_names = set()
    for cell in source.cells:
        if _meta(cell).get("solution") and cell.cell_type == "code":
            graded_names |= set(re.findall(r"^def (\w+)\(", cell.source, flags=re.M))
    assert graded_names, "the assignment asks for no function"
    code = "\n".join(c.source for c in release.cells if c.cell_type == "code")
    imports_library = re.search(r"^\s*(import|from) efficient_attention", code, flags=re.M)
    uses = []
    for line in code.splitlines():
        library_line = "efficient_attention" in line or re.search(r"\bea\.", line)
        for name in graded_names:
            if (library_line and re.search(rf"\b{name}\b", line)) or (
                imports_library and re.search(rf"\w\.{name}\b", line)
            ):
                uses.append(line)
    return uses


def test_release_has_no_solution_hidden_test_or_rubric(graded):
    source, release = graded["source"], graded["release"]
    leaked = _leaks(source, release)
    assert not leaked, f"release contains: {leaked[:5]}"
    # every graded cell survives, with its points
    assert [(_meta(c)["grade_id"], _meta(c).get("points")) for c in release.cells
            if _meta(c).get("grade")] == [
        (_meta(c)["grade_id"], _meta(c).get("points")) for c in source.cells
        if _meta(c).get("grade")]


def test_release_does_not_import_the_answers(graded):
    uses = _library_uses(graded["source"], graded["release"])
    assert not uses, f"release takes graded functions from the library: {uses}"


def test_release_checks_can_fail(graded):
    """The two checks above flag a release that leaks or imports the answer."""
    source, release = graded["source"], copy.deepcopy(graded["release"])
    assert _leaks(source, source), "the source itself must count as leaking"
    name = re.search(r"^def (\w+)\(", next(
        c.source for c in source.cells if _meta(c).get("solution") and c.cell_type == "code"
    ), flags=re.M).group(1)
    for cheat in (f"from efficient_attention import {name}",
                  f"import efficient_attention as ea\nout = ea.{name}"):
        release.cells.append(nbformat.v4.new_code_cell(cheat))
        assert _library_uses(source, release), cheat
        release.cells.pop()


def test_source_validates(graded):
    result = graded["validate"]
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Success! Your notebook passes all the tests." in output, (
        output[-4000:]
    )


def _expected_scores(graded, student: str) -> dict[str, float]:
    """Autograded points per test cell, read from the autograded notebook itself."""
    name, course = graded["name"], graded["course"]
    nb = nbformat.read(course / "autograded" / student / name / f"{name}.ipynb", as_version=4)
    scores = {}
    for cell in nb.cells:
        if _is_autograded_test(cell):
            failed = any(o.output_type == "error"
                         or (o.output_type == "stream" and o.name == "stderr")
                         for o in cell.outputs)
            points = float(_cell(graded["source"], _meta(cell)["grade_id"]).metadata[
                "nbgrader"]["points"])
            scores[_meta(cell)["grade_id"]] = 0.0 if failed else points
    return scores


def _gradebook(graded):
    from nbgrader.api import Gradebook

    os.environ["PATH"] = _env()["PATH"]  # Gradebook's migrations call `alembic`
    assert (graded["course"] / "gradebook.db").is_file(), "db_url is not relative to the course"
    return Gradebook(f"sqlite:///{graded['course'] / 'gradebook.db'}")


def test_autograde_solution_full_blank_zero_and_gradebook_consistent(graded):
    name, source = graded["name"], graded["source"]
    tests = {_meta(c)["grade_id"]: float(_meta(c)["points"])
             for c in source.cells if _is_autograded_test(c)}
    total = sum(float(_meta(c)["points"]) for c in source.cells if _meta(c).get("grade"))
    assert tests, "no autograded test cell"
    with _gradebook(graded) as gradebook:
        assert gradebook.find_assignment(name).num_submissions == len(graded["students"])
        for student, (_, lost) in graded["students"].items():
            notebook = gradebook.find_submission_notebook(name, name, student)
            auto = {g.name: g.auto_score for g in notebook.grades if g.name in tests}
            maxima = {g.name: g.max_score for g in notebook.grades if g.name in tests}
            assert maxima == tests, f"{student}: points changed in the gradebook"
            lost = set(tests) if lost is None else lost
            expected = {t: (0.0 if t in lost else p) for t, p in tests.items()}
            assert auto == expected, f"{student}: got {auto}, expected {expected}"
            # the gradebook agrees with the autograded notebook's own outputs
            assert _expected_scores(graded, student) == expected, student
            assert notebook.code_score == pytest.approx(sum(expected.values()))
            assert notebook.max_score == pytest.approx(total), student
            submission = gradebook.find_submission(name, student)
            assert submission.code_score == pytest.approx(notebook.code_score)
            # written answers: untouched ones score 0, answered ones wait for a human
            for grade in notebook.grades:
                if grade.name not in tests:
                    assert grade.auto_score == (0 if student == "blank" else None), grade.name


@pytest.mark.parametrize("graded", [ROBUSTNESS], indirect=True)
def test_robustness_outputs(graded):
    """What happened in the broken submissions' cells (argmax_attention only)."""
    course, name = graded["course"], graded["name"]

    def outputs(student, grade_id):
        nb = nbformat.read(course / "autograded" / student / name / f"{name}.ipynb", 4)
        return _cell(nb, grade_id)

    timed_out = outputs("loop", "part4-grads-test")
    # the kernel is interrupted (KeyboardInterrupt) and nbgrader records CellTimeoutError
    assert "CellTimeoutError" in [o.get("ename") for o in timed_out.outputs]
    assert "Interrupting kernel" in graded["autograde"].stderr
    # execution went on after the interrupt: the next test cell ran and passed
    assert not [o for o in outputs("loop", "part5-softmax-test").outputs
                if o.output_type == "error"]
    # the edited read-only test ran as the instructor wrote it, hidden tests included
    restored = outputs("edited", "part2-argmax-test")
    assert restored.source == _cell(graded["source"], "part2-argmax-test").source
    assert [o.get("ename") for o in restored.outputs if o.output_type == "error"] == [
        "AssertionError"]
    assert "was missing from the submission" in outputs("deleted", "part5-softmax-test").source


def _html_text(path: Path) -> str:
    """The text of an HTML file: tags dropped, entities decoded (code lines survive)."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text()))


@pytest.mark.parametrize("graded", [ROBUSTNESS], indirect=True)
def test_feedback_hides_hidden_tests(graded):
    """The feedback HTML shows the visible tests and scores, not the hidden tests."""
    course, name, source = graded["course"], graded["name"], graded["source"]
    hidden, visible = set(), set()
    for cell in source.cells:
        if _is_autograded_test(cell):
            inside, outside = _regions(cell.source)
            hidden |= {line for line in inside if len(line) >= 8}
            visible |= {line for line in outside if len(line) >= 8}
    hidden -= visible
    for student in ("solution", "edited"):
        text = _html_text(course / "feedback" / student / name / f"{name}.html")
        lines = {line.strip() for line in text.splitlines()}
        assert visible & lines, "no visible test line found: the text extraction is broken"
        assert "BEGIN HIDDEN TESTS" not in text
        assert not hidden & lines, f"{student}: feedback shows {sorted(hidden & lines)[:3]}"
        if student == "edited":  # its Part 2 failed: the error type shows, the traceback not
            assert "AssertionError" in text
            assert "---->" not in text and "Cell In[" not in text  # IPython traceback marks


def test_config_timeout_and_paths():
    from traitlets.config import Config

    config = Config()
    namespace = {"get_config": lambda: config, "__file__": str(COURSE / "nbgrader_config.py")}
    exec(compile((COURSE / "nbgrader_config.py").read_text(), "nbgrader_config.py", "exec"),
         namespace)
    assert 10 <= config.Execute.timeout <= 60
    assert config.Execute.interrupt_on_timeout is True
    assert Path(config.CourseDirectory.root) == COURSE
    assert config.CourseDirectory.db_url == f"sqlite:///{COURSE / 'gradebook.db'}"


def test_time_budget(graded):
    """Generate + validate + autograde must stay cheap: under 60 s per graded notebook."""
    timings, students = graded["timings"], len(graded["students"])
    extra = ROBUSTNESS_TIMEOUT_S if graded["name"] == ROBUSTNESS else 0
    assert timings["autograde"] < 60 * students + extra, timings
    assert timings["validate"] < 60, timings
