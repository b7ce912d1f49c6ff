"""The built site, in a real browser, with no network.

Playwright drives Debian's chromium (never `playwright install` on the course machines; the
environment variable CHROMIUM_PATH names another Chromium, as the GitHub workflow does) over
`_build/html`, served by a local http.server on 127.0.0.1. Any request to another host is
aborted and counted as a failure: the book must work offline. For the index and every page of
_toc.yml we check that the page loads, that math is typeset by the offline MathJax, that every
image has loaded, that no request fails, that the console shows no errors, that chapter
pages offer their notebook, and that the buttons of every page's header (repository, issue,
edit, download, print) point where they should.

Every page must also read cleanly (`test_page_reads_cleanly`). These rules hold for every page of
_toc.yml, whoever wrote it:

1. No raw LaTeX. After MathJax has typeset the page, no text outside rendered maths
   (`mjx-container`) and outside code (`pre`, `code`) may contain `$`, `\\(`, `\\)`, `\\[`, `\\]`
   or a TeX command such as `\\lVert`, `\\frac`, `\\mathcal` (a backslash followed by letters).
   Typical causes: inline maths split over source lines where a line starts with `- ` or `+ `
   (Markdown reads a list item), maths in a BibTeX title (pybtex prints it verbatim), a `$`
   in prose. A literal dollar belongs in code (backticks).
2. No warning or traceback in any output. A cell output may not be a stderr stream (myst-nb
   renders it with the class `stderr`) or an error (`traceback`), and its text may not contain
   `Traceback` or a word ending in `Warning` (`UserWarning`, `Warning:` ...).
3. Figure code is folded. Every code cell whose output contains an image carries the cell tag
   `hide-input`: its source sits in a closed `<details>` ("Show code cell source"), and the figure
   shows. Computation that teaches belongs in a visible cell of its own before the figure cell.
4. Figures say what they show. Every image of the page's content (`<img>` in the article, an
   `<svg>` in a cell output or a figure) has alt text (for an inline `<svg>`: `aria-label` or a
   `<title>`) of a few words that is not a file path (docutils falls back to the image's path;
   a chapter gives the text in the cell metadata `mystnb.image.alt`).
5. Code fits its block, on chapter pages (pages with notebook cells). No visible code block of
   the content (highlighted `pre` outside cell outputs) is wider than its box (`scrollWidth <=
   clientWidth`) at the viewport of these tests, 1280 x 720 px (the width
   tests/test_chapter_prose.py sizes the chapters' code for). Folded code (inside a closed
   `<details>`, as `hide-input` cells are) is not checked: it may be wider, and a reader who
   opens it scrolls.

`test_page_checks_catch_what_they_should` runs the same checks on a small synthetic page, so a
check that silently stopped finding anything would fail there.

The first test, `test_book_builds`, runs `make book` (seconds when nothing changed), so the
pages checked are those of the current sources. A missing chromium is installed by the
`browser` fixture when it can (as root, .ci/ensure-packages); otherwise it, like a failed
build, is a failure with the command to run, never a skip.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urljoin, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# The built site; BOOK_HTML points elsewhere (e.g. a scratch build made with --path-output).
SITE = Path(os.environ.get("BOOK_HTML", ROOT / "_build" / "html"))
CHROMIUM = Path(os.environ.get("CHROMIUM_PATH") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
LOCAL_HOST = "127.0.0.1"
# Every page is loaded in a window of this size (Playwright's default, stated so that rule 5 of
# the page checks does not depend on it): at 1280 px a code block holds 77 characters of the
# book's monospace font, so the chapters' code is formatted at 76 (tests/test_chapter_prose.py).
VIEWPORT = {"width": 1280, "height": 720}
TIMEOUT_MS = 30_000
# How long a page may keep requests in flight after its load event (generous: on a busy 2-core
# machine MathJax fetches its fonts slowly while the other test workers run notebooks).
SETTLE_TIMEOUT_MS = 4 * TIMEOUT_MS

# Console errors that are not the book's fault, each with the reason it is harmless. Matched as
# substrings of the message text. Keep this list short and explained.
HARMLESS_CONSOLE_ERRORS: dict[str, str] = {
    "Identifier 'THEBE_JS_URL' has already been declared": (
        "Sphinx 7.4 writes inline scripts registered after the builder starts twice (once with "
        "filename None, once with ''), so sphinx-thebe's `const THEBE_JS_URL = ...` line appears "
        "twice and the second copy fails. The first copy already defined the same values, and "
        "thebe (live code) is disabled in this book."
    ),
}


def _toc_entries() -> list[str]:
    """Root and files of _toc.yml, in order, as written there (without suffix)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    entries = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("file"), str):
                entries.append(node["file"])
            for key, value in node.items():
                if key != "file":
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk({key: value for key, value in toc.items() if key != "root"})
    return [str(Path(entry).with_suffix("")) for entry in entries]


