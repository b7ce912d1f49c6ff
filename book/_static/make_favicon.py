"""Draw the site's icon: a causal attention matrix, 4 x 4 weights, light on dark blue.

Writes ``favicon.svg`` (``html.favicon`` in _config.yml: every page links it) and
``site_root/favicon.ico`` (copied to the site's root by ``html_extra_path``, for the root
``index.html``, a bare redirect that links no icon, where browsers ask for /favicon.ico).
Both come from the same grid, so they stay one design. Run it after changing the design::

    .venv/bin/python book/_static/make_favicon.py
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
BACKGROUND = (31, 58, 95)  # #1f3a5f
CELL = (255, 255, 255)
# Row i attends to keys 0..i (causal); the weights of a row sum to 1, the diagonal is largest.
WEIGHTS = [
    [1.0, 0, 0, 0],
    [0.35, 0.65, 0, 0],
    [0.15, 0.3, 0.55, 0],
    [0.1, 0.15, 0.25, 0.5],
]
GRID, PAD, GAP = 4, 3.0, 1.0  # cells, margin and gap in units of a 32-unit square


def cells():
    """(x, y, size, opacity) of each non-zero cell, in a 32 x 32 square."""
    size = (32 - 2 * PAD - (GRID - 1) * GAP) / GRID
    for i, row in enumerate(WEIGHTS):
        for j, weight in enumerate(row):
            if weight:
                yield PAD + j * (size + GAP), PAD + i * (size + GAP), size, 0.25 + 0.75 * weight


def svg() -> str:
    rects = "".join(
        f'<rect x="{x:g}" y="{y:g}" width="{s:g}" height="{s:g}" rx="1" '
        f'fill="#fff" fill-opacity="{a:.2f}"/>' for x, y, s, a in cells())
    return ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
            '<rect width="32" height="32" rx="6" fill="#1f3a5f"/>' + rects + "</svg>\n")


def png(pixels: int) -> Image.Image:
    scale = pixels / 32
    image = Image.new("RGBA", (pixels, pixels), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, pixels - 1, pixels - 1), radius=6 * scale, fill=BACKGROUND)
    for x, y, s, a in cells():
        colour = tuple(round(a * c + (1 - a) * b) for c, b in zip(CELL, BACKGROUND, strict=True))
        draw.rectangle((round(x * scale), round(y * scale), round((x + s) * scale) - 1,
                        round((y + s) * scale) - 1), fill=colour)
    return image


def main() -> None:
    (HERE / "favicon.svg").write_text(svg())
    (HERE / "site_root").mkdir(exist_ok=True)
    png(48).save(HERE / "site_root" / "favicon.ico", sizes=[(16, 16), (32, 32), (48, 48)])


if __name__ == "__main__":
    main()
