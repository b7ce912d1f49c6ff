"""Print the whole book to one PDF, offline: ``make pdf`` writes _build/pdf/efficient-attention.pdf.

``make pdf`` first builds the book as one HTML page (``jupyter-book build . --builder
singlehtml``, which takes every executed chapter from the same execution cache as ``make book``),
then runs this script on it. The page is served by Python's http.server on 127.0.0.1 and opened
in Debian's chromium (CHROMIUM_PATH), driven by Playwright, as the browser tests do
(tests/test_browser.py): no ``playwright install``, and every request to another host is aborted,
so the PDF is made with no network. Once the offline MathJax has typeset every formula and every
image and font has loaded, Chromium prints the page: A4, with margins, backgrounds, the book's
title at the top of each page, "page N of M" at the bottom and an outline (bookmarks) of the
headings. The book's print style sheet (book/_static/css/print.css) hides the sidebars, buttons
and folded code and wraps long code lines; the class ``whole-book`` that this script puts on the
page turns on its rules for the whole book (a page break before every chapter, chapter titles
shown).

A request to another host, a request that fails or a formula MathJax cannot typeset stops the
script before it prints, naming them. Usage::

    python book/_pdf.py [--site _build/singlehtml] [--output _build/pdf/efficient-attention.pdf]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urljoin, urlparse

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "singlehtml"
OUTPUT = ROOT / "_build" / "pdf" / "efficient-attention.pdf"
LOCAL_HOST = "127.0.0.1"
# The flags of the browser tests (tests/test_browser.py): no sandbox (root in a container), no
# GPU, and none of Chromium's own background requests.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
# The singlehtml builder writes the book as its root document (book/intro.html) but with every
# relative address written as if that page were at the site's root (`_static/...`,
# `_images/...`), and an index.html that redirects to it. The page is therefore served at the
# root, under this name.
SERVED_NAME = "_whole_book.html"
# Files the page links that the singlehtml builder does not write, answered with an empty body:
# Sphinx's search index (the one-page book has no search page, and nothing is searched).
NOT_WRITTEN = {"searchindex.js": "text/javascript"}
# How long the page may take to load, typeset its maths and load its images and fonts: a long
# book on a busy 2-core machine typesets slowly (several thousand formulas).
READY_TIMEOUT_S = 900
PAGE_MARGIN = {"top": "18mm", "bottom": "18mm", "left": "15mm", "right": "15mm"}
# The page is laid out 1/SCALE times wider than the paper, then shrunk: at 0.8 the text column
# of an A4 page between these margins is 850 CSS px, wide enough for the chapters' 76-character
# code lines (tests/test_browser.py), and the text is printed at about 10 pt.
SCALE = 0.8
# Chromium's header and footer templates: their own small documents (no style of the page), in
# which it fills the elements of class pageNumber and totalPages.
HEADER = ('<div style="font-size: 8px; color: #666; width: 100%; margin: 0 15mm; '
          'text-align: right;">{title}</div>')
FOOTER = ('<div style="font-size: 8px; color: #666; width: 100%; text-align: center;">'
          'page <span class="pageNumber"></span> of <span class="totalPages"></span></div>')


class PdfError(RuntimeError):
    """The page could not be printed as it should (names what went wrong)."""


def book_page(site: Path) -> Path:
    """The file of the page to print: the target of index.html's redirect, else index.html."""
    index = site / "index.html"
    if not index.is_file():
        raise PdfError(f"{index} is missing: build the book as one page first (make pdf)")
    found = re.search(r"""http-equiv=["']?refresh["']?[^>]*url=([^"'>\s]+)""",
                      index.read_text(encoding="utf-8"), re.IGNORECASE)
    page = site / found.group(1) if found else index
    if not page.is_file():
        raise PdfError(f"{index} redirects to {page}, which is missing")
    return page


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the signature of the base class
        pass


