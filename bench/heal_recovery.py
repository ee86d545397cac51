"""Recovery time of healing in place (--heal), over many heals: start `ringtrain train` with --nproc N
--min-nproc M --heal, SIGKILL a worker (never rank 0, the writer) every few steps until M remain, read each
'heal' record, check the ledger (every sample once), repeat for --runs runs; print and write the median and
worst recovery_s, and the steps lost.

    flock -x /tmp/ringtrain-cpu.lock .venv/bin/python bench/heal_recovery.py --runs 4 --nproc 4 --min-nproc 1 \
        --out bench-out/heal

With ``--join`` (issue 12's repeated failures): ``--kills K`` kills, and after each but the last a `ringtrain
join` worker (started ahead) is admitted, so the group goes N -> N-1 -> N ... (ringtrain/testing/heal_cycles.py):

    flock -x /tmp/ringtrain-cpu.lock .venv/bin/python bench/heal_recovery.py --runs 2 --nproc 3 --min-nproc 2 \
        --kills 5 --join --every-steps 5 --out bench-out/heal-join

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
from ringtrain.testing.heal_cycles import kill_and_join  # noqa: E402 - the chaos tests' kills and joins
from ringtrain.testing.jobs import Job, records  # noqa: E402 - the chaos tests' job harness

SETS = ["--set", "train.global_batch_size=96", "--set", "train.local_batch_size=8", "--set", "data.ledger=true",
        "--set", "monitor.log_every_steps=1", "--set", "monitor.progress=false", "--set", "dist.timeout_s=20",
        "--set", "checkpoint.every_steps=1000", "--set", "train.epochs=30"]


def one_run(run_dir: Path, nproc: int, min_nproc: int, every_steps: int, kills: int, join: bool) -> list[dict]:
    with Job("train", "configs/digits_mlp.toml", "--nproc", str(nproc), "--min-nproc", str(min_nproc), "--heal",
             "--run-dir", str(run_dir), *SETS) as job:
        joiners = kill_and_join(job, run_dir, kills, every_steps, join=join)
        code = job.finish()
        join_codes = [joiner.finish() for joiner in joiners]
        for joiner in joiners:
            joiner.__exit__(None, None, None)
    if code != 0:
        raise SystemExit(f"run {run_dir} exited with {code}:\n{job.stderr}")
    if joiners and 0 not in join_codes:
        raise SystemExit(f"run {run_dir}: no joiner trained to the end ({join_codes}):\n{joiners[-1].stderr}")
    if not all(r.exactly_once and r.complete for r in check_ledger(run_dir / "ledger.jsonl")):
        raise SystemExit(f"run {run_dir}: the ledger does not show every sample exactly once (ringtrain ledger)")
    return records(run_dir, "heal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--min-nproc", type=int, default=1)
    parser.add_argument("--every-steps", type=int, default=15, help="steps between kills")
    parser.add_argument("--kills", type=int, default=None, help="kills per run (default: down to --min-nproc)")
    parser.add_argument("--join", action="store_true", help="a `ringtrain join` worker after every kill but the last")
    parser.add_argument("--out", default="bench-out/heal")
    args = parser.parse_args()
    kills = args.kills if args.kills is not None else args.nproc - args.min_nproc
    if not args.join and kills > args.nproc - args.min_nproc:
        parser.error(f"--kills {kills} would take {args.nproc} workers below --min-nproc {args.min_nproc}; add --join")
    out = Path(args.out)
    heals: list[dict] = []
    started = time.monotonic()
    for run in range(args.runs):
        run_dir = out / "runs" / f"run-{run}-{int(time.time())}"
        found = one_run(run_dir, args.nproc, args.min_nproc, args.every_steps, kills, args.join)
        print(f"run {run}: " + ", ".join(f"step {h['step']} {h['world_size'] + len(h['lost_ranks'])}->"
                                         f"{h['world_size']} {h['recovery_s']:.2f} s (lost {h['steps_lost']})" for h in found), flush=True)
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
        "joins": args.join,
        "kills_per_run": kills,
        "exactly_once": True,  # every run's ledger was checked (a run that fails the check stops the bench)
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
