"""A `ringtrain join` under an armed job is never armed (ringtrain/testing/faults.py): the fault plan is for the
workers the test launched, and a joiner that inherits the variable from its shell drops it.

A --heal job of 3 workers runs armed with two kills: the launched rank 2 in step 3 (so the job has room), and
any worker whose member id is the first joiner's (1001) at its first micro-batch. `ringtrain join` starts with
the plan's variable in its environment and is admitted after the heal. Were it armed, the second kill would
fire in it; instead only the first fires, the joiner trains to the end, and no armed process ever had its id.

The two survivors hold (SIGSTOP themselves, a ``stop`` fault) at step 6 until the joiner has asked to join, then
the test lets them go on: the job cannot finish before a joiner that is slow to start (a busy machine) asks.
Before, it raced the job's length and lost beside other work ("nothing to join").
"""

from __future__ import annotations

import pytest

from ringtrain.heal.membership import JOINER_BASE
from tests.jobs import Job, ledger_steps, records
from tests.faults import Fault, fault_plan

# Beside other tests: the survivors hold until the joiner asked (above), so no race is left to run alone for.
# A job of a launcher, agents and workers (each importing torch) took minutes to start beside other tests at
# load 25 on two cores: more than the suite's 300 s a test.
pytestmark = [pytest.mark.job, pytest.mark.timeout(900)]
JOINER_STARTUP_S = 300
"""How long the joiner may take to ask (a Python process importing torch; over 90 s beside busy processes)."""

SETS = ["train.global_batch_size=96", "train.local_batch_size=16", "train.epochs=2", "data.ledger=true",
        "monitor.log_every_steps=1", "dist.timeout_s=20", "checkpoint.every_steps=1000"]


HOLD_STEP = 6


def test_a_joiner_that_inherits_the_fault_plan_is_not_armed(tmp_path):
    run_dir = tmp_path / "run"
    joiner_id = JOINER_BASE + 1
    plan = fault_plan(tmp_path, Fault("step.micro_batch", member=2, step=3),
                      *(Fault("step.micro_batch", member=m, step=HOLD_STEP, action="stop") for m in (0, 1)),
                      Fault("step.micro_batch", member=joiner_id))
    sets = [arg for value in SETS for arg in ("--set", value)]
    with Job("train", "configs/debug_mlp.toml", "--nproc", "3", "--min-nproc", "2", "--heal", "--run-dir",
             str(run_dir), *sets, env=plan.env) as job:
        job.wait_for(lambda: job.held() == 2, what=f"the two survivors to hold at step {HOLD_STEP}")
        with Job("join", str(run_dir), env=plan.env) as joiner:  # the variable, as a shell would hand it on
            joiner.wait_for(lambda: f"asked to join as member {joiner_id}" in joiner.stderr, timeout=JOINER_STARTUP_S,
                            what="the join request")
            job.resume_workers()
            code = job.finish()
            join_code = joiner.finish(timeout=60)
    logs = f"{job.stderr}\n[joiner]\n{joiner.stderr}"
    assert code == 0 and join_code == 0, logs
    fired = sorted((f["point"], f["member"], f["step"]) for f in plan.fired())
    assert fired == [("step.micro_batch", m, s) for m, s in ((0, HOLD_STEP), (1, HOLD_STEP), (2, 3))], (fired, logs)
    heals, joins = records(run_dir, "heal"), records(run_dir, "join")
    assert [h["lost_ranks"] for h in heals] == [[2]] and [j["joined_ranks"] for j in joins] == [[2]], logs
    # The joiner trained (the ledger's steps after its admission have 3 ranks) and was never armed.
    assert [r["world_size"] for r in ledger_steps(run_dir)][-1] == 3, logs
    armed = {r["member"] for r in plan.reached()}
    assert armed == {0, 1, 2}, f"armed processes had member ids {sorted(armed)}: the joiner {joiner_id} was armed"