class _SiteServer(ThreadingHTTPServer):
    request_queue_size = 128  # Chromium opens many connections at once (see test_browser.py)
    daemon_threads = True


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on 127.0.0.1 (any free port); yield its base URL."""
    server = _SiteServer((LOCAL_HOST, 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOCAL_HOST}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@dataclass
class _Requests:
    """What the page asked for: requests to other hosts (aborted), failures, those in flight."""

    external: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    pending: dict = field(default_factory=dict)


def _book_title(default: str = "") -> str:
    config = ROOT / "_config.yml"
    if config.is_file():
        found = re.search(r"^title:\s*[\"']?(.*?)[\"']?\s*$", config.read_text(encoding="utf-8"),
                          re.MULTILINE)
        if found:
            return found.group(1)
    return default


def _check_requests(requests: _Requests) -> None:
    if requests.external:
        raise PdfError("the page asked for other hosts (the PDF is made offline): "
                       f"{requests.external[:10]}")
    if requests.failed:
        raise PdfError(f"failed requests: {requests.failed[:10]}")


def _wait_until_ready(page, requests: _Requests, timeout_s: float) -> None:
    """Wait until MathJax has typeset every formula, every image and font has loaded, and no
    request has been in flight for half a second."""
    deadline = time.monotonic() + timeout_s

    def left_ms() -> float:
        return max(1000.0, (deadline - time.monotonic()) * 1000)

    num_math = page.locator(".math").count()
    if num_math:
        page.wait_for_function("n => document.querySelectorAll('mjx-container').length >= n",
                               arg=num_math, timeout=left_ms(), polling=500)
        page.evaluate("async () => { if (window.MathJax && MathJax.startup && "
                      "MathJax.startup.promise) await MathJax.startup.promise; }")
        errors = page.locator("mjx-merror").all_text_contents()
        if errors:
            raise PdfError(f"MathJax could not typeset {len(errors)} formula(s): {errors[:5]}")
    page.wait_for_function("Array.from(document.images).every(img => img.complete)",
                           timeout=left_ms(), polling=500)
    broken = page.evaluate("Array.from(document.images)"
                           ".filter(img => img.naturalWidth === 0).map(img => img.src)")
    _check_requests(requests)  # the likelier cause of a broken image
    if broken:
        raise PdfError(f"images that did not load: {broken[:10]}")
    page.evaluate("async () => { await document.fonts.ready; }")
    quiet_since = None
    while True:
        now = time.monotonic()
        if requests.pending:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= 0.5:
            return
        if now > deadline:
            raise PdfError(f"requests still in flight after {timeout_s:.0f} s: "
                           f"{sorted(requests.pending.values())[:10]}")
        page.wait_for_timeout(50)


def print_pdf(site: Path = SITE, output: Path = OUTPUT, *, chromium: Path | None = None,
              title: str | None = None, timeout_s: float = READY_TIMEOUT_S) -> Path:
    """Print the book page of ``site`` (see ``book_page``) to ``output``; return ``output``.

    ``chromium``: the browser (default: CHROMIUM_PATH, else /usr/bin/chromium). ``title``: the
    text at the top of every page (default: the title in _config.yml). Raises ``PdfError`` when
    the page asked for another host, a request failed, or MathJax could not typeset a formula;
    nothing is written then."""
    from playwright.sync_api import sync_playwright

    site, output = Path(site), Path(output)
    page_file = book_page(site)
    chromium = Path(chromium or os.environ.get("CHROMIUM_PATH") or "/usr/bin/chromium")
    if not chromium.is_file():
        raise PdfError(f"{chromium} is missing: `make chromium` installs it "
                       "(or set CHROMIUM_PATH to another Chromium)")
    title = _book_title() if title is None else title
    requests = _Requests()

    with serve(site) as base, sync_playwright() as playwright:
        url = urljoin(base, SERVED_NAME)
        browser = playwright.chromium.launch(executable_path=str(chromium), headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(color_scheme="light")

            def route(handled):
                request_url = handled.request.url
                parsed = urlparse(request_url)
                name = parsed.path.lstrip("/")
                if request_url.split("#")[0] == url:
                    handled.fulfill(path=page_file, content_type="text/html; charset=utf-8")
                elif (request_url.startswith(base) and name in NOT_WRITTEN
                      and not (site / name).exists()):
                    handled.fulfill(body="", content_type=NOT_WRITTEN[name])
                elif parsed.scheme in ("data", "blob") or parsed.hostname == LOCAL_HOST:
                    handled.continue_()
                else:
                    requests.external.append(request_url)
                    handled.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("request", lambda r: requests.pending.__setitem__(r, r.url))
            page.on("requestfinished", lambda r: requests.pending.pop(r, None))

            def failed(request):
                requests.pending.pop(request, None)
                if request.url not in requests.external:
                    requests.failed.append(f"{request.url}: {request.failure}")

            page.on("requestfailed", failed)
            page.on("response", lambda r: r.status >= 400 and requests.failed.append(
                f"{r.url}: HTTP {r.status}"))
            page.goto(url, wait_until="load", timeout=timeout_s * 1000)
            _wait_until_ready(page, requests, timeout_s)
            _check_requests(requests)
            page.evaluate("() => document.documentElement.classList.add('whole-book')")
            output.parent.mkdir(parents=True, exist_ok=True)
            partial = output.with_name(output.name + ".part")
            page.pdf(path=partial, format="A4", margin=PAGE_MARGIN, scale=SCALE,
                     print_background=True,
                     display_header_footer=True,
                     header_template=HEADER.format(title=html.escape(title)),
                     footer_template=FOOTER, outline=True, tagged=True)
            partial.replace(output)
        finally:
            browser.close()
    return output


def _pages(path: Path) -> int | None:
    try:
        from pypdf import PdfReader
    except ImportError:
        return None
    return len(PdfReader(path).pages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=SITE, help=f"default: {SITE}")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        output = print_pdf(args.site, args.output)
    except PdfError as error:
        print(f"make pdf: {error}", file=sys.stderr)
        return 1
    pages = _pages(output)
    size = output.stat().st_size / 2**20
    print(f"PDF written: {output} ({size:.1f} MiB"
          + (f", {pages} pages" if pages is not None else "")
          + f", printed in {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
