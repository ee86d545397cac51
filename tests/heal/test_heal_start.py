"""Chaos: a worker lost while a --heal job starts (issue 21: "any failure at any moment"). Before the first
step the workers run collectives too: DDP's broadcast of rank 0's state as the strategy wraps the model, the
resume's agreement on one checkpoint and the check whether the run had finished. A worker lost there is healed
like one lost in a step (heal/supervisor.py ``start``): the survivors form the next generation and a resume
still continues from its checkpoint. Seen before: a kill right after start-up ended the job with a raw Gloo
error, exit 1 (CI, the joiner test of test_heal_diloco.py on an idle machine)."""

from __future__ import annotations

import pytest

from tests.jobs import Job, records
from tests.heal.test_heal_compound import assert_exactly_once, sets
from tests.faults import Fault, fault_plan
from tests.runs import summary

pytestmark = pytest.mark.job


def test_a_worker_lost_while_the_strategy_wraps_the_model_is_healed(tmp_path):
    """3 workers, --min-nproc 2: member 2 dies before DDP's first broadcast; the two others heal before any
    step and train the whole run."""
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, Fault("train.wrap", member=2))
    with Job("train", "configs/digits_mlp.toml", "--nproc", "3", "--min-nproc", "2", "--heal", "--run-dir",
             str(run_dir), *sets(epochs=1), env=plan.env) as job:
        code = job.finish(timeout=180)
    assert code == 0, job.stderr
    assert plan.fired_points() == ["train.wrap"]
    heals = records(run_dir, "heal")
    assert [(h["step"], h["lost_ranks"], h["world_size"], h["from_step"]) for h in heals] == [(1, [2], 2, 0)], heals
    done = summary(run_dir)
    assert done["world_size"] == 2 and done["heals"] == 1 and len(set(done["param_sha256"])) == 1, done
    assert_exactly_once(run_dir, epochs=1)


def test_a_worker_lost_while_a_resume_agrees_on_its_checkpoint_is_healed_and_the_resume_goes_on(tmp_path):
    """A run of one epoch (checkpoints every 5 steps) is resumed for a second with 3 workers; member 2 dies as
    the resume starts, while the others agree which checkpoint to load. The two survivors load it in their new
    group: the run goes on from step 15, nothing trained twice (without the resume again they would start over
    at step 0 and the ledger would deal epoch 1 twice)."""
    run_dir = tmp_path / "run"
    args = ["train", "configs/digits_mlp.toml", "--nproc", "3", "--min-nproc", "2", "--heal", "--run-dir",
            str(run_dir)]
    with Job(*args, *sets(epochs=1, **{"checkpoint.every_steps": "5"})) as first:
        assert first.finish(timeout=180) == 0, first.stderr
    plan = fault_plan(tmp_path, Fault("train.resume", member=2))
    with Job(*args, "--resume", *sets(epochs=2, **{"checkpoint.every_steps": "5"}), env=plan.env) as job:
        code = job.finish(timeout=180)
    assert code == 0, job.stderr
    assert plan.fired_points() == ["train.resume"]
    heals = records(run_dir, "heal")
    assert [(h["step"], h["lost_ranks"], h["world_size"], h["from_step"]) for h in heals] == [(16, [2], 2, 15)], heals
    resumes = records(run_dir, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] == 15, resumes  # one start counted, one record
    done = summary(run_dir)
    assert done["world_size"] == 2 and done["steps"] == 30 and len(set(done["param_sha256"])) == 1, done
    assert_exactly_once(run_dir, epochs=2)
