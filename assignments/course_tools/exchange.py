"""``nbgrader release_feedback`` that stops, before releasing anything, at a submission that
did not come through the exchange.

nbgrader's own release_feedback walks ``feedback/*/<assignment>/`` and, for each student,
names the released file after the secret that ``nbgrader submit`` wrote beside the
submission (``submission_secret.txt``, with ``timestamp.txt``); a student's ``fetch_feedback``
finds it by that secret. A submission collected with ``zip_collect`` or copied into
``submitted/`` by hand has no such secret, so nbgrader stops there with a traceback
(``FileNotFoundError: .../timestamp.txt``), after releasing the feedback of the students
before it and none of those after. No release can reach such a student anyway: they never
submitted through the exchange. ``CourseReleaseFeedback`` (configured in
``nbgrader_config.py`` as ``c.ExchangeFactory.release_feedback``, so the formgrader's button
uses it too) checks every feedback folder first; if any lacks the secret it releases nothing,
names those students and their HTML files (to send by hand), gives the command that
releases the feedback of the others one student at a time, and fails (exit status 1).
"""

from __future__ import annotations

import glob
import os
import re

from nbgrader.exchange.default import ExchangeReleaseFeedback

# What `nbgrader submit` writes beside a submission, and release_feedback reads.
EXCHANGE_FILES = ("timestamp.txt", "submission_secret.txt")


class CourseReleaseFeedback(ExchangeReleaseFeedback):
    """release_feedback that refuses, with instructions, to release a partial set."""

    def feedback_folders(self) -> dict[str, list[str]]:
        """``{student: [HTML files]}`` that this release covers (``--student`` and
        ``--CourseDirectory.student_id_exclude`` respected), as nbgrader's own walk finds them."""
        excluded = set(filter(None, (self.coursedir.student_id_exclude or "").split(",")))
        pattern = re.escape(os.path.sep).join([
            self.coursedir.format_path(self.coursedir.feedback_directory, "(?P<student_id>.*)",
                                       self.coursedir.assignment_id, escape=True),
            "(?P<notebook_id>.*).html"])
        found: dict[str, list[str]] = {}
        for html in sorted(glob.glob(os.path.join(self.src_path, "*.html"))):
            match = re.match(pattern, html)
            if match and match.group("student_id") not in excluded:
                found.setdefault(match.group("student_id"), []).append(html)
        return found

    def copy_files(self):
        folders = self.feedback_folders()
        outside = {student: files for student, files in folders.items()
                   if not all(os.path.isfile(os.path.join(os.path.dirname(files[0]), name))
                              for name in EXCHANGE_FILES)}
        if outside:
            self.fail(self.instructions(sorted(outside), outside, sorted(set(folders) - set(
                outside))))
        super().copy_files()

    def instructions(self, students: list[str], files: dict[str, list[str]],
                     others: list[str]) -> str:
        name = self.coursedir.assignment_id
        them = "these students" if len(students) > 1 else "this student"
        lines = [
            f"nothing was released: the submission of {', '.join(students)} to {name} did not "
            "come through the exchange (zip_collect, or copied into submitted/ by hand: no "
            f"submission_secret.txt beside it), so no release can reach {them}."]
        if others:
            lines += ["Release the feedback of the others one student at a time:"]
            lines += [f"  nbgrader release_feedback {name} --student={s}" for s in others]
            lines += ["(or all of them at once: nbgrader release_feedback "
                      f"{name} --CourseDirectory.student_id_exclude={','.join(students)})"]
        lines += [f"Send {them} the feedback file yourself (e-mail, your LMS):"]
        lines += [f"  {s}: {html}" for s in students for html in files[s]]
        return "\n".join(lines)
