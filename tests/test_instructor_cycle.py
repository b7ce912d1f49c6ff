"""The instructor cycle of assignments/README.md ("The cycle, command by command"), as written.

In a scratch copy of the course (``nbgrader_config.py``, ``course_tools/``, ``rules/`` and one
small assignment, ``argmax_attention``), with a scratch exchange (``NBGRADER_EXCHANGE``) and a
home folder per person (``HOME``), ``run_cycle`` runs:

- the instructor: ``db student import``, ``generate_assignment``, ``release_assignment``;
- two students through the exchange, each in a folder of their own holding only the book's
  student ``nbgrader_config.py`` and ``check_notebook.py`` (assignments/release_for_book.py):
  ``fetch_assignment``, one ``validate`` that the integrity check must fail (alice uses the
  function her assignment forbids), ``submit``; alice answers every part, bob only part 1;
- a third student through ``zip_collect`` (carol: parts 2 and 4, in a zip archive);
- ``collect``, the grade command (``python -m course_tools.grade``), ``generate_feedback``,
  ``release_feedback`` (which must refuse, carol having no exchange submission, and say what
  to do), the per-student releases it prints, ``export``.

``test_instructor_cycle`` runs it once, then the ``check_*`` functions: each step's outcome,
that every command run is one the README gives, that no ``display_data_priority`` warning is
printed, and that every file the cycle writes is git-ignored and removed by ``make clean``.
16 commands (each nbgrader start takes some 2 s of CPU; 5 s before constraints.txt kept
rfc3987-syntax out, whose grammar jsonschema built at every import) and 3 graded notebooks:
about a minute of one core. The other tests here cost nothing.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
README = COURSE / "README.md"
BIN = Path(sys.executable).parent
NAME = "argmax_attention"
NOTEBOOK = f"{NAME}.ipynb"
# The files the scratch course starts with; everything else in it is written by the cycle.
INPUTS = ("nbgrader_config.py", "course_tools", "rules", "source")
STUDENTS_CSV = ("id,first_name,last_name,email\n"
                "alice,Alice,Archer,\nbob,Bob,Baker,\ncarol,Carol,Cole,\n")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release_for_book = _load("release_for_book_cycle", COURSE / "release_for_book.py")
grade = _load("course_grade_cycle", COURSE / "course_tools" / "grade.py")


def _env(home: Path, exchange: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER", "NBGRADER")) and k not in ("MPLBACKEND", "PYTHONPATH")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
               NBGRADER_EXCHANGE=str(exchange), OMP_NUM_THREADS="1")
    return env


def _answered(release, source, parts: set[int]):
    """The release notebook with the answer cells of ``parts`` taken from the source (its
    solution markers dropped): what a student who did those parts hands in."""
    nb = nbformat.from_dict(json.loads(json.dumps(release)))
    solutions = {c.metadata["nbgrader"]["grade_id"]: c for c in source.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "")
        if grade_id in solutions and grade.part_number(grade_id) in parts:
            cell.source = "\n".join(line for line in solutions[grade_id].source.splitlines()
                                    if "BEGIN SOLUTION" not in line and "END SOLUTION" not in line)
    return nb


class Cycle:
    """Runs the commands and keeps what each printed: ``runs`` holds (who, command, result)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.course = tmp / "course"
        self.exchange = tmp / "exchange"
        self.homes = {who: tmp / "home" / who for who in ("instructor", "alice", "bob")}
        self.runs: list[tuple[str, str, subprocess.CompletedProcess]] = []
        self.cpu_s = 0.0  # CPU time of the commands and what they started

    def run(self, who: str, command: str, *extra: str, check: bool = True):
        """``command`` (as the README writes it, with ``extra`` arguments) as ``who``: the
        instructor in the course folder, a student in the folder they work in."""
        cwd = self.course if who == "instructor" else self.homes[who] / "work"
        program, *args = command.split() + list(extra)
        program = str(BIN / program) if program in ("nbgrader", "python") else program
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run([program, *args], cwd=cwd, env=_env(self.homes[who], self.exchange),
                                capture_output=True, text=True, timeout=900)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_s += (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        self.runs.append((who, " ".join([command, *extra]), result))
        if check and result.returncode != 0:
            raise AssertionError(f"{who}: {command} {' '.join(extra)} failed "
                                 f"({result.returncode}):\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}")
        return result

    def output(self, command: str) -> str:
        found = [r.stdout + r.stderr for _, c, r in self.runs if c == command]
        assert found, f"{command!r} was not run"
        return found[-1]


def run_cycle(tmp: Path) -> Cycle:
    run = Cycle(tmp)
    course = run.course
    course.mkdir()
    shutil.copy(COURSE / "nbgrader_config.py", course)
    for folder in ("course_tools", "rules"):
        shutil.copytree(COURSE / folder, course / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(COURSE / "source" / NAME, course / "source" / NAME,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    run.exchange.mkdir()
    for who, home in run.homes.items():
        home.mkdir(parents=True)
        if who != "instructor":  # the student's folder: the two files of the book's page
            (home / "work").mkdir()
            release_for_book.write_student_config(home / "work" / "nbgrader_config.py")
            release_for_book.write_checker(home / "work" / "check_notebook.py")

    # instructor: students, generate, release
    (course / "students.csv").write_text(STUDENTS_CSV)
    run.run("instructor", "nbgrader db student import students.csv")
    run.run("instructor", f"nbgrader generate_assignment {NAME} --force")
    run.run("instructor", f"nbgrader release_assignment {NAME}")
    source = nbformat.read(course / "source" / NAME / NOTEBOOK, as_version=4)
    release = nbformat.read(course / "release" / NAME / NOTEBOOK, as_version=4)

    # two students through the exchange (one account here, so --student names each)
    work = {who: run.homes[who] / "work" / NAME / NOTEBOOK for who in ("alice", "bob")}
    for who, parts in (("alice", {1, 2, 3, 4, 5, 6}), ("bob", {1})):
        run.run(who, f"nbgrader fetch_assignment {NAME}")
        fetched = nbformat.read(work[who], as_version=4)
        assert fetched == release, f"{who} fetched something else than the release"
        nbformat.write(_answered(fetched, source, parts), work[who])
    answered = nbformat.read(work["alice"], as_version=4)
    cheat = nbformat.v4.new_code_cell(
        "def attention_fast(q, k, v):\n"
        "    return torch.nn.functional.scaled_dot_product_attention(q, k, v)")
    answered.cells.append(cheat)
    nbformat.write(answered, work["alice"])
    run.run("alice", f"nbgrader validate {NAME}/{NOTEBOOK}", check=False)
    answered.cells.remove(cheat)
    nbformat.write(answered, work["alice"])
    for who in ("alice", "bob"):
        run.run(who, f"nbgrader submit {NAME}", f"--student={who}")

    # instructor: collect; a third student from an LMS, in a zip archive
    run.run("instructor", f"nbgrader collect {NAME}")
    archive = course / "downloaded" / NAME / "archive"
    archive.mkdir(parents=True)
    with zipfile.ZipFile(archive / "submissions.zip", "w") as zipped:
        zipped.writestr(f"carol_{NOTEBOOK}", nbformat.writes(_answered(release, source, {2, 4})))
    run.run("instructor", f"nbgrader zip_collect {NAME}")

    run.run("instructor", f"python -m course_tools.grade {NAME}")
    run.run("instructor", f"nbgrader generate_feedback {NAME}")
    run.feedback_before = sorted(p.name for p in (run.exchange).rglob("*.html"))
    run.run("instructor", f"nbgrader release_feedback {NAME}", check=False)
    run.feedback_refused = sorted(p.name for p in (run.exchange).rglob("*.html"))
    for who in ("alice", "bob"):
        run.run("instructor", f"nbgrader release_feedback {NAME}", f"--student={who}")
    run.run("instructor", "nbgrader export")
    print(f"\ninstructor cycle: {len(run.runs)} commands, {run.cpu_s:.0f} s of CPU")
    return run


# --- every command run is one the README gives ------------------------------------------------

def _readme_commands() -> list[re.Pattern]:
    """The commands of assignments/README.md (backquoted, starting with nbgrader or python),
    each as a pattern in which a placeholder such as ``<name>`` or ``<id>`` stands for a word."""
    text = README.read_text()
    commands = [c for c in re.findall(r"`([^`\n]+)`", text)
                if c.startswith(("nbgrader ", "python -m course_tools"))]
    return [re.compile("".join(r"\S+" if re.fullmatch(r"<[\w ]+>", part) else re.escape(part)
                               for part in re.split(r"(<[\w ]+>)", c))) for c in commands]


def check_every_command_of_the_cycle_is_written_in_the_readme(cycle):
    patterns = _readme_commands()
    assert len(patterns) > 10, "the README's commands were not found"
    unwritten = sorted({command for _, command, _ in cycle.runs
                        if not any(p.fullmatch(command) for p in patterns)})
    assert not unwritten, f"run by the cycle but not written in {README}: {unwritten}"


def test_readme_patterns_can_fail():
    patterns = _readme_commands()
    assert any(p.fullmatch("nbgrader release_feedback argmax_attention --student=alice")
               for p in patterns)
    assert not any(p.fullmatch("nbgrader release_feedback argmax_attention --force")
                   for p in patterns)


# --- the students' side -----------------------------------------------------------------------

def check_students_fetch_and_submit_through_the_exchange(cycle):
    inbound = cycle.exchange / "efficient-attention" / "inbound"
    owners = sorted(p.name.split("+")[0] for p in inbound.iterdir())
    assert owners == ["alice", "bob"], owners
    for who in ("alice", "bob"):
        submitted = cycle.course / "submitted" / who / NAME
        assert (submitted / NOTEBOOK).is_file(), f"collect did not bring {who}'s notebook"
        assert (submitted / "submission_secret.txt").is_file()


def check_student_validate_runs_the_integrity_check(cycle):
    """alice's validate, with only the book's two files, fails on the function her assignment
    forbids and names it (her own check_notebook.py: students have no course_tools/)."""
    output = cycle.output(f"nbgrader validate {NAME}/{NOTEBOOK}")
    result = [r for who, c, r in cycle.runs if c.startswith("nbgrader validate")][0]
    assert result.returncode != 0, output[-3000:]
    assert "integrity check rejects" in output, output[-3000:]
    assert "torch.nn.functional.scaled_dot_product_attention" in output, output[-3000:]
    assert "which this assignment forbids" in output, output[-3000:]


def check_released_feedback_is_where_each_students_fetch_feedback_looks(cycle):
    """``nbgrader fetch_feedback`` (not run here: one more nbgrader start) takes from the
    exchange's feedback/ the file named md5(submission secret + notebook id) of each
    submission in the student's cache: alice's and bob's are there, each their own."""
    outbound = cycle.exchange / "efficient-attention" / "feedback"
    for who in ("alice", "bob"):
        cached = list((cycle.homes[who] / ".local" / "share" / "jupyter" / "nbgrader_cache"
                       / "efficient-attention").glob(f"{who}+{NAME}+*/submission_secret.txt"))
        assert len(cached) == 1, cached
        key = hashlib.md5(cached[0].read_bytes() + NAME.encode()).hexdigest()
        assert (outbound / f"{key}.html").read_bytes() == (
            cycle.course / "feedback" / who / NAME / f"{NAME}.html").read_bytes(), who


# --- the grade command ------------------------------------------------------------------------

def _table(cycle, student: str) -> dict[str, str]:
    """``{grade id: what the grade command shows}`` for one student."""
    output = cycle.output(f"python -m course_tools.grade {NAME}")
    block = output.split(f"== {student} ==", 1)[1].split("\n==", 1)[0]
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^  (part\d+-\S+)\s+(.+)$", block, flags=re.M)}


EXPECTED_TABLES = {
    "alice": {"part1-scores-test": "1 / 1", "part2-argmax-test": "2 / 2",
              "part3-written": "needs manual grade", "part4-grads-test": "2 / 2",
              "part5-softmax-test": "2 / 2", "part6-written": "needs manual grade"},
    "bob": {"part1-scores-test": "1 / 1",
            "part2-argmax-test": "0 / 2  not attempted",
            "part3-written": "0 / 2  not attempted",
            "part4-grads-test": "0 / 2  not attempted",
            "part5-softmax-test": "0 / 2  not attempted",
            "part6-written": "0 / 1  not attempted"},
    # carol answered part 2, whose test also needs part 1: 0 points, but attempted
    "carol": {"part1-scores-test": "0 / 1  not attempted", "part2-argmax-test": "0 / 2",
              "part3-written": "0 / 2  not attempted", "part4-grads-test": "2 / 2",
              "part5-softmax-test": "0 / 2  not attempted",
              "part6-written": "0 / 1  not attempted"},
}


def check_grade_table_marks_parts_not_attempted(cycle):
    for student, expected in EXPECTED_TABLES.items():
        assert _table(cycle, student) == expected, (student, cycle.output(
            f"python -m course_tools.grade {NAME}")[-4000:])
        rows = [r for r in csv.DictReader((cycle.course / "grades" / f"{NAME}.csv").open())
                if r["student"] == student]
        assert {r["part"]: r["notes"].startswith("not attempted") for r in rows} == {
            part: shown.endswith("not attempted") for part, shown in expected.items()}, student


# --- feedback ---------------------------------------------------------------------------------

def check_release_feedback_refuses_a_partial_release_and_says_what_to_do(cycle):
    result = [r for _, c, r in cycle.runs if c == f"nbgrader release_feedback {NAME}"][0]
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    assert cycle.feedback_before == [] and cycle.feedback_refused == [], (
        "release_feedback released part of the class before stopping")
    assert "nothing was released" in output and "carol" in output, output
    for who in ("alice", "bob"):
        assert f"nbgrader release_feedback {NAME} --student={who}" in output, output
    carol_html = cycle.course / "feedback" / "carol" / NAME / f"{NAME}.html"
    assert carol_html.is_file() and str(carol_html) in output, output
    assert "--student=carol" not in output, output
    # then the per-student releases it printed put alice's and bob's feedback in the exchange
    released = sorted((cycle.exchange / "efficient-attention" / "feedback").glob("*.html"))
    assert len(released) == 2, released


def check_no_display_data_priority_warning(cycle):
    """nbconvert's HTML exporter configures display_data_priority, which nbgrader's
    preprocessors did not accept: generate_feedback printed the warning twice."""
    warned = [(who, command) for who, command, r in cycle.runs
              if "display_data_priority" in r.stdout + r.stderr]
    assert not warned, warned
    assert "HideHiddenTestOutputs" not in cycle.output(f"nbgrader generate_feedback {NAME}")


def check_export_writes_every_student(cycle):
    rows = list(csv.DictReader((cycle.course / "grades.csv").open()))
    assert sorted((r["student_id"], r["first_name"], float(r["score"])) for r in rows) == [
        ("alice", "Alice", 7.0), ("bob", "Bob", 1.0), ("carol", "Carol", 2.0)]


# --- private files: git-ignored, removed by make clean ----------------------------------------

def _written(cycle) -> list[str]:
    """Every file the cycle wrote, as its path in the repository (the course is assignments/,
    the exchange its default, assignments/exchange/)."""
    files = [f"assignments/{p.relative_to(cycle.course).as_posix()}"
             for p in cycle.course.rglob("*") if p.is_file()
             and p.relative_to(cycle.course).parts[0] not in INPUTS]
    files += [f"assignments/{p.relative_to(cycle.course).as_posix()}"
              for p in (cycle.course / "course_tools").rglob("*.pyc")]
    files += [f"assignments/exchange/{p.relative_to(cycle.exchange).as_posix()}"
              for p in cycle.exchange.rglob("*") if p.is_file()]
    return sorted(files)


def _not_ignored(paths: list[str]) -> list[str]:
    result = subprocess.run(["git", "check-ignore", "--stdin", "-v", "-n"], cwd=ROOT,
                            input="\n".join(paths) + "\n", capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    found = {}
    for line in result.stdout.splitlines():
        rule, _, path = line.partition("\t")
        found[path] = rule
    assert set(found) == set(paths), "git check-ignore did not answer for every path"
    return sorted(path for path, rule in found.items()
                  if rule.startswith("::") or rule.split(":", 2)[2].startswith("!"))


PRIVATE = ["assignments/grades.csv", "assignments/students.csv", "assignments/gradebook.db",
           "assignments/gradebook.db-journal", "assignments/.nbgrader.log",
           "assignments/grades/argmax_attention.csv",
           "assignments/submitted/jdoe/argmax_attention/argmax_attention.ipynb",
           "assignments/autograded/jdoe/argmax_attention/argmax_attention.ipynb",
           "assignments/feedback/jdoe/argmax_attention/argmax_attention.html",
           "assignments/downloaded/argmax_attention/archive/jdoe_argmax_attention.ipynb",
           "assignments/exchange/efficient-attention/inbound/jdoe+argmax_attention+t/x.ipynb",
           "assignments/grading_reports/argmax_attention/jdoe/argmax_attention.json"]


def test_private_files_are_ignored():
    assert _not_ignored(PRIVATE) == []
    # and the check can fail: committed course files are not ignored
    assert _not_ignored(["assignments/nbgrader_config.py", "assignments/rules/x.json"]) == [
        "assignments/nbgrader_config.py", "assignments/rules/x.json"]


def check_every_file_the_cycle_writes_is_ignored(cycle):
    written = _written(cycle)
    for expected in ("assignments/grades.csv", "assignments/gradebook.db",
                     f"assignments/grades/{NAME}.csv", "assignments/students.csv"):
        assert expected in written, (expected, written)
    assert any(p.startswith("assignments/exchange/") for p in written)
    assert _not_ignored(written) == []


def check_make_clean_removes_every_file_the_cycle_writes(cycle):
    """The Makefile's clean recipe, run in a copy that holds the cycle's course as
    assignments/ (and its exchange as assignments/exchange/), leaves only the course's own
    files (and Python's caches)."""
    tmp_path = cycle.tmp / "clean"
    tmp_path.mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copytree(cycle.course, tmp_path / "assignments")
    shutil.copytree(cycle.exchange, tmp_path / "assignments" / "exchange")
    result = subprocess.run(["make", "--no-print-directory", "clean"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    left = sorted(p.relative_to(tmp_path / "assignments").as_posix()
                  for p in (tmp_path / "assignments").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts
                  and p.relative_to(tmp_path / "assignments").parts[0] not in INPUTS)
    assert left == [], f"make clean leaves {left}"


# --- the one test that runs the cycle -----------------------------------------------------------

CHECKS = [check_every_command_of_the_cycle_is_written_in_the_readme,
          check_students_fetch_and_submit_through_the_exchange,
          check_student_validate_runs_the_integrity_check,
          check_grade_table_marks_parts_not_attempted,
          check_release_feedback_refuses_a_partial_release_and_says_what_to_do,
          check_released_feedback_is_where_each_students_fetch_feedback_looks,
          check_no_display_data_priority_warning,
          check_export_writes_every_student,
          check_every_file_the_cycle_writes_is_ignored,
          check_make_clean_removes_every_file_the_cycle_writes]


def test_instructor_cycle(tmp_path_factory):
    """The cycle, then every check on what it did, failures reported together. One test, not
    one per check: under ``make test`` (xdist, --dist loadgroup) the tests of a file go to
    different workers (tests/conftest.py), and each would run the cycle again."""
    cycle = run_cycle(tmp_path_factory.mktemp("cycle"))
    failures = []
    for check in CHECKS:
        try:
            check(cycle)
        except AssertionError as error:
            failures.append(f"{check.__name__}: {error}")
    assert not failures, "\n\n".join(failures)


# --- "not attempted", without nbgrader --------------------------------------------------------

def _notebook(path: Path, answers: dict[str, str]) -> Path:
    cells = [{"cell_type": "code" if not gid.endswith("written") else "markdown",
              "metadata": {"nbgrader": {"grade_id": gid, "solution": True}},
              "source": source, "outputs": []} for gid, source in answers.items()]
    cells.append({"cell_type": "code", "source": "print(1)", "outputs": [],
                  "metadata": {"nbgrader": {"grade_id": "part1-a-test", "grade": True}}})
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def test_not_attempted_compares_answer_cells_with_the_release(tmp_path):
    blank = "def f():\n    # YOUR CODE HERE\n    raise NotImplementedError()"
    release = _notebook(tmp_path / "release.ipynb", {
        "part1-a-solution": blank, "part2-b-solution": blank, "part2-c-solution": blank,
        "part3-written": "YOUR ANSWER HERE"})
    submitted = _notebook(tmp_path / "submitted.ipynb", {
        "part1-a-solution": blank + "\n",            # run, not edited: ends stripped
        "part2-b-solution": blank, "part2-c-solution": "def g():\n    return 1",
        "part3-written": "YOUR ANSWER HERE"})
    parts = {"part1-a-test": (0.0, 1.0, False), "part2-b-test": (0.0, 2.0, False),
             "part3-written": (0.0, 2.0, False)}
    assert grade.not_attempted(release, submitted, parts) == {1, 3}
    # a part that scored (its answer written in another cell) was attempted
    assert grade.not_attempted(release, submitted, dict(
        parts, **{"part1-a-test": (1.0, 1.0, False)})) == {3}
    # a corrupt submission: nothing to say
    (tmp_path / "corrupt.ipynb").write_text("not a notebook")
    assert grade.not_attempted(release, tmp_path / "corrupt.ipynb", parts) == set()
    # the table and the CSV say it
    record = {"student": "s", "graded": True, "parts": parts, "events": [], "reason": "",
              "not_attempted": {1, 3}}
    import io
    out = io.StringIO()
    grade.print_tables([record], out=out)
    assert re.search(r"part1-a-test\s+0 / 1  not attempted", out.getvalue())
    assert re.search(r"part2-b-test\s+0 / 2\n", out.getvalue())
    grade.write_csv([record], tmp_path / "g.csv")
    notes = {r["part"]: r["notes"] for r in csv.DictReader((tmp_path / "g.csv").open())}
    assert notes == {"part1-a-test": "not attempted", "part2-b-test": "",
                     "part3-written": "not attempted"}
