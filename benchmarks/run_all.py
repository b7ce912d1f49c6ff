"""Run every benchmark behind the comparison chapter, one after the other (``make bench``).

    .venv/bin/python benchmarks/run_all.py            # all scripts
    .venv/bin/python benchmarks/run_all.py --quick    # smoke test (results in a temp dir)

Each script runs in its own Python process (``sys.executable``, no shell), so that
one script's memory and threads do not affect the next one's timings; the run stops
at the first failure. Results go to ``benchmarks/results/``. The whole sequence is
budgeted for under 30 minutes on two CPU cores.

The module also provides :func:`run_conditions`, which the scripts store in their JSON
so that every number says under which conditions it was measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Order: speed first (the longest and most load-sensitive), then training, then errors.
SCRIPTS = ("attention_speed.py", "tiled_attention.py", "train_models.py",
           "approximation_error.py")


def run_conditions(end: bool = False) -> dict[str, object]:
    """Date, versions, threads and load average: the conditions of a measurement.

    With ``end=True`` only the end time and the load average at the end.
    """
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if end:
        return {"finished": now, "load_average_end": load}
    import torch

    return {
        "started": now,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_start": load,  # 1, 5 and 15 minutes: other work on the machine
    }


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