def _is_notebook(entry: str) -> bool:
    return (ROOT / f"{entry}.ipynb").is_file()


PAGES = ["index"] + _toc_entries()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the signature of the base class
        pass


class _SiteServer(ThreadingHTTPServer):
    """The built site on 127.0.0.1. A long listen queue: socketserver's default of 5 pending
    connections overflows when Chromium opens several at once on a busy machine, and Linux then
    drops the connection attempt, which Chromium retries only after 1, 2, 4, 8 ... seconds."""

    request_queue_size = 128
    daemon_threads = True


BOOK_BUILD_TIMEOUT_S = 1800


def test_book_builds():
    """``make book`` succeeds: the releases, every chapter executed without an error (or taken
    from the execution cache, which book/_execution_cache.py empties when the library or the
    committed results change) and a Sphinx build with warnings as errors. It runs first in this
    module, whose other tests check the site it writes; in ``make test`` it runs on one worker
    while the others grade. With BOOK_HTML naming a site built elsewhere, that site is checked
    as it is: it must exist."""
    if "BOOK_HTML" in os.environ:
        assert (SITE / "index.html").is_file(), f"BOOK_HTML={SITE} holds no built book"
        return
    try:
        done = subprocess.run(["make", "-C", str(ROOT), "book"], capture_output=True, text=True,
                              timeout=BOOK_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"make book ran past {BOOK_BUILD_TIMEOUT_S} s:\n{(error.stdout or '')[-4000:]}")
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"make book failed (exit {done.returncode}):\n{log[-6000:]}"
    assert (SITE / "index.html").is_file(), f"make book wrote no index.html:\n{log[-2000:]}"


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"{SITE / 'index.html'} is missing: the book did not build (see "
                    "test_book_builds, or run `make book`)")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = _SiteServer((LOCAL_HOST, 0), handler)  # port 0: any free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOCAL_HOST}:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def _ensure_chromium() -> None:
    """Install Debian's chromium when CHROMIUM_PATH is missing (as root, through
    .ci/ensure-packages, which tells anyone else the one command to run). Done here, by the
    worker that runs these tests, so that in ``make test`` the install overlaps the other
    tests instead of delaying them all."""
    if CHROMIUM.is_file():
        return
    result = subprocess.run([str(ROOT / ".ci" / "ensure-packages"), "chromium", str(CHROMIUM)],
                            capture_output=True, text=True)
    if result.returncode != 0 or not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} is missing and could not be installed:\n{result.stderr.strip()}\n"
            "(or set CHROMIUM_PATH to another Chromium)"
        )


@pytest.fixture(scope="module")
def browser():
    _ensure_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


