"""book/_launch_buttons.py (the Pages workflow's Colab and Binder buttons) and
binder/requirements.txt: the buttons are off in the committed configuration, turning them on
changes only their URLs, and Binder installs the library by the line of the chapters' install
notes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book"))

import _launch_buttons  # noqa: E402

CONFIG_TEXT = (ROOT / "_config.yml").read_text(encoding="utf-8")
CONFIG = yaml.safe_load(CONFIG_TEXT)
REPOSITORY = CONFIG["repository"]["url"]


def test_the_committed_book_has_no_launch_buttons():
    buttons = CONFIG["launch_buttons"]
    assert buttons["colab_url"] == "" and buttons["binderhub_url"] == ""


@pytest.mark.parametrize("services", [["colab"], ["binder"], ["colab", "binder"]])
def test_turning_buttons_on_sets_only_their_urls(tmp_path, services):
    config = tmp_path / "_config.yml"
    config.write_text(CONFIG_TEXT)
    assert _launch_buttons.main([*services, "--config", str(config)]) == 0
    changed = yaml.safe_load(config.read_text())
    expected = {key: "" for key, _ in _launch_buttons.URLS.values()}
    expected |= {_launch_buttons.URLS[s][0]: _launch_buttons.URLS[s][1] for s in services}
    for key, url in expected.items():
        assert changed["launch_buttons"][key] == url
    for key in CONFIG:
        if key != "launch_buttons":
            assert changed[key] == CONFIG[key], key
    assert changed["repository"]["url"] == REPOSITORY  # where the buttons open the chapters


def test_a_missing_setting_is_a_clear_error(tmp_path):
    config = tmp_path / "_config.yml"
    config.write_text(CONFIG_TEXT.replace("colab_url", "colab_address"))
    with pytest.raises(SystemExit, match="launch_buttons.colab_url"):
        _launch_buttons.main(["colab", "--config", str(config)])


def test_the_workflow_runs_it_before_building_the_book():
    workflow = (ROOT / ".github/workflows/pages.yml").read_text()
    launch = workflow.find("python3 book/_launch_buttons.py ${{ vars.LAUNCH_BUTTONS }}")
    assert 0 < launch < workflow.find("run: make book")


def test_binder_installs_the_library_by_the_install_notes_line():
    lines = [line.strip() for line in (ROOT / "binder/requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert f"git+{REPOSITORY}" in lines
    note = (ROOT / "book/attention.ipynb").read_text()
    assert f"pip install git+{REPOSITORY}" in note  # the chapters' note (test_chapter_prose)
    student = (ROOT / "assignments/student-requirements.txt").read_text()
    pin = re.search(r"^torch==\S+$", student, flags=re.MULTILINE).group(0)
    assert pin in lines, "Binder's torch must be the course's pinned one"
