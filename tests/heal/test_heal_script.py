"""Chaos: heal in place for a user's script. `ringtrain run SCRIPT --nproc 3 --min-nproc 2 --heal` (the
script calls ringtrain.fit()): a worker is SIGKILLed, the other two heal; `ringtrain join RUN_DIR` starts the
same script, whose fit() asks to be admitted and receives the running workers' state at a step boundary;
then a second launched worker is killed and the joiner trains on to the end: 3 -> 2 -> 3 -> 2, every sample
once, 0 steps lost, equal parameters.
"""

from __future__ import annotations

import json

import pytest

from ringtrain.data.ledger import check_ledger
from tests.heal.heal_cycles import kill_and_join
from tests.jobs import Job, ledger_steps, records
from tests.faults import Fault, fault_plan

# Beside other tests: the launched workers hold at step 2 until the joiner asked (kill_and_join's hold), so a
# joiner slow to start cannot meet a finished job (it was an 8-epoch job that the joiner raced, run alone).
# A job of a launcher, agents and workers (each importing torch) took minutes to start beside other tests at
# load 25 on two cores: more than the suite's 300 s a test.
pytestmark = [pytest.mark.job, pytest.mark.timeout(900)]

SCRIPT = "tests/user_code.py"
EPOCHS = 3
CONFIG = json.dumps({"train": {"epochs": EPOCHS, "global_batch_size": 96, "local_batch_size": 16},
                     "data": {"ledger": True}, "checkpoint": {"every_steps": 1000},
                     "monitor": {"log_every_steps": 1}, "dist": {"timeout_s": 20}})


def test_a_script_job_heals_and_admits_a_joiner_running_the_same_script(tmp_path):
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, *(Fault("ledger.gathered", action="stop", member=m, step=2) for m in range(3)))
    with Job("run", SCRIPT, "--nproc", "3", "--min-nproc", "2", "--heal", "--run-dir", str(run_dir), "--",
             "--case", "oracle", "--config", CONFIG, worker_command=SCRIPT, env=plan.env) as job:
        joiners = kill_and_join(job, run_dir, kills=2, steps_between=3, join=True, victims=("launched", "launched"),
                                hold=True)
        code = job.finish()
        join_codes = [joiner.finish(timeout=60) for joiner in joiners]
        for joiner in joiners:
            joiner.__exit__(None, None, None)
    logs = job.stderr + "".join(f"\n[joiner]\n{j.stderr}" for j in joiners)
    heals, joins = records(run_dir, "heal"), records(run_dir, "join")
    print(f"script job: heals at steps {[h['step'] for h in heals]} (recovery_s {[h['recovery_s'] for h in heals]}), "
          f"join after step {joins[0]['step'] if joins else None}")
    assert code == 0 and join_codes == [0], logs
    assert "joined as rank 2 of 3" in joiners[0].stderr, logs
    assert len(heals) == 2 and len(joins) == 1 and all(h["steps_lost"] == 0 for h in heals), logs
    sizes = [r["world_size"] for r in ledger_steps(run_dir)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [3, 2, 3, 2]
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert len(reports) == EPOCHS and all(r.exactly_once and r.complete for r in reports)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heals"] == 2 and summary["world_size"] == 2 and len(set(summary["param_sha256"])) == 1
