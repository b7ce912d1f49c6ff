"""The whole-book PDF (`make pdf`, book/_pdf.py), tested on a tiny synthetic book page.

The real book takes minutes to print; these tests print a page of a few lines, laid out as the
singlehtml builder writes the book (an index.html that redirects to book/intro.html, whose
relative addresses are written as if it were at the site's root), with the book's print style
sheet and, where the installed sphinx-mathjax-offline has them, the book's offline MathJax
files. They check what a reader of the PDF would: a PDF of at least one page whose text has
the heading, the paragraph, the page numbers and the wrapped end of a long code line, and not
the folded code, the sidebar or raw TeX. Printing needs no network: a page that asks for
another host is refused. The Makefile's `pdf` target is checked to run the script.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
import zlib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_book_pdf", ROOT / "book" / "_pdf.py")
book_pdf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = book_pdf  # dataclasses look their module up there
_spec.loader.exec_module(book_pdf)

LONG_LINE = ("x = torch.randn(2, 3, 5, 8)  # (batch, heads, n_q, d_k); " +
             "a long comment " * 8 + "THE-END-OF-THE-LINE")
PAGE = r"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>A synthetic book</title>
<link rel="stylesheet" href="_static/print.css">
<script>window.MathJax = {"options": {"processHtmlClass": "math"}}</script>
MATHJAX_SCRIPT
</head><body>
<div class="bd-sidebar-primary">SIDEBAR NAVIGATION</div>
<article class="bd-article">
<section id="intro"><h1>A synthetic heading</h1>
<p>The paragraph of the synthetic page.</p>
MATH_BLOCK
</section>
<span id="document-book/chapter"></span><section id="chapter"><h1>The second chapter</h1>
<div class="cell tag_hide-input docutils container">
<details class="admonition hide above-input"><summary>Show code cell source</summary>
<div class="cell_input docutils container"><pre>FOLDED_CODE = 1</pre></div></details>
<div class="cell_output docutils container"><pre>the output of the folded cell</pre></div>
</div>
<div class="cell docutils container"><div class="cell_input docutils container">
<div class="highlight"><pre>LONG_LINE</pre></div></div></div>
<img src="_images/dot.png" alt="A single grey pixel.">
</section>
</article></body></html>
"""