class PageVisit:
    """Loads one page with every request outside 127.0.0.1 blocked, and records problems."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport=VIEWPORT)
        self.external: list[str] = []
        self.failed: list[str] = []
        self.console_errors: list[str] = []
        self.pending: dict[object, str] = {}  # requests sent and not yet finished or failed
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.page.on("request", self._request)
        self.page.on("requestfinished", self._request_done)
        self.page.on("requestfailed", self._request_failed)
        self.page.on("response", self._response)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self._error(f"uncaught: {error}"))
        self.response = self.page.goto(url, wait_until="load")

    def settle(self, timeout_ms: int = SETTLE_TIMEOUT_MS) -> None:
        """Wait until no request of the page is in flight, then half a second more with none.

        Playwright's "networkidle" waits for the same thing but, when it times out, does not say
        which request never finished; here the failure names them."""
        deadline = time.monotonic() + timeout_ms / 1000
        quiet_since = None
        while True:
            now = time.monotonic()
            if self.pending:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= 0.5:
                return
            if now > deadline:
                pytest.fail(f"{self.page.url}: requests still in flight after "
                            f"{timeout_ms / 1000:.0f} s: {sorted(self.pending.values())}")
            self.page.wait_for_timeout(50)  # lets Playwright deliver the request events

    def _request(self, request):
        self.pending[request] = request.url

    def _request_done(self, request):
        self.pending.pop(request, None)

    def _route(self, route):
        url = route.request.url
        if urlparse(url).scheme in ("data", "blob") or urlparse(url).hostname == LOCAL_HOST:
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def _request_failed(self, request):
        self._request_done(request)
        if request.url not in self.external:  # aborted external requests are reported apart
            self.failed.append(f"{request.url}: {request.failure}")

    def _response(self, response):
        if response.status >= 400:
            self.failed.append(f"{response.url}: HTTP {response.status}")

    def _console(self, message):
        if message.type == "error":
            self._error(message.text)

    def _error(self, text: str):
        if not any(pattern in text for pattern in HARMLESS_CONSOLE_ERRORS):
            self.console_errors.append(text)

    def close(self):
        self.context.close()


@pytest.fixture(scope="module")
def loaded(browser, site_url):
    """``load(path)``: the page, shared by the tests of that page (one load and one MathJax
    typesetting per page, not one per test). One page is open at a time: tests/conftest.py runs
    the tests of this module page by page (``page_major``), and a page is closed when the next
    is loaded."""
    current: dict[str, PageVisit] = {}

    def load(path: str) -> PageVisit:
        if path not in current:
            for page_visit in current.values():
                page_visit.close()
            current.clear()
            current[path] = PageVisit(browser, urljoin(site_url, path))
        return current[path]

    yield load
    for page_visit in current.values():
        page_visit.close()


def _html_path(entry: str) -> str:
    return "index.html" if entry == "index" else f"{entry}.html"


@pytest.mark.parametrize("entry", PAGES)
def test_page_works_offline(loaded, site_url, entry):
    path = _html_path(entry)
    assert (SITE / path).is_file(), f"{path} was not built (is it in _toc.yml?)"
    v = loaded(path)
    page = v.page
    assert v.response is not None and v.response.ok, f"{path}: {v.response and v.response.status}"
    v.settle()
    if entry == "index":  # the index redirects to the root page of the toc
        root = _toc_entries()[0]
        page.wait_for_url(f"**/{root}.html")

    # Math: every math element Sphinx wrote must be typeset by MathJax, without TeX errors.
    num_math = page.locator(".math").count()
    if num_math:
        page.wait_for_function(
            "n => document.querySelectorAll('mjx-container').length >= n", arg=num_math
        )
        tex_errors = page.locator("mjx-merror").all_text_contents()
        assert not tex_errors, f"{path}: MathJax could not typeset: {tex_errors[:5]}"

    # Images: every <img> has loaded.
    page.wait_for_function("Array.from(document.images).every(img => img.complete)")
    broken = page.evaluate(
        "Array.from(document.images).filter(img => img.naturalWidth === 0).map(img => img.src)"
    )
    assert not broken, f"{path}: images that did not load: {broken}"

    assert not v.external, f"{path} requested outside hosts (must work offline): {v.external}"
    assert not v.failed, f"{path}: failed requests: {v.failed}"
    assert not v.console_errors, f"{path}: console errors: {v.console_errors}"


def test_settle_names_a_request_that_never_finishes(browser, site_url):
    """The wait for a quiet network fails, naming the request, when one never finishes."""
    visit = PageVisit(browser, urljoin(site_url, "index.html"))
    try:
        visit.settle()
        held = []  # the route of the request, never continued: the request stays in flight
        visit.context.route("**/never-answered", lambda route: held.append(route))
        visit.page.evaluate("() => { fetch('/never-answered'); }")
        with pytest.raises(pytest.fail.Exception, match="never-answered"):
            visit.settle(timeout_ms=1500)
        assert held, "the request was not sent"
    finally:
        visit.close()


def test_browser_tests_run_page_by_page(request):
    """tests/conftest.py orders this module's tests page by page (one page open at a time)."""
    entries = [item.callspec.params["entry"] for item in request.session.items
               if item.nodeid.startswith("tests/test_browser.py")
               and "entry" in getattr(getattr(item, "callspec", None), "params", {})]
    runs = [entry for index, entry in enumerate(entries)
            if index == 0 or entries[index - 1] != entry]
    assert len(runs) == len(set(runs)), f"a page's tests are split: {runs}"


