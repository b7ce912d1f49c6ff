"""Autograde every collected submission of an assignment and say what happened to each.

From the repository root: ``make grade ASSIGNMENT=argmax_attention``; from ``assignments/``::

    python -m course_tools.grade argmax_attention [--cpu-limit 30] [--wall-limit 120]

It checks that the sandbox of ``course_tools/sandbox.py`` can run (or says how to install
bubblewrap), runs ``nbgrader autograde <name> --force`` once for all students found under
``submitted/*/<name>/``, then prints one table per student: the score of every graded part
(autograded tests, and written answers once graded by hand), then what the course's steps
reported (``flagged`` by the integrity check, ``repaired`` cell metadata, a cell ``stopped``
with the reason, e.g. ``kernel killed: memory limit``, a sandbox ``limit`` reached) and
whether the notebook was graded at all. A part whose answer cells the student left exactly as
released (``raise NotImplementedError()``, "YOUR ANSWER HERE") and that scored nothing is
marked ``not attempted`` next to its score (and in the CSV's notes). Its first lines say how
the code runs: the sandbox, and the time limits (``course_tools/timekeeping.py``: CPU time
per cell, a wall-clock ceiling for a cell that waits, the ceilings past which the machine, not
the student, is at fault).
A submission nbgrader could not grade is listed as ``FAILED TO GRADE`` with the reason (the
course's, e.g. a machine too busy to run it twice, or nbgrader's), and its score is left
empty in the CSV, never 0;
so is one that holds a symbolic link, which is not graded at all (nbgrader would copy the
file it points to, read with your rights, into autograded/ and the feedback). The CSV (one
row per student and part) goes to ``grades/<name>.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

COURSE = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REPORTS = "grading_reports"


LIMIT_FLAGS = {
    "cpu-limit": "CPU seconds per cell",
    "wall-limit": "wall-clock seconds after which a waiting cell is stopped",
    "busy-limit": "wall-clock seconds a cell kept from running by a busy machine may take",
    "instructor-limit": "wall-clock seconds for the read-only cells before the first answer",
    "notebook-limit": "seconds of the student's time (CPU plus waiting) for a whole notebook",
}
LIMIT_TRAITS = {"cpu-limit": "cpu_limit_s", "wall-limit": "wall_limit_s",
                "busy-limit": "busy_limit_s", "instructor-limit": "instructor_limit_s",
                "notebook-limit": "notebook_limit_s"}


def time_limits(course: Path, overrides: dict):
    """The time limits autograde will apply: the course's config, then ``overrides``."""
    from traitlets.config.loader import PyFileConfigLoader

    from course_tools.execution import GuardedExecute

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    config.GuardedExecute.update(overrides)
    return GuardedExecute(config=config).limits()


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the gradebook calls `alembic`
    return env


def students_of(course: Path, name: str) -> list[str]:
    return sorted(p.parent.name for p in (course / "submitted").glob(f"*/{name}")
                  if p.is_dir())


def links_in(folder: Path) -> list[str]:
    """Symbolic links (and anything but files and folders) in a submitted folder. nbgrader
    copies a submitted link into autograded/, and from there into the feedback, as the file it
    points to, read with the grader's rights (say, the source notebook with its hidden tests),
    so such a submission is not graded."""
    found = []
    for root, dirs, files in os.walk(folder):
        for entry in dirs + files:
            path = os.path.join(root, entry)
            if os.path.islink(path) or not (os.path.isfile(path) or os.path.isdir(path)):
                found.append(os.path.relpath(path, folder))
    return sorted(found)


def _log_by_student(log: str, students: list[str]) -> dict[str, list[str]]:
    """nbgrader's error lines, attributed to the student whose notebook was being graded."""
    errors: dict[str, list[str]] = {s: [] for s in students}
    current = None
    for line in log.splitlines():
        found = re.search(r"(?:submitted|autograded)/([^/]+)/", line)
        if found and found.group(1) in errors:
            current = found.group(1)
        if current and re.search(r"\| (ERROR|CRITICAL)\]|Error:|Exception", line):
            errors[current].append(line.strip())
    return errors


