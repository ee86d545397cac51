"""Randomized chaos under --heal, many seeds (issue 21): for each seed, a schedule of overlapping failures
(ringtrain/testing/random_chaos.py: kills at fault points inside steps, heals, admissions, sharded and background
saves and evaluations; stops past dist.timeout_s; joins and joiners that leave) runs as a real job and every
invariant is checked. Prints one line per seed and writes them, with the count of failures, to OUT.

    .venv/bin/python bench/heal_chaos.py --seeds 0:50 --out bench-out/heal-chaos

Exit code 1 when any seed broke an invariant (its job's log is kept in OUT/seed-N/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringtrain.testing.random_chaos import Schedule, check, run_schedule  # noqa: E402 - the chaos tests' driver


def seeds(text: str) -> list[int]:
    if ":" in text:
        start, stop = text.split(":")
        return list(range(int(start), int(stop)))
    return [int(seed) for seed in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:50", help="START:STOP or a comma list (default 0:50)")
    parser.add_argument("--out", default="bench-out/heal-chaos")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds(args.seeds):
        folder = out / f"seed-{seed}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        schedule = Schedule.from_seed(seed)
        outcome = run_schedule(schedule, folder)
        problems = check(outcome)
        results.append({"seed": seed, "schedule": schedule.describe(), "exit": outcome.code,
                        "seconds": round(outcome.seconds, 1), "fired": outcome.fired, "problems": problems})
        print(f"{'FAIL' if problems else 'ok  '} {schedule.describe()} -> exit {outcome.code}, "
              f"{outcome.seconds:.0f} s, fired {outcome.fired}{'; ' + '; '.join(problems) if problems else ''}",
              flush=True)
        if problems:
            (folder / "stderr.txt").write_text(outcome.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    failed = [r for r in results if r["problems"]]
    summary = {"when": time.strftime("%Y-%m-%d %H:%M"), "runs": len(results), "failures": len(failed),
               "results": results}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{len(results)} seeds, {len(failed)} failed{': ' + ', '.join(str(r['seed']) for r in failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
