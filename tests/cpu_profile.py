"""Sum a CPU profile of a test run (``CPU_PROFILE=<folder> make test``; tests/conftest.py)
per test file, or per notebook and assignment group, largest first.

    python tests/cpu_profile.py <folder> [--top 30] [--tests]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def read(folder: Path) -> tuple[list[tuple[str, float, float]], set[str]]:
    """The rows (test, CPU s, wall s) of every TSV in ``folder``, and how their CPU was
    counted (``cgroup``: everything the worker started; ``rusage``: what it reaped)."""
    rows, methods = [], set()
    for path in sorted(folder.glob("*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            nodeid, cpu, wall, *method = line.split("\t")
            rows.append((nodeid, float(cpu), float(wall)))
            methods.add(method[0] if method else "rusage")
    return rows, methods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tests", action="store_true", help="per test, not per file")
    args = parser.parse_args(argv)
    rows, methods = read(args.folder)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, wall in rows:
        key = nodeid if args.tests else nodeid.partition("::")[0]
        totals[key][0] += cpu
        totals[key][1] += wall
        totals[key][2] += 1
    cpu_all = sum(cpu for _, cpu, _ in rows)
    print(f"{len(rows)} tests, {cpu_all:.0f} CPU s in all ({cpu_all / 60:.1f} CPU min), "
          f"counted by {' and '.join(sorted(methods))}")
    if "rusage" in methods:
        print("  (rusage: processes the workers did not reap, such as sandboxed kernels, "
              "are missing)")
    print(f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  file")
    for key, (cpu, wall, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{cpu:8.1f} {wall:8.1f} {count:6d}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
