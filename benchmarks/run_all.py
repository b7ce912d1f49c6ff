"""Run every benchmark behind the comparison chapter, one after the other (``make bench``).

    .venv/bin/python benchmarks/run_all.py            # all scripts
    .venv/bin/python benchmarks/run_all.py --quick    # smoke test (results in a temp dir)

Each script runs in its own Python process (``sys.executable``, no shell), so that
one script's memory and threads do not affect the next one's timings; the run stops
at the first failure. Results go to ``benchmarks/results/``. The whole sequence took about
30 minutes on two CPU cores before the Part IV benchmarks (``sparse_speed.py``,
``ring_speed.py``), which add one to two hours (dense attention at n up to 32768).

The conditions stored with every result (machine, versions, load average) and the writing
of the result files live in ``_results.py``; ``run_conditions`` is re-exported here for
scripts that import it from this module.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import run_conditions  # noqa: E402, F401  (re-exported)

# Order: speed first (the longest and most load-sensitive), then training, then errors.
SCRIPTS = ("attention_speed.py", "tiled_attention.py", "decode_speed.py", "recurrent_speed.py",
           "sparse_speed.py", "ring_speed.py", "train_models.py", "train_recurrent.py",
           "approximation_error.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test, results in a temp dir")
    parser.add_argument("--only", nargs="*", choices=SCRIPTS, help="run only these scripts")
    args = parser.parse_args(argv)
    scripts = args.only or SCRIPTS
    extra: list[str] = []
    if args.quick:
        extra = ["--quick", "--out", tempfile.mkdtemp(prefix="bench_quick_")]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting on a shared machine
    total = time.perf_counter()
    for script in scripts:
        path = HERE / script
        if not path.exists():
            print(f"run_all: {script} is missing", file=sys.stderr)
            return 1
        print(f"\n=== {script} ===", flush=True)
        start = time.perf_counter()
        completed = subprocess.run([sys.executable, str(path), *extra], env=env, check=False)
        elapsed = time.perf_counter() - start
        print(f"=== {script}: exit {completed.returncode} after {elapsed:.0f} s ===", flush=True)
        if completed.returncode != 0:
            return completed.returncode
    print(f"\nall benchmarks done in {time.perf_counter() - total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
