"""Turn on the book's Colab and Binder launch buttons, for a site published from GitHub.

The committed ``_config.yml`` has none: the book makes no outside requests, and a launch
button opens the chapter from the repository, which a local build may not match. The Pages
workflow (``.github/workflows/pages.yml``) runs this before ``make book`` when the repository
variable ``LAUNCH_BUTTONS`` names them (``colab``, ``binder`` or ``colab binder``)::

    python3 book/_launch_buttons.py colab binder          # edits _config.yml in place
    python3 book/_launch_buttons.py colab --config OTHER  # another file

A chapter opened either way runs after the one line of its install note,
``pip install git+<repository>``: Colab has torch and the rest, and the note's line installs
the library; Binder builds its image from ``binder/requirements.txt``, which holds the same
line (``tests/test_launch_buttons.py`` checks that the two agree).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
URLS = {"colab": ("colab_url", "https://colab.research.google.com"),
        "binder": ("binderhub_url", "https://mybinder.org")}


def enable(text: str, services: list[str]) -> str:
    """``_config.yml``'s text with the ``launch_buttons`` URL of each service set."""
    for service in services:
        key, url = URLS[service]
        pattern = re.compile(rf"^(  {key}:)\s*\"[^\"]*\"\s*$", flags=re.MULTILINE)
        if not pattern.search(text):
            raise SystemExit(f"_config.yml has no launch_buttons.{key} line to set")
        text = pattern.sub(rf'\1 "{url}"', text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("services", nargs="*", choices=sorted(URLS),
                        help="the buttons to turn on (none: change nothing)")
    parser.add_argument("--config", type=Path, default=ROOT / "_config.yml")
    args = parser.parse_args(argv)
    if args.services:
        args.config.write_text(enable(args.config.read_text(), args.services))
        print(f"launch buttons on: {', '.join(args.services)} ({args.config})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
