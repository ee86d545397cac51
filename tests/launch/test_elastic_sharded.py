"""Chaos 5 and 6 with sharded checkpoints: an elastic job saving `[checkpoint] async = true` loses the agent
of rank 1 mid-epoch; the lone worker resumes from the newest committed sharded checkpoint, resharded from 2
workers to 1, and every sample of the epoch is used exactly once. And the grow: a zero2 job with
`[checkpoint] sharded = true` shrinks to 1 worker, then `ringtrain join` brings a second one mid-epoch; the
lone worker checkpoints its stretches (all of them, alone) and both workers resume from that checkpoint,
resharded 1 -> 2, losing no step, every sample once, both ranks ending with the same parameters."""

from __future__ import annotations

import contextlib
import json

import pytest

from ringtrain.checkpoint.sharded import committed, verify
from ringtrain.data.ledger import check_ledger
from tests.jobs import Job, last_step, ledger_steps, records
from tests.launch.test_elastic import join_mid_epoch

pytestmark = pytest.mark.job

ARGS = ["configs/debug_mlp.toml", "--nproc", "2", "--min-nproc", "1", "--max-restarts", "3",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--set", "data.ledger=true", "--set", "train.epochs=1", "--set", "checkpoint.every_steps=5",
        "--set", "checkpoint.async=true", "--set", "monitor.log_every_steps=1", "--set", "model.hidden_sizes=[256, 256]"]


def test_a_shrink_resumes_from_a_background_sharded_checkpoint_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    # 45 steps (not 23): under load the first background save committed only as the job reached its last step,
    # and the kill then found a job that was finishing (a full run beside other jobs).
    with Job("train", *ARGS, "--set", "train.global_batch_size=32", "--run-dir", str(run_dir)) as job:
        # A background save commits later than its step: wait for one (under load step 8 may come first).
        job.wait_for(lambda: last_step(run_dir) >= 8 and committed(run_dir / "checkpoints"),
                     what="step 8 and a committed checkpoint")
        job.agent_of(1).kill()
        job.wait_for(lambda: any(r["world_size"] == 1 for r in ledger_steps(run_dir)), what="a step with 1 worker")
        code = job.finish()
    assert code == 0, job.stderr
    [shrink] = records(run_dir, "resume")
    assert shrink["world_size"] == 1 and shrink["checkpoint"].endswith(".dcp"), shrink
    [epoch] = check_ledger(run_dir / "ledger.jsonl")
    saves = records(run_dir, "checkpoint")
    print(f"2 -> 1 from {shrink['checkpoint']} (saved by 2 workers in the background), steps lost "
          f"{shrink['steps_lost']}; epoch 0: {epoch.duplicates} duplicates, {epoch.missing} missing over world sizes "
          f"{epoch.world_sizes}; {len(saves)} background saves")
    assert epoch.world_sizes == (2, 1) and (epoch.duplicates, epoch.missing) == (0, 0)
    assert all(s["async"] and s["sharded"] for s in saves)
    for path in committed(run_dir / "checkpoints"):
        verify(path)


def test_a_zero2_job_grows_from_one_to_two_through_a_sharded_checkpoint_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    args = list(ARGS)
    args[args.index("checkpoint.async=true")] = "checkpoint.sharded=true"
    args += ["--set", "comm.strategy=zero2", "--set", "comm.bucket_mb=0.05"]
    with Job("train", *args, "--run-dir", str(run_dir)) as job, contextlib.ExitStack() as joined:
        job.wait_for(lambda: last_step(run_dir) >= 6, what="step 6")
        job.agent_of(1).kill()  # 2 -> 1 first: the job starts with both of its workers
        joiner = join_mid_epoch(job, run_dir, joined, latest=18)  # 1 -> 2 mid-epoch
        code = job.finish()
        join_code = joiner.finish(timeout=60)
    assert code == 0 and join_code == 0, job.stderr + "\n[join]\n" + joiner.stderr
    shrink, grow = records(run_dir, "resume")
    assert shrink["world_size"] == 1 and grow["world_size"] == 2, (shrink, grow)
    assert grow["checkpoint"].endswith(".dcp") and grow["steps_lost"] == 0, grow
    sizes = [r["world_size"] for r in ledger_steps(run_dir)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [2, 1, 2]
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert len(reports) == 1 and all(r.exactly_once and r.complete for r in reports), reports
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["param_sha256"])) == 1, summary["param_sha256"]
    assert not list((run_dir / "checkpoints").glob("*.pt")), "a sharded run wrote a full checkpoint"
    for path in committed(run_dir / "checkpoints"):
        verify(path)
    print(f"zero2, sharded: 2 -> 1 from {shrink['checkpoint']}, 1 -> 2 from {grow['checkpoint']} at step "
          f"{grow['step']} (steps lost {grow['steps_lost']}); every sample of the epoch once")