@pytest.mark.parametrize("entry", [e for e in PAGES[1:] if _is_notebook(e)])
def test_chapter_offers_its_notebook(loaded, site_url, entry):
    path = _html_path(entry)
    v = loaded(path)
    links = v.page.locator("a[href$='.ipynb']")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    name = f"{Path(entry).name}.ipynb"
    # The page's own download (on this site), not the edit button's link to the repository.
    own = [href for href in hrefs if href.split("/")[-1] == name and not urlparse(href).netloc]
    assert own, f"{path} offers no download of {name}; .ipynb links found: {hrefs}"
    for href in own:
        url = urljoin(urljoin(site_url, path), href)
        on_disk = SITE / urlparse(url).path.lstrip("/")
        assert on_disk.is_file(), f"{path}: download link {href} -> missing {on_disk}"
        response = v.context.request.get(url)
        assert response.ok, f"{path}: download link {href} answered HTTP {response.status}"
        notebook = json.loads(response.body())
        assert notebook.get("cells"), f"{path}: {href} is not a notebook"
    assert not v.external, f"{path} requested outside hosts: {v.external}"


def _repository() -> tuple[str, str, str]:
    """The repository's URL, branch and path to the book, as _config.yml gives them."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["repository"]
    path = (config.get("path_to_book") or "").strip("/")
    return config["url"].rstrip("/"), config.get("branch") or "main", path + "/" if path else ""


def _source_file(entry: str) -> Path:
    """The source of a page of _toc.yml: its notebook, else its Markdown file."""
    for suffix in (".ipynb", ".md"):
        if (ROOT / f"{entry}{suffix}").is_file():
            return ROOT / f"{entry}{suffix}"
    raise AssertionError(f"{entry} has no .ipynb or .md source")


# The header's menus (sphinx-book-theme), by the class of their dropdown, and the class of every
# item they may hold. An item of another kind fails the test below: check it there first.
HEADER_MENUS = {
    "dropdown-source-buttons": ("btn-source-repository-button", "btn-source-edit-button",
                                "btn-source-issues-button"),
    "dropdown-download-buttons": ("btn-download-source-button", "btn-download-pdf-button"),
}


@pytest.mark.parametrize("entry", PAGES[1:])
def test_header_links_point_where_they_should(loaded, site_url, entry):
    """Every button of the page's header is there and points where it should: the repository
    and the issue form to _config.yml's repository (off-site: the href is checked, nothing is
    fetched), the edit button to the page's source on its branch (a file of this repository),
    the download button to the page's own source on this site (fetched: HTTP 200, the bytes of
    the source), and the download menu's .pdf to the browser's printing, with the book's print
    style sheet (book/_static/css/print.css, also fetched)."""
    path = _html_path(entry)
    v = loaded(path)
    page = v.page
    page_url = urljoin(site_url, path)
    url, branch, path_to_book = _repository()
    source = _source_file(entry)

    items: dict[str, object] = {}
    for menu, kinds in HEADER_MENUS.items():
        dropdown = page.locator(f".article-header-buttons .{menu}")
        assert dropdown.count() == 1, f"{path}: no header menu {menu}"
        dropdown.locator("button.dropdown-toggle").click()  # Bootstrap opens the menu
        entries = dropdown.locator(".dropdown-menu > li > *")
        entries.first.wait_for(state="visible")
        for index in range(entries.count()):
            element = entries.nth(index)
            classes = (element.get_attribute("class") or "").split()
            kind = next((k for k in kinds if k in classes), None)
            assert kind, f"{path}: unknown item in {menu}: {element.evaluate('e => e.outerHTML')}"
            assert kind not in items, f"{path}: {kind} appears twice"
            assert element.is_visible(), f"{path}: {kind} is not shown when {menu} is open"
            items[kind] = element
        page.keyboard.press("Escape")  # closes the menu
    missing = {k for kinds in HEADER_MENUS.values() for k in kinds} - set(items)
    assert not missing, f"{path}: the header lacks {sorted(missing)}"

    def href(kind: str) -> str:
        value = items[kind].get_attribute("href")
        assert value, f"{path}: {kind} has no href"
        return value

    # Off-site links: the href only.
    assert href("btn-source-repository-button") == url, f"{path}: repository link"
    issue = urlparse(href("btn-source-issues-button"))
    assert f"{issue.scheme}://{issue.netloc}{issue.path}" == f"{url}/issues/new", issue
    assert f"/{path}" in parse_qs(issue.query).get("title", [""])[0], f"{path}: issue {issue}"
    edit = href("btn-source-edit-button")
    relative = source.relative_to(ROOT).as_posix()
    assert edit == f"{url}/edit/{branch}/{path_to_book}{relative}", f"{path}: edit link {edit}"

    # The download: the page's own source, on this site.
    download = urljoin(page_url, href("btn-download-source-button"))
    assert urlparse(download).hostname == LOCAL_HOST, f"{path}: download {download} is off-site"
    assert download.endswith(f"/_sources/{relative}"), f"{path}: download {download}"
    response = v.context.request.get(download)
    assert response.status == 200, f"{path}: {download} answered HTTP {response.status}"
    assert response.body() == source.read_bytes(), f"{path}: {download} is not {relative}"
    assert items["btn-download-source-button"].inner_text().strip() == source.suffix, path

    # The .pdf: the browser prints the page, with the book's print style sheet.
    pdf = items["btn-download-pdf-button"]
    assert pdf.evaluate("e => e.tagName") == "BUTTON" and pdf.get_attribute("onclick") == (
        "window.print()"), f"{path}: .pdf is {pdf.evaluate('e => e.outerHTML')}"
    sheets = page.evaluate("Array.from(document.styleSheets).map(s => s.href || '')")
    print_css = [sheet for sheet in sheets if sheet.split("?")[0].endswith("/_static/print.css")]
    assert print_css, f"{path}: the page does not link _static/print.css: {sheets}"
    response = v.context.request.get(print_css[0])
    assert response.status == 200 and b"@media print" in response.body(), print_css[0]
    assert not v.external, f"{path} requested outside hosts: {v.external}"


def test_notebook_pages_exist_in_toc():
    # Guards the parametrisation above: chapters are notebooks, so there must be some.
    assert any(_is_notebook(entry) for entry in PAGES[1:]), PAGES


@pytest.mark.parametrize("entry", ["book/assignments"])  # groups it with that page's tests
def test_assignments_page_links_student_notebooks(loaded, site_url, entry):
    """The Assignments page links a downloadable student version of every assignment."""
    assert entry in PAGES, f"{entry} is not in _toc.yml"
    path = _html_path(entry)
    v = loaded(path)
    links = v.page.locator("a[href$='.ipynb']")
    hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
    sources = sorted(p.parent.name for p in (ROOT / "assignments" / "source").glob("*/*.ipynb"))
    names = sorted({href.split("/")[-1].removesuffix(".ipynb") for href in hrefs})
    assert set(sources) <= set(names), f"{path}: links {names}, assignments {sources}"
    # Follow one link, as a student would, and check it is the student version.
    href = next(h for h in hrefs if h.endswith("argmax_attention.ipynb"))
    response = v.context.request.get(urljoin(urljoin(site_url, path), href))
    assert response.ok, f"{path}: {href} answered HTTP {response.status}"
    text = response.text()
    notebook = json.loads(text)
    assert notebook.get("cells"), f"{href} is not a notebook"
    assert "raise NotImplementedError" in text, f"{href} is not the student version"
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert not v.external, f"{path} requested outside hosts: {v.external}"


@pytest.mark.parametrize("entry", [e for e in PAGES[1:] if _is_notebook(e)])
def test_chapter_shows_its_computed_figures(entry):
    """Every chapter computes at least two figures, and they reach the built page."""
    html = (SITE / _html_path(entry)).read_text(encoding="utf-8")
    images = html.count("<img")
    assert images >= 2, f"{entry}: {images} figure(s) in the built page, expected at least 2"


# --- Page reading checks (rules 1-3 of the module docstring) --------------------------------------

# One JavaScript function returns every problem it finds on the current page, as strings.
PAGE_CHECKS_JS = r"""
() => {
  const problems = [];
  const snippet = (text, index) =>
    text.slice(Math.max(0, index - 40), index + 40).replace(/\s+/g, " ");

  // 1. Raw LaTeX in text outside rendered maths and code.
  const skip = "mjx-container, mjx-assistive-mml, pre, code, script, style, noscript, textarea";
  const rawTex = /\$|\\[()\[\]]|\\[A-Za-z]{2,}/;
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const parent = node.parentElement;
    if (!parent || parent.closest(skip)) continue;
    const match = rawTex.exec(node.textContent);
    if (match) problems.push(`raw LaTeX ${JSON.stringify(match[0])}: ` +
                             `"...${snippet(node.textContent, match.index)}..."`);
  }

  // 2. Warnings and tracebacks in cell outputs.
  const warning = /Traceback|\b[A-Za-z]*Warning\b/;
  document.querySelectorAll(".cell_output").forEach((output) => {
    const cell = output.closest(".cell");
    const allCells = [...document.querySelectorAll(".cell")];
    const where = cell && cell.id ? cell.id : `cell ${allCells.indexOf(cell)}`;
    output.querySelectorAll(".stderr, .traceback, .output.error").forEach((el) =>
      problems.push(`${where}: ${el.className.trim()} output: "${snippet(el.textContent, 0)}"`));
    const match = warning.exec(output.textContent);
    if (match) problems.push(`${where}: output shows ${JSON.stringify(match[0])}: ` +
                             `"...${snippet(output.textContent, match.index)}..."`);
  });

  // 3. Cells whose output is a figure keep their code folded.
  const cells = [...document.querySelectorAll("div.cell")];
  cells.forEach((cell, index) => {
    if (!cell.querySelector(".cell_output img")) return;  // copy buttons carry svg icons
    const input = cell.querySelector(".cell_input");
    if (!input) return;
    const folded = cell.classList.contains("tag_hide-input") &&
                   input.closest("details.hide:not([open])") !== null;
    if (!folded) {
      const code = input.textContent.trim().split("\n")[0];
      problems.push(`cell ${index} draws a figure but its code is not folded (tag the cell ` +
                    `hide-input): "${code.slice(0, 80)}"`);
    }
  });

  // 4. Every image of the content says what it shows, in words, not as a file path.
  const content = document.querySelector("article") || document.body;
  const pathLike = /^\S*\.(png|svg|jpe?g|gif|pdf)$|^\S*\/\S*$/i;
  const images = [...content.querySelectorAll("img")].map((el) =>
    [el, el.getAttribute("alt"), el.getAttribute("src") || ""]);
  content.querySelectorAll(".cell_output svg, figure svg").forEach((el) => {
    if (el.closest("button, mjx-container")) return;  // icons, typeset maths
    const title = el.querySelector(":scope > title");
    images.push([el, el.getAttribute("aria-label") || (title && title.textContent), "inline svg"]);
  });
  images.forEach(([el, alt, src]) => {
    const text = (alt || "").trim();
    const where = src.startsWith("data:") ? src.slice(0, 30) : src.split("/").pop();
    if (!text) problems.push(`figure ${where} has no alt text`);
    else if (pathLike.test(text) || text === src || text.split(/\s+/).length < 3)
      problems.push(`figure ${where} has alt text that does not say what it shows: "${text}"`);
  });

  // 5. On a chapter page, no visible code block is wider than its box.
  const chapter = document.querySelector("div.cell") !== null;
  content.querySelectorAll("div.highlight pre").forEach((pre) => {
    if (!chapter || pre.closest(".cell_output")) return;  // program output, not code
    if (pre.closest("details:not([open])")) return;  // folded: not visible
    if (pre.scrollWidth > pre.clientWidth + 1) {
      const cell = pre.closest(".cell");
      const lines = pre.textContent.split("\n");
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), "").trim();
      problems.push(`${cell && cell.id ? cell.id : "code block"} overflows its box ` +
                    `(${pre.scrollWidth} > ${pre.clientWidth} px): "${longest.slice(0, 80)}"`);
    }
  });
  return problems;
}
"""


def _wait_for_math(page, timeout_ms: int = 4 * TIMEOUT_MS) -> None:
    """Wait until MathJax has typeset every math element Sphinx wrote (generous: a busy machine
    typesets a long chapter slowly, and the checks below need only the DOM, not the images)."""
    num_math = page.locator(".math").count()
    if num_math:
        page.wait_for_function(
            "n => document.querySelectorAll('mjx-container').length >= n",
            arg=num_math,
            timeout=timeout_ms,
        )
        page.evaluate(
            "async () => { if (window.MathJax && MathJax.startup && MathJax.startup.promise) "
            "await MathJax.startup.promise; }"
        )


@pytest.mark.parametrize("entry", PAGES[1:])
def test_page_reads_cleanly(loaded, entry):
    """No raw LaTeX, no warning or traceback in outputs, figure code folded (see the docstring)."""
    path = _html_path(entry)
    v = loaded(path)  # after the load event at least: the DOM and the deferred scripts are there
    _wait_for_math(v.page)
    problems = v.page.evaluate(PAGE_CHECKS_JS)
    assert not problems, f"{path}: {len(problems)} problem(s):\n" + "\n".join(problems[:20])


SYNTHETIC_PAGE = r"""<!DOCTYPE html><html><body>
<p>Fine: <mjx-container>x + $y$ \frac{1}{2}</mjx-container> and <code>cost = $5</code>.</p>
<p>A list item that should have been maths: \lVert x_j\rVert^2/(2\sigma^2)$.</p>
<div class="cell docutils container" id="plain">
  <div class="cell_input docutils container"><pre>x = 1</pre></div>
  <div class="cell_output docutils container">
    <div class="output stderr highlight-myst-ansi notranslate"><pre>careful</pre></div>
  </div>
