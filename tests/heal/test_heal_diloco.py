"""Chaos: DiLoCo under --heal (issue 24). A worker lost mid-inner-phase and one lost inside an outer sync are
healed in place: the survivors go back to the model of the last outer step (what each learned since is dropped
and the heal's record says how many steps), the outer state goes on, and a joiner receives the global model and
the outer state. Each job checks exit 0, every sample dealt exactly once (the ledger) and one model on every
rank at the end."""

from __future__ import annotations

import pytest

from tests.jobs import Job, ledger_steps, records
from tests.heal.test_heal_compound import assert_exactly_once, hold, sets, start_joiners_while_held
from tests.faults import Fault, fault_plan
from tests.runs import summary

pytestmark = pytest.mark.job

H = 5
DILOCO = ["--set", "comm.strategy=diloco", "--set", f"diloco.sync_every={H}", "--set", "diloco.outer_lr=0.7",
          "--set", "diloco.outer_momentum=0.9"]


def test_workers_lost_mid_inner_phase_and_inside_an_outer_sync_are_healed_from_the_last_outer_step(tmp_path):
    """4 workers, --min-nproc 2, H = 5. Member 3 dies in step 8 (two inner steps after the outer step of step
    5); member 2 dies in step 15's outer sync, its pseudo-gradient taken, before its exchange."""
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, Fault("step.micro_batch", member=3, step=8),
                      Fault("diloco.exchange", member=2, step=15))
    with Job("train", "configs/digits_mlp.toml", "--nproc", "4", "--min-nproc", "2", "--heal", "--run-dir",
             str(run_dir), *sets(epochs=2), *DILOCO, env=plan.env) as job:
        code = job.finish(timeout=240)
    assert code == 0, job.stderr
    assert plan.fired_points() == ["step.micro_batch", "diloco.exchange"], plan.fired_points()
    heals = records(run_dir, "heal")
    print(f"heals: {[(h['step'], h['lost_ranks'], h['from_step'], h['inner_steps_dropped']) for h in heals]}")
    assert [h["step"] for h in heals] == [8, 15] and [h["world_size"] for h in heals] == [3, 2], heals
    # Step 8 failed (7 applied): inner steps 6-7 dropped. Step 15 failed in its outer sync (its inner step was
    # applied, not committed): inner steps 11-15 dropped, and step 15 is trained again by the two survivors.
    assert [h["inner_steps_dropped"] for h in heals] == [2, 5], heals
    assert [h["from_step"] for h in heals] == [7, 14], heals
    # Every survivor went back to the same model on its own (the last outer step's): none needed another's state.
    assert [h["rolled_forward"] for h in heals] == [False, False], heals
    done = summary(run_dir)
    assert done["world_size"] == 2 and done["steps"] == 2 * 15 and done["heals"] == 2
    assert len(set(done["param_sha256"])) == 1  # one model on every rank at the end
    assert_exactly_once(run_dir, epochs=2)


@pytest.mark.timeout(900)  # beside other tests at load 25 a job with joiners took minutes to start
def test_a_joiner_receives_the_global_model_and_the_outer_state(tmp_path):
    """3 workers, H = 5, the job full; a worker asks to join, then member 2 is lost. The joiner is admitted
    after a whole outer step of the two (no inner progress lost) and starts from the global model with the same
    outer state (global copy, momentum): had it started from its own, its outer steps would move another model
    and the ranks would end on different parameters."""
    run_dir = tmp_path / "run"
    # The workers hold at step 2 until the joiner asked (it was a paced 4-epoch job, raced by the joiner), and
    # member 2 dies in step H + 2: after an outer step (the outer state has momentum to hand on; a kill at once
    # can land while the group starts, healed too in tests/heal/test_heal_start.py, before any outer step).
    epochs = 2
    plan = fault_plan(tmp_path, *hold(range(3), step=2), Fault("step.micro_batch", member=2, step=H + 2))
    with Job("train", "configs/digits_mlp.toml", "--nproc", "3", "--min-nproc", "1", "--heal", "--run-dir",
             str(run_dir), *sets(epochs=epochs), *DILOCO, env=plan.env) as job:
        (joiner,) = start_joiners_while_held(job, run_dir, count=1, holding=3)
        try:
            code = job.finish(timeout=240)
            join_code = joiner.finish(timeout=60)
        finally:
            joiner.__exit__(None, None, None)
    assert code == 0 and join_code == 0, job.stderr + joiner.stderr
    joins = records(run_dir, "join")
    assert len(joins) == 1 and joins[0]["world_size"] == 3, joins
    done = summary(run_dir)
    assert done["world_size"] == 3 and len(done["param_sha256"]) == 3 and len(set(done["param_sha256"])) == 1, done
    assert done["outer_steps"] >= done["steps"] // H, done  # the run's count went on (+1 for an admission's sync)
    assert len(ledger_steps(run_dir)) == epochs * 15
    assert_exactly_once(run_dir, epochs=epochs)
