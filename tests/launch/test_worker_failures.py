"""Chaos 2 and 7: a worker killed (SIGKILL) or stopped (SIGSTOP) in the middle of a real `ringtrain train` job.

2. SIGKILL one worker at a random step with --max-restarts 1: the job restarts from the last checkpoint and
   finishes with exit 0 and the same final parameters as an uninterrupted run; steps lost <= checkpoint
   interval. With no restart left: a non-zero exit whose last line names the killed rank.
7. SIGSTOP a worker with dist.timeout_s = 10: the other fails within 20 s, naming the rank, the operation
   and the step, and the job exits instead of hanging.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time

import numpy as np
import pytest
import torch

from ringtrain.data.ledger import check_ledger
from tests.jobs import Job, last_step, records
from tests.conftest import run_cli, run_main
from tests.distributed import run_distributed
from tests.trainers import train_uninterrupted

pytestmark = pytest.mark.job

# Long enough to be hit mid-run (4 epochs, 92 steps), checkpoints every 10 steps, a record per step.
CONFIG = "configs/debug_mlp.toml"
OVERRIDES = ["train.epochs=4", "monitor.log_every_steps=1", "checkpoint.every_steps=10", "model.hidden_sizes=[256, 256]"]
JOB = [CONFIG, "--nproc", "2", *(arg for override in OVERRIDES for arg in ("--set", override))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """Final parameters of the job trained in one go, in-process (the ledger, off here, changes no number)."""
    return run_distributed(train_uninterrupted, 2, CONFIG, OVERRIDES, str(tmp_path_factory.mktemp("reference")))[0]


def assert_same_as_uninterrupted(run_dir, want: dict) -> None:
    """The job's final parameters equal those of the uninterrupted run, bit for bit."""
    got = torch.load(run_dir / "checkpoints" / "step_00000092.pt", weights_only=True)["model"]
    differing = [name for name in want if not np.array_equal(want[name], got[name].numpy())]
    assert not differing, f"final parameters differ from the uninterrupted run: {differing}"


def test_sigkill_at_a_random_step_restarts_and_finishes_as_if_nothing_happened(tmp_path, uninterrupted):
    chaos = tmp_path / "chaos"

    target, rank = random.randint(12, 50), random.randint(0, 1)
    with Job("train", *JOB, "--run-dir", str(chaos), "--max-restarts", "1") as job:
        victim = job.worker(rank)  # found before the target step, so the kill follows it by milliseconds
        job.wait_for(lambda: last_step(chaos) >= target, what=f"step {target}")
        victim.kill()
        killed_at = last_step(chaos)
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
    assert_same_as_uninterrupted(chaos, uninterrupted)


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
    flight = run_dir / "flight"
    with Job("train", *args) as job:
        job.wait_for(lambda: last_step(run_dir) >= 10, what="step 10")
        # The flight recorder on request, while all is well: every rank dumps, and they agree.
        job.process.send_signal(signal.SIGUSR1)
        job.wait_for(lambda: len(list(flight.glob("rank-*.json"))) == 2, timeout=30, what="both flight dumps")
        healthy = run_main("diagnose", str(run_dir))
        print(f"SIGUSR1 to the launcher: {healthy.stdout.strip()}")
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert "ranks 0, 1 of 2 (rank 0: requested; rank 1: requested)" in healthy.stdout
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
        # Rank 0 dumped its flight recorder on the failure; rank 1, stopped, could not answer.
        job.wait_for(lambda: "did not respond" in json.loads((flight / "rank-0.json").read_text())["reason"],
                     timeout=10, what="rank 0's dump on the failure")
        hung = run_main("diagnose", str(run_dir))
        print(f"after the SIGSTOP: {hung.stdout.strip()}")
        assert hung.returncode == 1, hung.stdout + hung.stderr
        assert "rank 1 did not answer the last dump" in hung.stdout
        # The agent now asks rank 1 to stop (SIGTERM, held while it is stopped); let it receive it.
        stopped.send_signal(signal.SIGCONT)
        code = job.finish(timeout=60)
    exited = time.monotonic() - stopped_at
    print(f"job exited {exited:.1f} s after the SIGSTOP with code {code}")
    assert code != 0
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith("ringtrain: error: worker rank 0") and "rank 1 did not respond" in last, job.stderr


