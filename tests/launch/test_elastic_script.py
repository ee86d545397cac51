"""Chaos 5 and 6 for a user's script: `ringtrain run SCRIPT --nproc 2 --min-nproc 1` shrinks when a worker's
agent is lost and grows when `ringtrain join RUN_DIR` adds a worker, which starts the same script with the
same arguments, folder and overrides (job.json's program); every sample of every epoch is used once.

The choreography is test_elastic.py's: the lone worker is paused while the joining agent starts and resumed
once its agent asked it to stop for the newcomer, so the join lands mid-run on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from ringtrain.data.ledger import check_ledger
from tests.jobs import Job, last_step, ledger_steps, records
from tests.launch.test_elastic import sigterm_pending

pytestmark = pytest.mark.job

SCRIPT = "tests/user_code.py"
CONFIG = json.dumps({"train": {"epochs": 3}, "data": {"ledger": True}, "checkpoint": {"every_steps": 5},
                     "monitor": {"log_every_steps": 1}})
ARGS = ["run", SCRIPT, "--nproc", "2", "--min-nproc", "1", "--max-restarts", "3",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"]


def test_a_script_job_shrinks_and_grows_with_join_using_every_sample_once(tmp_path):
    run_dir = tmp_path / "run"
    with Job(*ARGS, "--run-dir", str(run_dir), "--", "--case", "oracle", "--config", CONFIG,
             worker_command=SCRIPT) as job, contextlib.ExitStack() as joined:
        job.wait_for(lambda: last_step(run_dir) >= 8, what="step 8")
        job.agent_of(1).kill()
        job.wait_for(lambda: any(r["world_size"] == 1 for r in ledger_steps(run_dir)), what="a step with 1 worker")
        lone = job.worker(0)
        lone.suspend()
        joiner = joined.enter_context(Job("join", str(run_dir), worker_command=SCRIPT))
        job.wait_for(lambda: sigterm_pending(lone.pid), what="the agent to ask the lone worker to stop")
        lone.resume()
        code = job.finish()
        join_code = joiner.finish(timeout=60)
        stderr = job.stderr + "\n[join]\n" + joiner.stderr
    assert code == 0 and join_code == 0, stderr
    sizes = [r["world_size"] for r in ledger_steps(run_dir)]
    transitions = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert transitions == [2, 1, 2], transitions
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert len(reports) == 3 and all(r.exactly_once and r.complete for r in reports)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["param_sha256"])) == 1
    grow = records(run_dir, "resume")[-1]
    print(f"script job 2 -> 1 -> 2: grew at step {grow['step']}, {grow['steps_lost']} steps lost; "
          f"{len(reports)} epochs exactly once")
