"""The project's address, licence and citation agree wherever they are written.

The repository URL is set once, as `repository.url` in _config.yml (where the book's repository,
issue and edit buttons read it). README.md, pyproject.toml ([project.urls]), CITATION.cff and
LICENSE repeat it, as does the book's footer; a change of address that misses one of them fails
here, naming the file. The licence declared in pyproject.toml must be the one LICENSE gives the
code, and the book's licence (CC BY 4.0) must be stated in LICENSE, the README and the footer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CITATION = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
LICENSE = (ROOT / "LICENSE").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
FOOTER = CONFIG.get("html", {}).get("extra_footer", "")

# How LICENSE names the licence of each SPDX identifier pyproject.toml may declare for the code.
LICENCE_TEXTS = {
    "MIT": ("MIT License", "Permission is hereby granted, free of charge"),
    "Apache-2.0": ("Apache License", "Version 2.0"),
    "BSD-3-Clause": ("BSD 3-Clause License", "Redistribution and use in source and binary"),
}
BOOK_LICENCE = ("CC BY 4.0", "https://creativecommons.org/licenses/by/4.0/")
GITHUB_URL = re.compile(r"https?://github\.com/[^\s)>\"'`\]<]+")


def repository() -> str:
    """The single source: `repository.url` of _config.yml."""
    url = CONFIG.get("repository", {}).get("url", "")
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), (
        f"_config.yml repository.url must be https://github.com/<owner>/<name>, got {url!r}")
    return url


def branch() -> str:
    return CONFIG["repository"].get("branch", "main")


def test_the_book_buttons_read_the_repository_setting():
    html = CONFIG["html"]
    for button in ("use_repository_button", "use_issues_button", "use_edit_page_button"):
        assert html.get(button) is True, f"_config.yml html.{button} should be true"
    assert CONFIG["repository"].get("path_to_book", "") == "", (
        "the book's root is the repository's root: path_to_book must be empty, or the edit "
        "button points to a missing file")


@pytest.mark.parametrize("name, text", [("README.md", README), ("LICENSE", LICENSE),
                                        ("_config.yml html.extra_footer", FOOTER)])
def test_every_github_link_is_the_repository(name, text):
    url = repository()
    links = GITHUB_URL.findall(text)
    if name != "_config.yml html.extra_footer":
        assert url in links, f"{name} does not give the repository's address {url}"
    stray = [link for link in links if link != url and not link.startswith(url + "/")]
    assert not stray, f"{name} links to another repository than _config.yml's {url}: {stray}"


def test_pyproject_urls_are_the_repository():
    url = repository()
    urls = PYPROJECT["project"].get("urls", {})
    assert urls.get("Repository") == url and urls.get("Homepage") == url, urls
    assert urls.get("Issues") == f"{url}/issues", urls
    stray = {key: value for key, value in urls.items()
             if value != url and not value.startswith(url + "/")}
    assert not stray, f"pyproject.toml [project.urls] outside {url}: {stray}"


def test_citation_points_to_the_repository_and_the_release():
    url = repository()
    for key in ("cff-version", "message", "title", "authors"):  # required by CFF 1.2.0
        assert CITATION.get(key), f"CITATION.cff has no {key}"
    assert CITATION["repository-code"] == url, CITATION["repository-code"]
    assert CITATION.get("url", url) == url, CITATION["url"]
    assert str(CITATION["version"]) == PYPROJECT["project"]["version"], (
        "CITATION.cff and pyproject.toml give different versions")


def test_the_code_licence_of_pyproject_is_the_one_in_license():
    declared = PYPROJECT["project"]["license"]
    assert isinstance(declared, str), f"pyproject.toml license should be an SPDX id: {declared}"
    assert declared in LICENCE_TEXTS, f"add how LICENSE names {declared!r} to LICENCE_TEXTS"
    for phrase in LICENCE_TEXTS[declared]:
        assert phrase in LICENSE, f"pyproject.toml says {declared}, LICENSE lacks {phrase!r}"
    others = [spdx for spdx, (title, _) in LICENCE_TEXTS.items()
              if spdx != declared and title in LICENSE]
    assert not others, f"LICENSE carries the text of {others}, pyproject.toml says {declared}"
    assert "LICENSE" in PYPROJECT["project"].get("license-files", []), (
        "pyproject.toml license-files should ship LICENSE with the package")
    assert declared in FOOTER or LICENCE_TEXTS[declared][0] in FOOTER, FOOTER


@pytest.mark.parametrize("name, text", [("LICENSE", LICENSE), ("README.md", README),
                                        ("_config.yml html.extra_footer", FOOTER)])
def test_the_book_licence_is_stated(name, text):
    for phrase in BOOK_LICENCE:
        assert phrase in text, f"{name} does not state the book's licence ({phrase!r})"


def test_the_footer_links_license_and_citation_on_the_branch():
    url, main = repository(), branch()
    for file in ("LICENSE", "CITATION.cff"):
        assert (ROOT / file).is_file(), f"{file} is missing"
        assert f"{url}/blob/{main}/{file}" in FOOTER, f"the footer does not link {file}"
