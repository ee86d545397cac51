"""Recovery time of healing in place (--heal), over many heals: start `ringtrain train` with --nproc N
--min-nproc M --heal, SIGKILL a worker (not rank 0, never the one that just took over) every few steps until M
remain, read each 'heal' record, check the ledger (every sample once), repeat for --runs runs; print and write the median and worst recovery_s,
and the steps lost.

    flock -x /tmp/ringtrain-cpu.lock .venv/bin/python bench/heal_recovery.py --runs 4 --nproc 4 --min-nproc 1 \
        --out bench-out/heal

Each heal's recovery_s runs from the last step completed before the kill to the next step completed after
it (the moment the survivors train again), as the restart path's restart_s does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringtrain.data.ledger import check_ledger  # noqa: E402
from tests.chaos.jobs import Job, ledger_steps, records  # noqa: E402 - the chaos tests' job harness

SETS = ["--set", "train.global_batch_size=96", "--set", "train.local_batch_size=8", "--set", "data.ledger=true",
        "--set", "monitor.log_every_steps=1", "--set", "monitor.progress=false", "--set", "dist.timeout_s=20",
        "--set", "checkpoint.every_steps=1000", "--set", "train.epochs=30"]


def one_run(run_dir: Path, nproc: int, min_nproc: int, every_steps: int) -> list[dict]:
    with Job("train", "configs/digits_mlp.toml", "--nproc", str(nproc), "--min-nproc", str(min_nproc), "--heal",
             "--run-dir", str(run_dir), *SETS) as job:
        for kill in range(nproc - min_nproc):
            target = len(ledger_steps(run_dir)) + every_steps
            job.wait_for(lambda: len(ledger_steps(run_dir)) >= target, what=f"step {target}")
            # The highest original rank still alive: never rank 0, so the writer stays (the fencing test covers it).
            job.worker(max(job.workers())).kill()
            job.wait_for(lambda: len(records(run_dir, "heal")) > kill, timeout=60, what=f"heal {kill + 1}")
        code = job.finish()
    if code != 0:
        raise SystemExit(f"run {run_dir} exited with {code}:\n{job.stderr}")
    if not all(r.exactly_once and r.complete for r in check_ledger(run_dir / "ledger.jsonl")):
        raise SystemExit(f"run {run_dir}: the ledger does not show every sample exactly once (ringtrain ledger)")
    return records(run_dir, "heal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--min-nproc", type=int, default=1)
    parser.add_argument("--every-steps", type=int, default=15, help="steps between kills")
    parser.add_argument("--out", default="bench-out/heal")
    args = parser.parse_args()
    out = Path(args.out)
    heals: list[dict] = []
    started = time.monotonic()
    for run in range(args.runs):
        run_dir = out / "runs" / f"run-{run}-{int(time.time())}"
        found = one_run(run_dir, args.nproc, args.min_nproc, args.every_steps)
        print(f"run {run}: " + ", ".join(f"step {h['step']} {h['world_size'] + len(h['lost_ranks'])}->"
                                         f"{h['world_size']} {h['recovery_s']:.2f} s" for h in found), flush=True)
        heals += found
    recovery = sorted(h["recovery_s"] for h in heals)
    result = {
        "command": " ".join(sys.argv),
        "heals": len(heals),
        "recovery_s_median": statistics.median(recovery),
        "recovery_s_worst": recovery[-1],
        "recovery_s_best": recovery[0],
        "regroup_s_median": statistics.median(h["regroup_s"] for h in heals),
        "steps_lost_total": sum(h["steps_lost"] for h in heals),
        "rolled_forward": sum(h["rolled_forward"] for h in heals),
        "wall_s": round(time.monotonic() - started, 1),
        "records": heals,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(heals)} heals: recovery_s median {result['recovery_s_median']:.2f} s, worst {result['recovery_s_worst']:.2f} s "
          f"(best {result['recovery_s_best']:.2f} s; regroup median {result['regroup_s_median']:.2f} s); steps lost "
          f"{result['steps_lost_total']}; {result['rolled_forward']} rolled forward from a peer -> {out / 'recovery.json'}")


if __name__ == "__main__":
    main()