def _png(width: int = 1, height: int = 1, grey: int = 128) -> bytes:
    """A grey PNG image (8-bit greyscale), built with the standard library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = b"".join(b"\x00" + bytes([grey]) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


MATH = r'<div class="math notranslate nohighlight">\[\frac{QK^\top}{\sqrt{d_k}}\]</div>'


def _mathjax() -> Path | None:
    """The offline MathJax of sphinx-mathjax-offline (the book's), else a built book's copy."""
    try:
        found = metadata.distribution("sphinx_mathjax_offline").locate_file(
            "sphinx-mathjax-offline/static/mathjax")
        if (Path(found) / "tex-chtml.js").is_file():
            return Path(found)
    except metadata.PackageNotFoundError:
        pass
    built = ROOT / "_build" / "html" / "_static" / "mathjax"
    return built if (built / "tex-chtml.js").is_file() else None


def _synthetic_site(tmp_path: Path, *, extra: str = "") -> tuple[Path, bool]:
    """A site laid out as the singlehtml builder writes the book; returns (site, has_math)."""
    site = tmp_path / "singlehtml"
    (site / "book").mkdir(parents=True)
    (site / "_static").mkdir()
    (site / "_images").mkdir()
    (site / "_images" / "dot.png").write_bytes(_png())
    (site / "_static" / "print.css").write_text(
        (ROOT / "book" / "_static" / "css" / "print.css").read_text(encoding="utf-8"))
    mathjax = _mathjax()
    if mathjax is not None:
        (site / "_static" / "mathjax").symlink_to(mathjax, target_is_directory=True)
    page = (PAGE.replace("MATHJAX_SCRIPT", '<script defer src="_static/mathjax/tex-chtml.js">'
                         "</script>" if mathjax else "")
            .replace("MATH_BLOCK", (MATH if mathjax else "") + extra)
            .replace("LONG_LINE", LONG_LINE))
    (site / "book" / "intro.html").write_text(page, encoding="utf-8")
    (site / "index.html").write_text(
        '<meta http-equiv="Refresh" content="0; url=book/intro.html" />\n', encoding="utf-8")
    return site, mathjax is not None


@pytest.fixture(scope="module")
def chromium() -> Path:
    path = Path(os.environ.get("CHROMIUM_PATH") or "/usr/bin/chromium")
    if not path.is_file():
        result = subprocess.run([str(ROOT / ".ci" / "ensure-packages"), "chromium", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            pytest.fail(f"{path} is missing and could not be installed:\n{result.stderr}")
    return path


def test_book_page_follows_the_redirect(tmp_path):
    site, _ = _synthetic_site(tmp_path)
    assert book_pdf.book_page(site) == site / "book" / "intro.html"
    (site / "index.html").write_text("<html><body>the book</body></html>")
    assert book_pdf.book_page(site) == site / "index.html"
    with pytest.raises(book_pdf.PdfError, match="index.html is missing"):
        book_pdf.book_page(tmp_path)


def test_prints_the_synthetic_page(tmp_path, chromium):
    from pypdf import PdfReader

    site, has_math = _synthetic_site(tmp_path)
    output = tmp_path / "pdf" / "book.pdf"
    assert book_pdf.print_pdf(site, output, chromium=chromium, title="Synthetic Book",
                              timeout_s=180) == output
    data = output.read_bytes()
    assert data.startswith(b"%PDF-"), data[:20]
    assert not output.with_name(output.name + ".part").exists()
    reader = PdfReader(output)
    assert len(reader.pages) >= 2  # the second chapter starts a new page
    pages = [page.extract_text() for page in reader.pages]
    text = "\n".join(pages)
    flat = re.sub(r"\s+", " ", text)
    assert "A synthetic heading" in flat, text
    assert "The paragraph of the synthetic page." in flat, text
    assert "The second chapter" in pages[1] and "The second chapter" not in pages[0], pages
    # The header and footer of every page.
    assert "Synthetic Book" in pages[0] and f"page 1 of {len(pages)}" in flat, text
    # The long code line wraps instead of being clipped: its end is printed.
    assert "THE-END-OF-THE-LINE" in flat, text
    # Folded code, its "Show code cell source" line and the sidebar stay out; the output shows.
    assert "the output of the folded cell" in flat, text
    for hidden in ("FOLDED_CODE", "Show code cell source", "SIDEBAR"):
        assert hidden not in flat, f"{hidden!r} printed:\n{text}"
    if has_math:  # typeset by MathJax: no TeX source in the PDF
        assert "\\frac" not in text and "\\[" not in text, text


def test_refuses_a_page_that_asks_for_another_host(tmp_path, chromium):
    site, _ = _synthetic_site(tmp_path, extra='<img src="http://example.invalid/logo.png" '
                                              'alt="A logo from another host.">')
    output = tmp_path / "book.pdf"
    with pytest.raises(book_pdf.PdfError, match="other hosts.*example.invalid"):
        book_pdf.print_pdf(site, output, chromium=chromium, timeout_s=180)
    assert not output.exists()


def _rule(makefile: str, target: str) -> tuple[list[str], list[str]]:
    """The prerequisites and the recipe lines of ``target`` in the Makefile's text."""
    text = makefile.replace("\\\n", " ")
    found = re.search(rf"^{re.escape(target)}:([^=\n]*)\n((?:\t.*\n)*)", text, re.MULTILINE)
    assert found, f"the Makefile has no target {target!r}"
    return found.group(1).split(), [line.strip() for line in found.group(2).splitlines()]


def test_makefile_pdf_target_runs_the_script():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    prerequisites, recipe = _rule(makefile, "pdf")
    book_prerequisites, _ = _rule(makefile, "book")
    assert set(book_prerequisites) <= set(prerequisites), prerequisites
    assert "chromium" in prerequisites, prerequisites
    assert re.search(r"^PDF\s*:?=\s*_build/pdf/efficient-attention\.pdf\s*$", makefile,
                     re.MULTILINE), "PDF is not _build/pdf/efficient-attention.pdf"
    steps = [next((i for i, line in enumerate(recipe) if word in line), None)
             for word in ("book/_execution_cache.py", "--builder singlehtml", "book/_pdf.py")]
    assert None not in steps and steps == sorted(steps), recipe
    assert "$(PDF)" in recipe[steps[2]] and "_build/singlehtml" in recipe[steps[2]], recipe
    assert re.search(r"^\.PHONY:.*\bpdf\b", makefile.replace("\\\n", " "), re.MULTILINE)
    help_text = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True,
                               text=True, check=True).stdout
    assert "make pdf" in help_text, help_text