</div>
<div class="cell docutils container" id="warns">
  <div class="cell_input docutils container"><pre>import warnings</pre></div>
  <div class="cell_output docutils container"><pre>RuntimeWarning: overflow</pre></div>
</div>
<div class="cell docutils container">
  <div class="cell_input docutils container"><pre>plt.plot(x)  # unfolded figure</pre></div>
  <div class="cell_output docutils container"><img src="data:image/png;base64,iVBORw0KGgo="
    alt="A line plot of x against its index."></div>
</div>
<div class="cell tag_hide-input docutils container">
  <details class="admonition hide above-input"><summary>Show code cell source</summary>
  <div class="cell_input docutils container"><pre>plt.plot(y)  # folded figure</pre></div></details>
  <div class="cell_output docutils container"><img src="data:image/png;base64,iVBORw0KGgo="
    alt="A line plot of y against its index."></div>
</div>
<div class="cell tag_hide-input docutils container" id="no-alt">
  <details class="admonition hide above-input"><summary>Show code cell source</summary>
  <div class="cell_input docutils container"><pre>plt.plot(z)</pre></div></details>
  <div class="cell_output docutils container"><img src="../_images/0a1b.svg"></div>
  <div class="cell_output docutils container"><img src="../_images/2c3d.svg"
    alt="../_images/2c3d.svg"></div>
  <div class="cell_output docutils container"><svg><title>A bar chart of two costs.</title></svg>
    <svg></svg></div>
