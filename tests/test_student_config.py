"""The students' nbgrader_config.py that assignments/release_for_book.py ships with the book.

It must work with ``check_notebook.py`` beside it and nothing else of the course (students have
no ``course_tools/``): the course id, the exchange folder from ``NBGRADER_EXCHANGE`` (with a
default), validation's time limit of the course's config, and the integrity check in
nbgrader's *Validate*. Each case loads it in a fresh interpreter, from a folder that holds
only those files, as nbgrader does (traitlets' PyFileConfigLoader). The end-to-end use
(fetch, validate, submit through an exchange) is in tests/test_instructor_cycle.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "assignments"
NAME = "argmax_attention"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release_for_book = _load("release_for_book_student", COURSE / "release_for_book.py")

# Loads ./nbgrader_config.py as nbgrader does and reports what it set; then calls its
# Execute.on_notebook_start hook on the notebook named in argv[1] under `nbgrader validate`
# (NBGRADER_EXECUTION=validate) and outside it.
PROBE = r"""
import json, os, sys
from traitlets.config.loader import PyFileConfigLoader

config = PyFileConfigLoader("nbgrader_config.py", path=os.getcwd()).load_config()
hook = config.Execute.on_notebook_start
nb = json.load(open(sys.argv[1]))
report = {
    "course_id": config.CourseDirectory.course_id,
    "exchange": config.Exchange.root,
    "timeout": config.Execute.timeout,
    "hook_module": getattr(hook, "__module__", None),
    "course_tools_loaded": any(m.startswith("course_tools") for m in sys.modules),
}
os.environ.pop("NBGRADER_EXECUTION", None)
report["outside_validate"] = repr(hook(notebook=nb))
os.environ["NBGRADER_EXECUTION"] = "validate"
try:
    hook(notebook=nb)
    report["validate"] = "passed"
except Exception as error:
    report["validate"] = f"{type(error).__name__}: {error}"
print(json.dumps(report))
"""


def _folder(tmp_path: Path, checker: bool = True) -> Path:
    folder = tmp_path / "student"
    folder.mkdir()
    release_for_book.write_student_config(folder / "nbgrader_config.py")
    if checker:
        release_for_book.write_checker(folder / "check_notebook.py")
    return folder


def _notebook(tmp_path: Path, extra_code: str | None = None) -> Path:
    nb = json.loads((COURSE / "source" / NAME / f"{NAME}.ipynb").read_text())
    if extra_code:
        nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [],
                            "execution_count": None, "source": extra_code})
    path = tmp_path / f"{NAME}.ipynb"
    path.write_text(json.dumps(nb))
    return path


def _probe(folder: Path, notebook: Path, exchange: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NBGRADER", "JUPYTER")) and k != "PYTHONPATH"}
    if exchange:
        env["NBGRADER_EXCHANGE"] = exchange
    result = subprocess.run([sys.executable, "-c", PROBE, str(notebook)], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


CHEAT = ("def fast(q, k, v):\n"
         "    return torch.nn.functional.scaled_dot_product_attention(q, k, v)")


def test_student_config_alone_sets_course_exchange_and_the_integrity_check(tmp_path):
    folder = _folder(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["check_notebook.py", "nbgrader_config.py"]
    report = _probe(folder, _notebook(tmp_path, CHEAT), "/scratch/exchange")
    assert report["course_id"] == "efficient-attention"
    assert report["exchange"] == "/scratch/exchange"
    assert report["timeout"] == release_for_book.shared_settings()[("Execute", "timeout")]
    assert report["hook_module"] == "check_notebook"
    assert not report["course_tools_loaded"]
    assert report["outside_validate"] == "None"  # autograde and plain runs: not its business
    assert report["validate"].startswith("IntegrityError: the integrity check rejects"), report
    assert "torch.nn.functional.scaled_dot_product_attention" in report["validate"]


def test_student_config_passes_an_honest_notebook_and_has_a_default_exchange(tmp_path):
    report = _probe(_folder(tmp_path), _notebook(tmp_path), None)
    assert report["validate"] == "passed", report
    assert report["exchange"] == release_for_book.STUDENT_EXCHANGE == "/srv/nbgrader/exchange"


def test_student_config_without_the_checker_says_so_when_validating(tmp_path):
    report = _probe(_folder(tmp_path, checker=False), _notebook(tmp_path), "/x")
    assert report["course_id"] == "efficient-attention"  # fetch and submit still work
    assert report["outside_validate"] == "None"
    assert report["validate"].startswith("FileNotFoundError"), report
    assert "check_notebook.py is missing" in report["validate"]


def test_shared_settings_come_from_the_course_config(tmp_path):
    settings = release_for_book.shared_settings()
    assert settings[("CourseDirectory", "course_id")] == "efficient-attention"
    text = (COURSE / "nbgrader_config.py").read_text()
    assert f"c.Execute.timeout = {settings[('Execute', 'timeout')]}" in text
    stripped = tmp_path / "nbgrader_config.py"
    stripped.write_text(re.sub(r"^c\.Execute\.timeout = .*$", "", text, flags=re.M))
    with pytest.raises(AssertionError, match="Execute.timeout"):
        release_for_book.shared_settings(stripped)


def test_release_for_book_ships_and_lists_the_student_config(tmp_path, monkeypatch):
    """main() with the nbgrader step replaced by a copy of the source (the releases are not
    what is tested here): every file list.md links exists, the config among them."""
    def fake_releases(scratch: Path) -> None:
        release = scratch / "release" / NAME
        release.mkdir(parents=True)
        release.joinpath(f"{NAME}.ipynb").write_bytes(
            (COURSE / "source" / NAME / f"{NAME}.ipynb").read_bytes())

    out = tmp_path / "downloads"
    monkeypatch.setattr(release_for_book, "OUT", out)
    monkeypatch.setattr(release_for_book, "assignment_names", lambda: [NAME])
    monkeypatch.setattr(release_for_book, "generate_releases", fake_releases)
    assert release_for_book.main([]) == 0
    listing = (out / "list.md").read_text()
    links = re.findall(r"</book/_downloads/assignments/([^>]+)>", listing)
    assert "nbgrader_config.py" in links and "check_notebook.py" in links, listing
    assert [link for link in links if not (out / link).is_file()] == []
    release_for_book.write_student_config(tmp_path / "expected.py")
    assert (out / "nbgrader_config.py").read_text() == (tmp_path / "expected.py").read_text()
    assert f"`{NAME}`: may import" in (out / "rules.md").read_text()
