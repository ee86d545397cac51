"""Chaos 2 and 7: a worker killed (SIGKILL) or stopped (SIGSTOP) in the middle of a real `ringtrain train` job.

2. SIGKILL one worker at a random step with --max-restarts 1: the job restarts from the last checkpoint and
   finishes with exit 0 and the same final parameters as an uninterrupted run; steps lost <= checkpoint
   interval. With no restart left: a non-zero exit whose last line names the killed rank.
7. SIGSTOP a worker with dist.timeout_s = 10: the other fails within 20 s, naming the rank, the operation
   and the step, and the job exits instead of hanging.
"""

from __future__ import annotations

import random
import re
import signal
import time

import torch

from tests.chaos.jobs import Job, last_step, records
from tests.conftest import run_cli

# Long enough to be hit mid-run (4 epochs, 92 steps), checkpoints every 10 steps, a record per step.
JOB = ["configs/debug_mlp.toml", "--nproc", "2", "--set", "train.epochs=4", "--set", "monitor.log_every_steps=1",
       "--set", "checkpoint.every_steps=10", "--set", "model.hidden_sizes=[256, 256]"]


def final_params(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "step_00000092.pt", weights_only=True)["model"]


def test_sigkill_at_a_random_step_restarts_and_finishes_as_if_nothing_happened(tmp_path):
    straight, chaos = tmp_path / "straight", tmp_path / "chaos"
    reference = run_cli("train", *JOB, "--run-dir", str(straight))
    assert reference.returncode == 0, reference.stderr

    target, rank = random.randint(12, 60), random.randint(0, 1)
    with Job("train", *JOB, "--run-dir", str(chaos), "--max-restarts", "1") as job:
        job.wait_for(lambda: last_step(chaos) >= target, what=f"step {target}")
        killed_at = last_step(chaos)
        job.worker(rank).kill()
        code = job.finish()
        assert code == 0, job.stderr
    [resumed] = records(chaos, "resume")
    print(f"SIGKILL rank {rank} at step {killed_at}: restart took {resumed['restart_s']:.1f} s, "
          f"steps lost {resumed['steps_lost']} (checkpoint every 10), resumed from {resumed['checkpoint']}")
    assert resumed["restart"] == 1 and resumed["world_size"] == 2
    assert 0 <= resumed["steps_lost"] <= 10
    assert resumed["step"] + resumed["steps_lost"] >= killed_at
    steps = [r["step"] for r in records(chaos, "train")]
    assert sorted(set(steps)) == list(range(1, 93)), "a step is missing from the metrics"
    want, got = final_params(straight), final_params(chaos)
    assert all(torch.equal(want[name], got[name]) for name in want), "final parameters differ from the uninterrupted run"


def test_sigkill_with_no_restart_left_fails_naming_the_rank(tmp_path):
    run_dir = tmp_path / "run"
    with Job("train", *JOB, "--run-dir", str(run_dir), "--max-restarts", "0") as job:
        job.wait_for(lambda: last_step(run_dir) >= 5, what="step 5")
        pid = job.worker(1).pid
        job.worker(1).kill()
        code = job.finish()
    last = job.stderr.strip().splitlines()[-1]
    print(f"restarts exhausted: exit {code}: {last}")
    assert code != 0
    assert last.startswith(f"ringtrain: error: worker rank 1 (local rank 1, pid {pid}) was killed by SIGKILL"), job.stderr


def test_sigstop_makes_the_others_fail_within_the_timeout_naming_rank_operation_and_step(tmp_path):
    run_dir = tmp_path / "run"
    args = [*JOB, "--set", "train.epochs=100", "--set", "dist.timeout_s=10", "--run-dir", str(run_dir)]
    with Job("train", *args) as job:
        job.wait_for(lambda: last_step(run_dir) >= 10, what="step 10")
        stopped = job.worker(1)
        stopped.suspend()  # SIGSTOP
        stopped_at = time.monotonic()
        seen, line = job.wait_for_line("did not respond", timeout=60)
        latency = seen - stopped_at
        print(f"SIGSTOP rank 1: detected in {latency:.1f} s (timeout_s = 10): {line}")
        assert latency < 20
        # Whichever collective rank 0 was in: the DDP gradient all-reduce, the step agreement, a checkpoint's gather.
        assert re.search(r"\[rank 0\] step \d+: (all_reduce|gather|all_gather) \(.+\) failed: rank 1 did not "
                         r"respond within 10 s", line), line
        # The agent now asks rank 1 to stop (SIGTERM, held while it is stopped); let it receive it.
        stopped.send_signal(signal.SIGCONT)
        code = job.finish(timeout=60)
    exited = time.monotonic() - stopped_at
    print(f"job exited {exited:.1f} s after the SIGSTOP with code {code}")
    assert code != 0
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith("ringtrain: error: worker rank 0") and "rank 1 did not respond" in last, job.stderr
