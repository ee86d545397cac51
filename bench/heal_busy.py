"""The five-kill heal test beside busy processes (issue 21's proof that a loaded host does not evict a live
worker): BUSY processes spin on the same cores (plain Python loops, the default nice level) while the test
runs RUNS times; prints one line per run and writes them, with the count of passes, to OUT.

    .venv/bin/python bench/heal_busy.py --runs 20 --busy 6 --epochs 80 --out bench-out/heal-busy

Exit code 1 when any run failed (its pytest output is kept in OUT/run-N.log).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/heal/test_heal.py::test_five_kills_while_joins_bring_workers_back_heal_in_place_every_sample_once"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=6, help="spinning processes beside the test (default 6)")
    parser.add_argument("--epochs", type=int, default=80,
                        help="the job's length (the test's default is 20): beside busy processes the joiners start "
                             "several times slower than alone, the job's steps much less so (default 80)")
    parser.add_argument("--out", default="bench-out/heal-busy")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results = []
    try:
        for run in range(args.runs):
            started = time.perf_counter()
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RINGTRAIN_FIVE_KILLS_EPOCHS": str(args.epochs)}
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", TEST],
                                  cwd=REPO, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - started
            heals = next((line for line in done.stdout.splitlines() if line.startswith("heals at steps")), "")
            load = os.getloadavg()[0]
            line = (f"run {run + 1}/{args.runs}: {'pass' if done.returncode == 0 else 'FAIL'} in {wall:.0f} s, "
                    f"load {load:.1f} beside {args.busy} busy processes; {heals}")
            print(line, flush=True)
            results.append({"run": run + 1, "passed": done.returncode == 0, "wall_s": round(wall, 1), "load": load,
                            "heals": heals})
            if done.returncode != 0:
                (out / f"run-{run + 1}.log").write_text(done.stdout + done.stderr)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    passed = sum(r["passed"] for r in results)
    summary = f"{passed} of {len(results)} runs passed beside {args.busy} busy processes on {os.cpu_count()} cores"
    print(summary)
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=1) + "\n")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
