"""The nbgrader pipeline, end to end, for every assignment under assignments/source.

For each assignment (found by discovery, so new ones are covered automatically) a scratch
copy of the course is made in a temporary folder, with the real ``nbgrader_config.py`` and
what it loads (``course_tools/``, ``rules/``). Then:

- ``nbgrader generate_assignment`` makes the student release, which must contain no
  solution, no hidden test and no rubric, and must not import the graded functions;
- ``nbgrader validate`` passes on the source (the instructor's solution) and fails, naming
  the rule, on a notebook the integrity check rejects;
- the course's grade command (``python -m course_tools.grade``, one ``nbgrader autograde``
  for every student) grades: "solution" (the source: every autograded point), "blank" (the
  untouched release: none), "cheater" (attacks from tests/cheats/common.py appended to every
  other answer cell, a tamper that only the tests' ``_grader.check()`` can see in the last
  one, and a correct first answer that warns and prints its inputs), "broken" (an
  interrupt-proof loop, a syntax error, test cells duplicated, renamed, re-typed and deleted,
  the grader-tools cell deleted), the cases of tests/cheats/<assignment>.py, and "corrupt"
  (not a notebook: reported as not graded, never as 0). Each must lose exactly the test cells
  that depend on what it broke (found from the names the cells define and use), read from
  the gradebook, which must agree with the autograded notebooks;
- ``nbgrader generate_feedback``: no hidden test line, hidden message or printed hidden input.

Each assignment is generated, validated and graded once (the module-scoped fixture
``graded``); the tests then check what came out, per assignment or per student (test ids
``[assignment]`` and ``[assignment-student]``). With ``pytest -n 2 --dist loadgroup`` (``make
grading``), tests/conftest.py sends all the tests of one assignment to one worker: two
assignments are graded at a time, none twice.

Cost: about 3 s per kernel start (torch import) plus nbgrader's start-up (~2 s per command);
the broken student waits for one per-cell time limit (ROBUSTNESS_CPU_S of CPU, or
ROBUSTNESS_WALL_S of waiting) plus a rerun.
About a minute of one core per assignment.
"""

from __future__ import annotations

import copy
import csv
import html
import importlib.util
import json
import os
import re
import resource
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
# The battery uses short per-cell time limits so the interrupt-proof loop (CPU time) and wait
# (wall-clock time spent waiting) cost seconds; the course's own values are checked separately
# in test_config_*.
ROBUSTNESS_CPU_S = 10
ROBUSTNESS_WALL_S = 20


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_notebook = _load("make_notebook", COURSE / "make_notebook.py")
common = _load("cheats_common", ROOT / "tests" / "cheats" / "common.py")
integrity = _load("course_integrity", COURSE / "course_tools" / "integrity.py")


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


# The cases of tests/cheats/<name>.py graded by `make test`: those of the three assignments
# whose cases hold the runtime guard's attack classes, and those of one cost test's quadratic
# forms. Each case is one more notebook graded (about 8 s of CPU); every assignment's cases
# would add some 40 notebooks to `make test`. `make grading` grades them all
# (GRADING_CASES=all; or a comma-separated list of assignments).
CASES_IN_MAKE_TEST = ("argmax_attention", "chunkwise_linear_attention", "purification",
                      "scaled_dot_product")


def cases_graded(name: str) -> bool:
    chosen = os.environ.get("GRADING_CASES", ",".join(CASES_IN_MAKE_TEST))
    return chosen == "all" or name in chosen.split(",")


def _cases(name: str) -> list[dict]:
    path = ROOT / "tests" / "cheats" / f"{name}.py"
    if not path.is_file() or not cases_graded(name):
        return []
    return list(_load(f"cheats_{name}", path).CASES)


FIXED_STUDENTS = ("solution", "blank", "cheater", "broken", "corrupt")


def _students(name: str, source, release) -> dict:
    """{student: (notebook or text, test cells that must score 0 (None: all), notes)}."""
    offset = NAMES.index(name) * 3  # each assignment tries other attacks first
    cheater, lost, attacks, warned = common.cheater(source, offset)
    broken, broken_lost, edits = common.broken(source, NAMES.index(name))
    students = {  # in the order of FIXED_STUDENTS, then the cases
        "solution": (source, set(), {}),
        "blank": (release, None, {}),
        "cheater": (cheater, lost, {"attacks": attacks, "warned": warned}),
        "broken": (broken, broken_lost, {"edits": edits}),
        "corrupt": ("this is not a notebook", None, {}),
    }
    for number, (names, nb, case_lost) in enumerate(common.combine_cases(source, _cases(name))):
        students[f"case{number}"] = (nb, case_lost, {"cases": names})
    return students