SPLIT = {"pp": ("configs/debug_pp.toml", (), "pipeline schedule (activations and gradients between stages)"),
         "tp": ("configs/debug_lm.toml", ("--set", "parallel.tp=-1", "--set", "train.auto_micro_batch=false"),
                "all_reduce (tensor-parallel layers in forward and backward, gradient sync)")}
"""A split model's layout -> config, settings, and what its steps wait on (the flight recorder's name for it)."""


@pytest.mark.parametrize("layout", SPLIT)
def test_a_stopped_rank_of_a_split_model_is_named_within_the_timeout_and_the_flight_recorder_shows_its_steps(
        tmp_path, layout):
    """Chaos 7 through a pipeline (pp = 2) and a tensor-parallel pair: rank 0 waits on its stopped peer wherever it
    is (the schedule's activation transfers, the split layers' all-reduces, or a collective after them) and fails
    within the timeout naming rank 1, the operation and the step; its flight recorder, dumped on the failure,
    holds the steps under their own name."""
    config, settings, operation = SPLIT[layout]
    run_dir = tmp_path / "run"
    with Job("train", config, "--nproc", "2", "--run-dir", str(run_dir), "--set", "train.max_steps=100000",
             "--set", "dist.timeout_s=10", "--set", "monitor.log_every_steps=1", *settings) as job:
        job.wait_for(lambda: last_step(run_dir) >= 5, what="step 5")
        stopped = job.worker(1)
        stopped.suspend()  # SIGSTOP
        stopped_at = time.monotonic()
        seen, line = job.wait_for_line("did not respond", timeout=60)
        print(f"SIGSTOP {layout} rank 1: detected in {seen - stopped_at:.1f} s: {line}")
        assert seen - stopped_at < 20
        assert re.search(r"\[rank 0\] step \d+: .+ failed: rank 1 did not respond within 10 s", line), line
        dump = run_dir / "flight" / "rank-0.json"
        job.wait_for(lambda: dump.exists() and "did not respond" in json.loads(dump.read_text())["reason"],
                     timeout=10, what="rank 0's dump on the failure")
        regions = {r["caller"] for r in json.loads(dump.read_text())["regions"]}
        assert operation in regions, regions
        stopped.send_signal(signal.SIGCONT)
        code = job.finish(timeout=60)
    assert code != 0
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith("ringtrain: error: worker rank 0") and "rank 1 did not respond" in last, job.stderr


def test_sigterm_to_the_launcher_saves_the_step_reached_and_the_resume_loses_nothing(tmp_path, uninterrupted):
    """Preemption: the launcher gets SIGTERM (a scheduler, or Ctrl-C as SIGINT); the workers finish the step,
    checkpoint it and exit; --resume continues from exactly there (the step counter, optimizer and data
    position restored): no step repeated or skipped, no sample twice, and the final parameters equal an
    uninterrupted run's."""
    run_dir = tmp_path / "run"
    args = [*JOB, "--set", "data.ledger=true", "--run-dir", str(run_dir)]
    with Job("train", *args) as job:
        job.wait_for(lambda: last_step(run_dir) >= 15, what="step 15")
        job.process.send_signal(signal.SIGTERM)
        code = job.finish()
    assert code == 128 + signal.SIGTERM, job.stderr
    stopped = re.search(r"\[rank 0\] stopped at step (\d+) after saving (step_\d+\.pt)", job.stderr)
    assert stopped, job.stderr
    step = int(stopped.group(1))
    assert (run_dir / "checkpoints" / stopped.group(2)).exists() and last_step(run_dir) == step
    resumed = run_cli("train", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    first_resumed = min(r["step"] for r in records(run_dir, "train") if r["step"] > step)
    reports = check_ledger(run_dir / "ledger.jsonl")
    print(f"SIGTERM at step {step}: checkpoint {stopped.group(2)}, resumed at step {first_resumed} "
          f"(steps lost 0); ledger: {sum(r.duplicates for r in reports)} duplicates, {sum(r.missing for r in reports)} missing")
    assert first_resumed == step + 1
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 93)), "steps repeated or skipped"
    assert all(r.exactly_once and r.complete for r in reports) and len(reports) == 4
    assert_same_as_uninterrupted(run_dir, uninterrupted)