</div>
<div class="cell docutils container" id="wide">
  <div class="cell_input docutils container"><div class="highlight">
    <pre style="width: 200px; overflow-x: auto">x = "code far too wide for its box"</pre>
  </div></div>
  <div class="cell_output docutils container"><div class="highlight">
    <pre style="width: 200px; overflow-x: auto">a line of printed output, wide but not code</pre>
  </div></div>
</div>
<div class="cell tag_hide-input docutils container" id="folded-wide">
  <details class="admonition hide above-input"><summary>Show code cell source</summary>
  <div class="cell_input docutils container"><div class="highlight">
    <pre style="width: 200px; overflow-x: auto">x = "folded code far too wide for its box"</pre>
  </div></div></details>
</div>
<div class="highlight"><pre style="width: 600px">fits = True</pre></div>
</body></html>"""


def test_page_checks_catch_what_they_should(browser):
    """The page checks find each planted problem, and nothing on the lines that are fine."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_content(SYNTHETIC_PAGE)
        problems = page.evaluate(PAGE_CHECKS_JS)
    finally:
        context.close()
    text = "\n".join(problems)
    assert len(problems) == 8, text
    assert sum("raw LaTeX" in p for p in problems) == 1 and "\\\\lVert" in problems[0], text
    assert any("plain: output stderr" in p for p in problems), text
    assert any("warns: output shows \"RuntimeWarning\"" in p for p in problems), text
    assert any("unfolded figure" in p for p in problems), text
    assert sum("draws a figure" in p for p in problems) == 1, text  # the folded one passes
    assert sum("0a1b.svg has no alt text" in p for p in problems) == 1, text
    assert sum("2c3d.svg has alt text that does not say" in p for p in problems) == 1, text
    assert sum("inline svg has no alt text" in p for p in problems) == 1, text  # not the titled one
    # neither the output, nor the folded cell, nor `fits`
    assert sum("overflows its box" in p for p in problems) == 1, text
    assert any(p.startswith("wide overflows its box") for p in problems), text