def _student_names(name: str) -> list[str]:
    """The students ``_students`` builds for ``name``, known at collection time so that each
    gets tests of its own."""
    try:
        source = nbformat.read(COURSE / "source" / name / f"{name}.ipynb", as_version=4)
        case_students = len(common.combine_cases(source, _cases(name)))
    except Exception:  # a notebook or case file being edited: `graded` reports the error
        case_students = 0
    return [*FIXED_STUDENTS, *(f"case{number}" for number in range(case_students))]


STUDENTS = {name: _student_names(name) for name in NAMES}


# (assignment, student) for the per-student tests, with ids `name-student` (tests/conftest.py
# reads the assignment from them); "corrupt" has its own checks
GRADED_STUDENTS = [
    pytest.param(name, student, id=f"{name}-{student}")
    for name in NAMES for student in STUDENTS[name] if student != "corrupt"
]


# What `graded` made, by assignment: the result, or the error to raise again. pytest would run
# the fixture again whenever the tests of one assignment are not consecutive (the per-student
# tests follow all the others); here each assignment is graded once per process.
RUNS: dict[str, dict | BaseException] = {}


@pytest.fixture(scope="module", params=NAMES)
def graded(request, tmp_path_factory):
    name = request.param
    if name not in RUNS:
        try:
            RUNS[name] = _grade(name, tmp_path_factory)
        except Exception as error:
            RUNS[name] = error
            raise
    if isinstance(RUNS[name], BaseException):  # the first test of this assignment shows it
        pytest.fail(f"grading {name} failed: {RUNS[name]!r}"[:2000])
    return RUNS[name]


