"""Chaos 5 with background sharded checkpoints: an elastic job saving `[checkpoint] async = true` loses the
agent of rank 1 mid-epoch; the lone worker resumes from the newest committed sharded checkpoint, resharded
from 2 workers to 1, and every sample of the epoch is used exactly once."""

from __future__ import annotations

from ringtrain.checkpoint.sharded import committed, verify
from ringtrain.data.ledger import check_ledger
from tests.chaos.jobs import Job, last_step, ledger_steps, records

ARGS = ["configs/debug_mlp.toml", "--nproc", "2", "--min-nproc", "1", "--max-restarts", "3",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--set", "data.ledger=true", "--set", "train.epochs=1", "--set", "checkpoint.every_steps=5",
        "--set", "checkpoint.async=true", "--set", "monitor.log_every_steps=1", "--set", "model.hidden_sizes=[256, 256]"]


def test_a_shrink_resumes_from_a_background_sharded_checkpoint_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    with Job("train", *ARGS, "--run-dir", str(run_dir)) as job:
        job.wait_for(lambda: last_step(run_dir) >= 8, what="step 8")
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
