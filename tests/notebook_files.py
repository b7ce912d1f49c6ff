"""Helpers shared by the tests that read the book's notebooks as JSON (tests/test_book.py,
tests/test_chapter_prose.py)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def relative(path: Path) -> str:
    """``path`` relative to the repository root, as the tests name files."""
    return str(path.relative_to(ROOT))


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def cell_source(cell: dict) -> str:
    """A cell's source as one string (nbformat stores it as a string or a list of lines)."""
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source
