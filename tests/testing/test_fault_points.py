"""Every declared fault point is reached by real jobs (ringtrain/testing/faults.py): a point whose line was
removed from the code, or moved where training no longer passes, fails here instead of silently disarming
the chaos tests that place faults there.

Two small `ringtrain train` jobs at once, 2 workers each, armed with one plan that observes every point (the
action ``observe`` only records; it also puts the shm job on its Python path, where ``shm.arrive`` sits):
the ring all-reduce with full checkpoints, and the shm all-reduce with sharded checkpoints; both keep the
sample ledger. Also: a plan naming an unknown point stops a launched job's worker with one line.
"""

from __future__ import annotations

import pytest

from ringtrain.group.env import FAULT_PLAN_ARMED_VAR, FAULT_PLAN_VAR
from ringtrain.testing.faults import OPT_IN_PREFIX, POINTS
from tests.conftest import REPO, run_cli, run_clis
from tests.faults import Fault, fault_plan

# Points only a heal or an admission reaches: each is placed by a chaos test that asserts its fault fired (so
# a point removed from the code fails there), instead of healing a job here.
PROVEN_ELSEWHERE = {
    "heal.form": "tests/heal/test_heal_compound.py",
    "heal.settle": "tests/heal/test_heal_compound.py",
    "heal.planned": "tests/heal/test_heal_compound.py",
    "heal.transfer": "tests/heal/test_heal_state.py",
    "heal.finished": "tests/heal/test_heal_compound.py",
    "diloco.exchange": "tests/heal/test_heal_diloco.py",  # the ring and shm job above trains with ddp
}

JOB = ["train", "configs/debug_mlp.toml", "--nproc", "2", "--set", "train.max_steps=4",
       "--set", "checkpoint.every_steps=2", "--set", "data.ledger=true", "--set", "comm.strategy=manual"]


@pytest.mark.job
def test_every_declared_fault_point_is_reached_by_a_ring_and_an_shm_job(tmp_path):
    plan = fault_plan(tmp_path, *(Fault(name, action="observe") for name in POINTS))
    ring, shm = run_clis(
        [*JOB, "--run-dir", str(tmp_path / "ring"), "--set", "comm.algorithm=ring"],
        [*JOB, "--run-dir", str(tmp_path / "shm"), "--set", "comm.algorithm=shm", "--set", "checkpoint.sharded=true"],
        env=plan.env)
    assert ring.returncode == 0, ring.stderr
    assert shm.returncode == 0, shm.stderr
    reached = plan.reached()
    missing = sorted(set(POINTS) - set(PROVEN_ELSEWHERE) - {r["point"] for r in reached})
    assert not missing, f"declared fault points no job reached: {missing} (is their faults.point line still in place?)"
    # Every worker was armed (launched ranks 0 and 1 of each job) and knew its step where it trained.
    assert {(r["member"], r["rank"]) for r in reached} == {(0, 0), (1, 1)}
    assert {r["step"] for r in reached if r["point"] in ("ring.step", "ledger.gathered", "step.micro_batch")} == {1}


@pytest.mark.job
def test_a_plan_naming_an_unknown_point_stops_the_worker_in_one_line(tmp_path):
    plan = tmp_path / "faults.json"
    opt_in = OPT_IN_PREFIX + "5" * 32  # written by hand: the test's opt-in with it, as write_plan would
    plan.write_text(f'{{"opt_in": "{opt_in}", "faults": [{{"point": "ring.run_step", "action": "kill"}}]}}\n')  # renamed
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                     env={FAULT_PLAN_VAR: str(plan), FAULT_PLAN_ARMED_VAR: opt_in})
    # A usage error of every worker: the launcher prints the worker's line once, exit code 2; no traceback;
    # nothing trained.
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ringtrain: error:")]
    assert len(errors) == 1 and "unknown fault point 'ring.run_step'" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "metrics.jsonl").exists(), result.stderr


@pytest.mark.job
def test_a_plan_a_production_run_inherits_without_the_tests_opt_in_arms_nothing(tmp_path):
    """Issue 39, row 10: RINGTRAIN_FAULT_PLAN alone in a run's environment (a CI runner's, a shell's) used to end
    the job at the named point; now the run trains to its end, with one warning line. (The same plan beside its
    opt-in, plan.env, arms the job: the test above, and every chaos test.)"""
    plan = fault_plan(tmp_path, Fault("train.evaluate", action="exit", code=3))
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "1", "--set", "train.max_steps=2",
                     "--run-dir", str(tmp_path / "run"), env={FAULT_PLAN_VAR: str(plan.path)})
    assert result.returncode == 0, result.stderr
    assert plan.fired() == [] and plan.reached() == []
    warnings = [line for line in result.stderr.splitlines() if "fault plan" in line]
    assert warnings == [f"ringtrain: warning: fault plan {plan.path} ignored: RINGTRAIN_FAULT_PLAN is a test facility "
                        "and is armed only beside its test's opt-in (RINGTRAIN_FAULT_PLAN_ARMED, equal to the plan's "
                        "opt_in); unset RINGTRAIN_FAULT_PLAN"], result.stderr


@pytest.mark.unit
def test_the_points_only_a_heal_reaches_are_placed_by_a_test_that_asserts_they_fired():
    for name, test_file in PROVEN_ELSEWHERE.items():
        assert name in POINTS, f"{name} is not a declared point any more: drop it from PROVEN_ELSEWHERE"
        text = (REPO / test_file).read_text()
        assert f'Fault("{name}"' in text and "fired" in text, f"{test_file} no longer places {name} and checks it fired"