def _grade(name: str, tmp_path_factory) -> dict:
    """Generate, validate and grade one assignment's students in a scratch course: one
    ``nbgrader generate_assignment``, one ``nbgrader validate``, one grade command for all the
    students, one ``nbgrader generate_feedback``."""
    course = tmp_path_factory.mktemp(f"course-{name}")
    shutil.copy(COURSE / "nbgrader_config.py", course)
    for folder in ("course_tools", "rules"):
        shutil.copytree(COURSE / folder, course / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(COURSE / "source" / name, course / "source" / name)
    timings, cpu = {}, {}

    start, used = time.perf_counter(), _children_cpu_s()
    _nbgrader(course, "generate_assignment", name, "--force")
    timings["generate"], cpu["generate"] = time.perf_counter() - start, _children_cpu_s() - used
    source = nbformat.read(course / "source" / name / f"{name}.ipynb", as_version=4)
    release = nbformat.read(course / "release" / name / f"{name}.ipynb", as_version=4)

    start, used = time.perf_counter(), _children_cpu_s()
    validate = _nbgrader(course, "validate", str(course / "source" / name / f"{name}.ipynb"),
                         check=False)
    timings["validate"], cpu["validate"] = time.perf_counter() - start, _children_cpu_s() - used

    students = _students(name, source, release)
    assert list(students) == STUDENTS[name], "the students differ from those collected"
    for student, (nb, _, _) in students.items():
        folder = course / "submitted" / student / name
        folder.mkdir(parents=True)
        if isinstance(nb, str):
            (folder / f"{name}.ipynb").write_text(nb)
        else:
            nbformat.write(nb, folder / f"{name}.ipynb")

    start, used = time.perf_counter(), _children_cpu_s()
    grade = subprocess.run(
        [sys.executable, "-m", "course_tools.grade", name,
         f"--cpu-limit={ROBUSTNESS_CPU_S}", f"--wall-limit={ROBUSTNESS_WALL_S}"],
        cwd=course, env=_env(), capture_output=True, text=True, timeout=1800,
    )
    timings["grade"], cpu["grade"] = time.perf_counter() - start, _children_cpu_s() - used
    start, used = time.perf_counter(), _children_cpu_s()
    _nbgrader(course, "generate_feedback", name)
    timings["feedback"], cpu["feedback"] = time.perf_counter() - start, _children_cpu_s() - used
    print(f"\n[{name}] " + ", ".join(f"{k} {v:.1f} s ({cpu[k]:.1f} s CPU)"
                                     for k, v in timings.items())
          + f" ({len(students)} students)")
    return {
        "name": name, "course": course, "source": source, "release": release,
        "validate": validate, "grade": grade, "students": students, "timings": timings,
        "cpu": cpu,
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that ended (and theirs that they waited for):
    what a command cost, whatever the machine's load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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


def _expected(graded, student) -> dict[str, float]:
    source, (_, lost, _) = graded["source"], graded["students"][student]
    tests = {_meta(c)["grade_id"]: float(_meta(c)["points"])
             for c in source.cells if _is_autograded_test(c)}
    lost = set(tests) if lost is None else lost
    assert lost <= set(tests), f"{student}: unknown test cells {lost - set(tests)}"
    return {t: (0.0 if t in lost else p) for t, p in tests.items()}


@pytest.mark.parametrize(("graded", "student"), GRADED_STUDENTS, indirect=["graded"])
def test_student_scores_what_it_should_and_gradebook_agrees(graded, student):
    name, source = graded["name"], graded["source"]
    tests = {_meta(c)["grade_id"]: float(_meta(c)["points"])
             for c in source.cells if _is_autograded_test(c)}
    total = sum(float(_meta(c)["points"]) for c in source.cells if _meta(c).get("grade"))
    assert tests, "no autograded test cell"
    output = graded["grade"].stdout + graded["grade"].stderr
    expected = _expected(graded, student)
    with _gradebook(graded) as gradebook:
        notebook = gradebook.find_submission_notebook(name, name, student)
        auto = {g.name: g.auto_score for g in notebook.grades if g.name in tests}
        maxima = {g.name: g.max_score for g in notebook.grades if g.name in tests}
        assert maxima == tests, f"{student}: points changed in the gradebook"
        assert auto == expected, (
            f"{student}: got {auto}, expected {expected}\n{output[-6000:]}")
        # the gradebook agrees with the autograded notebook's own outputs
        assert _expected_scores(graded, student) == expected, student
        assert notebook.code_score == pytest.approx(sum(expected.values()))
        assert notebook.max_score == pytest.approx(total), student
        # written answers: untouched ones score 0, answered ones wait for a human
        for grade in notebook.grades:
            if grade.name not in tests:
                assert grade.auto_score == (0 if student == "blank" else None), grade.name
    # the grade command's table and CSV give the same score for every autograded part
    table = _table(graded, student)
    for part, points in expected.items():
        assert re.search(rf"{re.escape(part)}\s+{points:g} / ", table), (student, part, table)
    rows = list(csv.DictReader((graded["course"] / "grades" / f"{name}.csv").open()))
    csv_scores = {r["part"]: float(r["score"]) for r in rows
                  if r["student"] == student and r["part"] in expected}
    assert csv_scores == expected, student


def test_solution_runs_cleanly(graded):
    """Every code cell of the instructor's solution, graded in the sandbox, runs without an
    error or a stderr stream, tests or not (what notebook validation of the source checks:
    ``make test`` does not also run the sources through nbval)."""
    name, course = graded["name"], graded["course"]
    nb = nbformat.read(course / "autograded" / "solution" / name / f"{name}.ipynb",
                       as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code), "cells did not run"
    problems = [f"cell {nb.cells.index(cell) + 1}: {output.get('ename') or output.get('text')}"
                for cell in code for output in cell.outputs
                if output.output_type == "error"
                or (output.output_type == "stream" and output.name == "stderr")]
    assert not problems, problems


def test_cheater_really_attacks(graded):
    """The cheater holds at least one attack (there is one for every other answer cell)."""
    if len(common.answers(graded["source"])) < 2:
        pytest.skip("this assignment has a single answer cell: nothing to attack")
    notes = graded["students"]["cheater"][2]
    assert notes["attacks"], notes


def _table(graded, student) -> str:
    """The grade command's table of one student."""
    text = graded["grade"].stdout
    match = re.search(rf"^== {re.escape(student)} ==\n(.*?)(?=^== |\n\d+ of \d+ submission)",
                      text, flags=re.M | re.S)
    assert match, f"no table for {student} in:\n{text[-3000:]}"
    return match.group(1)


def test_grade_command_reports_what_happened(graded):
    name, course = graded["name"], graded["course"]
    result = graded["grade"]
    # one submission could not be graded: the command says so and fails, never shows a 0
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED TO GRADE" in _table(graded, "corrupt")
    assert "NOT GRADED: corrupt" in result.stdout
    rows = list(csv.DictReader((course / "grades" / f"{name}.csv").open()))
    corrupt = [r for r in rows if r["student"] == "corrupt"]
    assert [(r["status"], r["score"]) for r in corrupt] == [("failed to grade", "")]
    # (the scores per part in the table and the CSV: test_student_scores_what_it_should_...)
    # what happened, with reasons
    cheater = _table(graded, "cheater")
    if graded["students"]["cheater"][2]["attacks"][:1] not in ([], ["runtime-tamper"]):
        assert "flagged: answer cell" in cheater, cheater
    broken = _table(graded, "broken")
    assert "stopped: " in broken and "did not stop when interrupted" in broken, broken
    for edit in graded["students"]["broken"][2]["edits"]:
        kind = edit.split()[0]
        if kind == "delete":
            assert f"deleted read-only cell {edit.split()[1]} was put back" in broken, broken
        elif kind in ("duplicate", "rename", "retype"):
            word = {"duplicate": "removed a copy", "rename": "unknown grade id",
                    "retype": "was turned into a markdown cell"}[kind]
            assert word in broken, (edit, broken)


def test_validate_and_checker_reject_cheats(graded):
    """Students learn before submitting: validate and check_notebook.py name the rule."""
    course, name = graded["course"], graded["name"]
    cheater = course / "submitted" / "cheater" / name / f"{name}.ipynb"
    if not graded["students"]["cheater"][2]["attacks"][:1] or graded["students"]["cheater"][
            2]["attacks"][0] == "runtime-tamper":
        pytest.skip("this assignment has a single answer cell: no static attack to find")
    result = _nbgrader(course, "validate", str(cheater), check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "integrity check rejects" in output, output[-3000:]
    checker = subprocess.run(
        [sys.executable, str(course / "course_tools" / "integrity.py"), str(cheater)],
        capture_output=True, text=True, env=_env())
    assert checker.returncode == 1 and "would be rejected" in checker.stdout, checker.stdout
    clean = subprocess.run(
        [sys.executable, str(course / "course_tools" / "integrity.py"),
         str(course / "release" / name / f"{name}.ipynb")],
        capture_output=True, text=True, env=_env())
    assert clean.returncode == 0, clean.stdout


def _html_text(path: Path) -> str:
    """The text of an HTML file: tags dropped, entities decoded (code lines survive)."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text()))


def test_feedback_hides_hidden_tests(graded):
    """Feedback shows visible tests and scores; no hidden line, message or printed input."""
    course, name, source = graded["course"], graded["name"], graded["source"]
    hidden, visible, public = set(), set(), set()
    for cell in source.cells:
        inside, outside = _regions(cell.source)
        if _is_autograded_test(cell):
            hidden |= {line for line in inside if len(line) >= 8}
            visible |= {line for line in outside if len(line) >= 8}
            public |= set(outside)
        else:  # setup, grader tools, answers (a solution shows its own code), text
            public |= {line.strip() for line in cell.source.splitlines()}
    hidden -= public  # a hidden line that also occurs elsewhere proves nothing
    for student in ("solution", "cheater", "broken"):
        text = _html_text(course / "feedback" / student / name / f"{name}.html")
        lines = {line.strip() for line in text.splitlines()}
        assert visible & lines, "no visible test line found: the text extraction is broken"
        assert "BEGIN HIDDEN TESTS" not in text
        assert not hidden & lines, f"{student}: feedback shows {sorted(hidden & lines)[:3]}"
        assert "hidden test: details are not shown" in text or student == "solution"
    text = _html_text(course / "feedback" / "cheater" / name / f"{name}.html")
    warned = graded["students"]["cheater"][2]["warned"]
    first_hidden = next(i for i, c in enumerate(source.cells)
                        if _is_autograded_test(c) and "BEGIN HIDDEN TESTS" in c.source)
    called_before = any(warned and re.search(rf"\b{warned}\(", c.source)
                        for c in source.cells[:first_hidden] if not _meta(c).get("solution"))
    if warned and not called_before:
        assert "SECRET-INPUTS" not in text  # printed inside hidden tests: never shown
    autograded = nbformat.read(course / "autograded" / "cheater" / name / f"{name}.ipynb", 4)
    outputs = "".join(o.get("text", "") for c in autograded.cells
                      for o in c.get("outputs", []) if o.output_type == "stream")
    if warned:  # the warning went to stdout: visible to the student while working, not a fail
        assert "UserWarning" in outputs and "SECRET-INPUTS" in outputs


def test_config_timeout_and_paths():
    from traitlets.config import Config

    config = Config()
    namespace = {"get_config": lambda: config, "__file__": str(COURSE / "nbgrader_config.py")}
    exec(compile((COURSE / "nbgrader_config.py").read_text(), "nbgrader_config.py", "exec"),
         namespace)
    # a cell is limited by CPU time; the wall-clock ceiling for a waiting cell is several
    # times larger, and the ceilings past which the machine is at fault larger still
    limits = config.GuardedExecute
    assert 10 <= limits.cpu_limit_s <= 60
    assert limits.wall_limit_s >= 3 * limits.cpu_limit_s
    assert limits.busy_limit_s >= 5 * limits.wall_limit_s
    assert limits.instructor_limit_s >= 300
    # a whole notebook: many times one cell's CPU limit, well under the instructor's ceilings
    assert 10 * limits.cpu_limit_s <= limits.notebook_limit_s <= limits.busy_limit_s
    assert config.Sandbox.disk_limit_mb >= 4 * config.Sandbox.max_file_mb
    assert config.Sandbox.max_files >= 1000
    assert config.Execute.timeout >= limits.wall_limit_s  # nbgrader validate: wall-clock
    assert config.Execute.interrupt_on_timeout is True
    assert Path(config.CourseDirectory.root) == COURSE
    assert config.CourseDirectory.db_url == f"sqlite:///{COURSE / 'gradebook.db'}"
    # the exchange is a folder the instructor names (default inside the course), never
    # nbgrader's /usr/local/share/nbgrader/exchange
    assert config.Exchange.root == os.environ.get("NBGRADER_EXCHANGE", str(COURSE / "exchange"))
    # the course's steps are in nbgrader's pipeline, in order
    sanitize = [cls.__name__ for cls in config.Autograde.sanitize_preprocessors]
    assert sanitize.index("RepairCells") < sanitize.index("OverwriteCells") < sanitize.index(
        "IntegrityCheck")
    assert config.Autograde.autograde_preprocessors[0].__name__ == "GuardedExecute"
    feedback = [cls.__name__ for cls in config.GenerateFeedback.preprocessors]
    assert feedback.index("HideHiddenTestOutputs") < feedback.index("ClearHiddenTests")
    assert callable(config.Execute.on_notebook_start)
    assert config.ZipCollectApp.collector_plugin.endswith("FileNameCollectorPlugin")


def test_cost_budget(graded):
    """Grading stays cheap, in CPU time (a busy machine stretches the clock, not this):
    validating the source (nbgrader and the whole notebook in a kernel: about 12 s for
    argmax_attention) under 60 s, and the grade command's own processes (nbgrader, the
    gradebook; the sandboxed kernels' CPU time is not reported to them, bubblewrap's init
    reaps those) under 10 s per submission."""
    cpu, students = graded["cpu"], len(graded["students"])
    assert cpu["validate"] < 60, (cpu, graded["timings"])
    assert cpu["grade"] < 10 * students, (cpu, graded["timings"])


SETUP_NAMES = {"torch", "math", "np", "plt"}


@pytest.mark.parametrize(("kind", "snippet"), common.ATTACKS,
                         ids=[f"{k}-{i}" for i, (k, _) in enumerate(common.ATTACKS)])
def test_integrity_check_rejects_every_attack(kind, snippet):
    problems = integrity.check_source("def f(x):\n    return x\n\n" + snippet, None,
                                      SETUP_NAMES)
    assert problems, f"{kind} not caught: {snippet}"
    assert all(line >= 4 for line, _ in problems), problems  # the honest part is not blamed


def test_integrity_check_rules_and_defaults():
    honest = ("class Block(torch.nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.w = torch.nn.Parameter(torch.ones(2))\n\n"
              "def f(x, input=None):\n    total = 0\n    for _ in range(2):\n"
              "        total += torch.softmax(x, -1).sum() * math.pi + np.pi\n    return total\n")
    assert integrity.check_source(honest, None, SETUP_NAMES) == []
    assert integrity.check_source("def f(:\n    pass", None, SETUP_NAMES) is None  # SyntaxError
    forbidding = {"allowed_modules": ["torch"], "forbidden_attributes": ["torch.linalg.pinv"]}
    assert integrity.check_source("def f(a):\n    return torch.linalg.pinv(a)", forbidding)
    assert integrity.check_source("import numpy", forbidding)
    # a missing rules file means the defaults
    assert integrity.load_rules("no_such_assignment", COURSE / "rules") == integrity.DEFAULT_RULES
    # the runtime tamper passes the text check: only the kernel's runtime guard refuses it
    # (course_tools/runtime_guard.py; the battery's cheater has it in its last answer cell)
    assert integrity.check_source(common.RUNTIME_TAMPER, None, SETUP_NAMES) == []


@pytest.mark.parametrize("name", NAMES)
def test_rules_file_and_sources_pass_the_check(name):
    rules = json.loads((COURSE / "rules" / f"{name}.json").read_text())
    assert set(rules) == {"allowed_modules", "forbidden_attributes"}
    source = json.loads((COURSE / "source" / name / f"{name}.ipynb").read_text())
    assert integrity.problems_in(source, integrity.course_catalogue(COURSE), name) == {}