def autograde(course: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "nbgrader"), "autograde", name, "--force", *extra],
        cwd=course, env=_env(), capture_output=True, text=True,
    )


def part_number(grade_id: str) -> int | None:
    """N of a grade id ``part<N>-...``; None for any other cell."""
    match = re.match(r"part(\d+)-", grade_id or "")
    return int(match.group(1)) if match else None


def answer_sources(path: Path) -> dict[str, list[str]] | None:
    """``{grade id: [source, ...]}`` of a notebook's answer cells (``solution: true``, code or
    written), each source stripped; None if the file is not a notebook."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    answers: dict[str, list[str]] = {}
    for cell in cells if isinstance(cells, list) else []:
        if not isinstance(cell, dict):
            continue
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        if isinstance(meta, dict) and meta.get("solution") and meta.get("grade_id"):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else str(source)
            answers.setdefault(str(meta["grade_id"]), []).append(source.strip())
    return answers


def not_attempted(release: Path, submitted: Path, parts: dict) -> set[int]:
    """Parts (numbers N of the grade ids ``part<N>-``) the student did not attempt: every
    answer cell of the part is exactly as released (``raise NotImplementedError()``, "YOUR
    ANSWER HERE"; compared by grade id, ends stripped; a deleted one counts as untouched) and
    no graded cell of the part scored a point (an answer written in a cell of one's own and
    passing its tests is an attempt). ``parts``: ``{grade id: (score, max, manual)}``."""
    released, answered = answer_sources(release), answer_sources(submitted)
    if not released or answered is None:
        return set()
    untouched: dict[int, bool] = {}
    for grade_id, (original, *_) in released.items():
        number = part_number(grade_id)
        if number is not None:
            same = all(source == original for source in answered.get(grade_id, []))
            untouched[number] = untouched.get(number, True) and same
    return {number for number, same in untouched.items() if same and all(
        not manual and not score for grade_id, (score, _, manual) in parts.items()
        if part_number(grade_id) == number)}


def collect(course: Path, name: str, students: list[str], log: str, started: float) -> list:
    """One record per student: status, scores per part, what the course's steps reported."""
    os.environ["PATH"] = _env()["PATH"]
    from nbgrader.api import Gradebook, MissingEntry

    errors = _log_by_student(log, students)
    records = []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        assignment = gradebook.find_assignment(name)
        notebooks = [nb.name for nb in assignment.notebooks]
        for student in students:
            events, parts, graded = [], {}, True
            for notebook in notebooks:
                report = course / REPORTS / name / student / f"{notebook}.json"
                if report.is_file():
                    events += json.loads(report.read_text())
                output = course / "autograded" / student / name / f"{notebook}.ipynb"
                if not output.is_file() or output.stat().st_mtime < started:
                    graded = False
                    continue
                try:
                    submission = gradebook.find_submission_notebook(notebook, name, student)
                except MissingEntry:
                    graded = False
                    continue
                for grade in submission.grades:
                    parts[grade.name] = (grade.score, grade.max_score, grade.needs_manual_grade)
            failures = [e["message"] for e in events if e["kind"] == "failed"]
            reason = ("; ".join(failures) or "; ".join(errors[student][-3:])
                      or "no autograded notebook was written")
            skipped = set()
            for notebook in notebooks if graded else []:
                skipped |= not_attempted(
                    course / "release" / name / f"{notebook}.ipynb",
                    course / "submitted" / student / name / f"{notebook}.ipynb", parts)
            records.append({"student": student, "graded": graded, "parts": parts,
                            "events": events, "reason": "" if graded else reason,
                            "not_attempted": skipped})
    return records


def _part_order(name: str) -> tuple:
    match = re.match(r"part(\d+)-", name)
    return (int(match.group(1)) if match else 0, name)


def print_tables(records: list, out=sys.stdout) -> None:
    for record in records:
        print(f"\n== {record['student']} ==", file=out)
        if not record["graded"]:
            print(f"  FAILED TO GRADE: {record['reason']}", file=out)
        else:
            total = maximum = 0.0
            for part in sorted(record["parts"], key=_part_order):
                score, max_score, manual = record["parts"][part]
                shown = "needs manual grade" if manual else f"{score:g} / {max_score:g}"
                if part_number(part) in record.get("not_attempted", ()):
                    shown += "  not attempted"
                print(f"  {part:<32} {shown}", file=out)
                total += score or 0
                maximum += max_score
            print(f"  {'total (so far)':<32} {total:g} / {maximum:g}", file=out)
        for event in record["events"]:
            print(f"  {event['kind']}: {event['message']}", file=out)


def write_csv(records: list, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["student", "status", "part", "score", "max_score", "notes"])
        for record in records:
            notes = " | ".join(f"{e['kind']}: {e['message']}" for e in record["events"])
            if not record["graded"]:
                writer.writerow([record["student"], "failed to grade", "", "", "",
                                 record["reason"] + (" | " + notes if notes else "")])
                continue
            status = "graded" + "".join(
                f", {kind}" for kind in ("flagged", "repaired", "stopped", "limit")
                if any(e["kind"] == kind for e in record["events"]))
            for part in sorted(record["parts"], key=_part_order):
                score, max_score, manual = record["parts"][part]
                note = "needs manual grade" if manual else notes
                if part_number(part) in record.get("not_attempted", ()):
                    note = "not attempted" + (" | " + note if note else "")
                writer.writerow([record["student"], status, part,
                                 "" if manual else f"{score:g}", f"{max_score:g}", note])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("assignment")
    parser.add_argument("--course", default=str(COURSE),
                        help="course folder (default: %(default)s)")
    for flag, what in LIMIT_FLAGS.items():
        parser.add_argument(f"--{flag}", type=float, help=f"{what} (default: the config's)")
    parser.add_argument("--csv", help="CSV path (default: <course>/grades/<assignment>.csv)")
    args = parser.parse_args(argv)
    course, name = Path(args.course).resolve(), args.assignment
    students = students_of(course, name)
    if not students:
        print(f"no submission under {course / 'submitted'}/*/{name}/", file=sys.stderr)
        return 2
    if not (course / "release" / name).is_dir():
        print(f"run `nbgrader generate_assignment {name}` first", file=sys.stderr)
        return 2
    from course_tools.sandbox import SandboxUnavailable, preflight

    try:
        sandbox = preflight(course)
    except SandboxUnavailable as error:
        print(f"cannot grade: {error}", file=sys.stderr)
        return 2
    overrides = {trait: value for flag, trait in LIMIT_TRAITS.items()
                 if (value := getattr(args, flag.replace("-", "_"))) is not None}
    print(sandbox.describe())
    print(time_limits(course, overrides).describe())
    reports = course / REPORTS / name
    for student in students:
        for stale in (reports / student).glob("*.json"):
            stale.unlink()
    extra = [f"--GuardedExecute.{trait}={value:g}" for trait, value in overrides.items()]
    refused = {s: links for s in students if (links := links_in(course / "submitted" / s / name))}
    if refused:
        extra.append(f"--CourseDirectory.student_id_exclude={','.join(refused)}")
    started = time.time() - 1
    result = autograde(course, name, extra) if len(refused) < len(students) else None
    log = result.stdout + result.stderr if result else ""
    records = collect(course, name, students, log, started)
    for record in records:
        if record["student"] in refused:
            record["reason"] = (
                f"the submission holds symbolic links ({', '.join(refused[record['student']])}):"
                " nbgrader would copy the files they point to, with your rights, into "
                "autograded/ and the feedback; remove them and rerun")
    print_tables(records)
    path = Path(args.csv) if args.csv else course / "grades" / f"{name}.csv"
    write_csv(records, path)
    failed = [r["student"] for r in records if not r["graded"]]
    print(f"\n{len(records) - len(failed)} of {len(records)} submission(s) graded; CSV: {path}")
    if failed:
        print(f"NOT GRADED: {', '.join(failed)} (see above; fix and rerun)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
