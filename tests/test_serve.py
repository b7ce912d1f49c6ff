"""`make serve`: the recipe serves the book as built, over HTTP, from any working directory.

The recipe runs for real (GNU make, then Python's http.server) on a free port, against a tiny
scratch site given as BUILD_HTML, so no test builds the book. It is started from another folder
(`make -f <repo>/Makefile` and `make -C <repo>`), which the old recipe failed (it entered
_build/html and then ran the relative `.venv/bin/python`: Error 127), and it is stopped by its
process group. A dry run (`make -n`) shows that a missing build is built first, and that an
existing one is not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"
INDEX = "<!doctype html><title>scratch book</title><p>served by make serve</p>\n"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice for port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def scratch_site(tmp_path) -> Path:
    site = tmp_path / "site with space"  # quoting in the recipe is part of what is tested
    site.mkdir()
    (site / "index.html").write_text(INDEX)
    return site


def _fetch(url: str, deadline_s: float, server: subprocess.Popen) -> bytes:
    """GET ``url``, retrying while the server starts; fails with the server's output."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read()
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                output = server.communicate(timeout=5)[0] if server.poll() is not None else ""
                pytest.fail(f"{url} never answered; make serve exited {server.returncode}:\n"
                            f"{output}")
            time.sleep(0.2)


def _stop(server: subprocess.Popen) -> None:
    """Stop make and the server it started: the whole process group of the test's own make."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


@pytest.mark.parametrize("how", ["-f", "-C"])
def test_make_serve_serves_the_built_site_from_another_folder(tmp_path, scratch_site, how):
    port = _free_port()
    target = ["-f", str(MAKEFILE)] if how == "-f" else ["-C", str(ROOT)]
    command = ["make", "--no-print-directory", *target, "serve", f"PORT={port}",
               f"BUILD_HTML={scratch_site}"]
    server = subprocess.Popen(command, cwd=tmp_path, start_new_session=True, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        body = _fetch(f"http://127.0.0.1:{port}/index.html", 30, server)
        assert body.decode() == INDEX
        assert server.poll() is None, "make serve stopped after one request"
    finally:
        _stop(server)
    assert not any(tmp_path.glob("_build")), "make serve built something in the caller's folder"


def _dry_run(*variables: str) -> str:
    done = subprocess.run(["make", "-n", "--no-print-directory", "-f", str(MAKEFILE), "serve",
                           *variables], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_serve_builds_only_when_there_is_no_build(tmp_path, scratch_site):
    built = _dry_run(f"BUILD_HTML={scratch_site}", "PORT=8123")
    assert "jupyter-book build" not in built, built
    assert f"http.server 8123 --bind 127.0.0.1 --directory '{scratch_site}'" in built, built
    empty = tmp_path / "no build yet"
    empty.mkdir()
    missing = _dry_run(f"BUILD_HTML={empty}")  # make -n still runs the $(MAKE) line, dry
    assert "jupyter-book build" in missing, missing
    assert "http.server 8000 " in missing, missing  # the default port


def test_make_serve_defaults_to_the_repository_build():
    shown = _dry_run()
    assert f"--directory '{ROOT / '_build' / 'html'}'" in shown, shown
