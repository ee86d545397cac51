"""Chaos: a joiner pair restores a model-parallel replica (issue 40). 4 workers as 2 tp-2 replicas (as 2 tp-2
DiLoCo replicas, and as 2 pp-2 replicas) under --heal; a rank of replica 0 is SIGKILLed (a fault) in step 3, so
replica 0 leaves and replica 1 goes on alone (heal/replicas.py).
Then two `ringtrain join` workers come one at a time: the first is held (the job's log names it as waiting
for 1 more to complete a replica of 2) and nothing is admitted; the second completes the replica and both are
admitted together at a step boundary: the group regroups to 4 workers through build_parallel and each joiner
receives the part (model shard, optimizer state, sampler, step) of its counterpart in the replica that trained.

The survivors hold themselves (SIGSTOP, a ``stop`` fault) at a step while each joiner starts up and asks, and
the test lets them go on once it has: the job cannot run out of steps before a slow-starting joiner asks.
(Under pp no fault point is reached on every rank of a step: there the kill and the holds are at the sample
ledger's gather, which only each replica's first rank makes; launched rank 0 is killed, and replica 1's first
rank holds while its peer waits for it in a collective, so dist.timeout_s is long enough for a joiner to start.)

Checked: exit 0 for the job and both joiners; one heal record naming replica 0 and one join record naming
replica 1 (ranks 2, 3), 0 steps lost; the ledger holds every step once and every sample exactly once, the
data-parallel size 2, then 1, then 2 again; the summary's parameter digests (every rank's full parameters,
gathered over tp or pp) equal on all 4 ranks: the new replica's shards are the old replica's, and stayed so
through the steps after (its optimizer state came too: Adam's moments, else the replicas drift apart).
"""

from __future__ import annotations

import pytest

from ringtrain.data.ledger import check_ledger
from ringtrain.heal.membership import JOINER_BASE
from tests.jobs import Job, ledger_steps, records
from tests.faults import Fault, fault_plan
from tests.runs import summary

# In the shared phase: under pp only replica 1's first rank holds, while its peer waits for it inside a collective, so
# each hold (a joiner starting up) must end within dist.timeout_s (120 s); its three jobs passed 3 times of 3 beside
# two busy loops and, in two of the runs, a `pytest -n 2` of 285 tests (250-285 s a run of all three).
pytestmark = pytest.mark.job

STEPS = 20
FIRST_HOLD, SECOND_HOLD = 6, 9
SETS = ["--set", f"train.max_steps={STEPS}", "--set", "train.auto_micro_batch=false", "--set", "train.precision=fp32",
        "--set", "train.lr_schedule=constant", "--set", "train.global_batch_size=16", "--set", "train.local_batch_size=4",
        "--set", "data.ledger=true", "--set", "monitor.log_every_steps=1", "--set", "monitor.progress=false",
        "--set", "checkpoint.every_steps=1000", "--set", "model.n_heads=2"]
SPLITS = {
    # split: (its --set values, the fault point, the member killed, the members that hold)
    "tp": (["parallel.tp=2", "dist.timeout_s=30"], "step.micro_batch", 1, (2, 3)),
    "pp": (["parallel.pp=2", "parallel.pp_microbatches=2", "dist.timeout_s=120"], "ledger.gathered", 0, (2,)),
    # DiLoCo's replicas are the tp groups: the joiners receive their counterparts' parts of the outer state too
    # (the global model's part and its momentum), or the replicas' outer steps would move different models.
    "tp-diloco": (["parallel.tp=2", "dist.timeout_s=30", "comm.strategy=diloco", "diloco.sync_every=4"],
                  "step.micro_batch", 1, (2, 3)),
}


@pytest.mark.timeout(900)  # two joiners start (each a Python process, seconds of CPU) beside 4 workers
@pytest.mark.parametrize("split", SPLITS)
def test_two_joiners_restore_the_lost_replica_together_and_every_rank_ends_on_the_same_model(tmp_path, split):
    run_dir = tmp_path / "run"
    sets, point, killed, holding = SPLITS[split]
    plan = fault_plan(tmp_path, Fault(point, member=killed, step=3),
                      *(Fault(point, member=m, step=s, action="stop")
                        for m in holding for s in (FIRST_HOLD, SECOND_HOLD)))
    joiners: list[Job] = []
    with Job("train", "configs/debug_lm.toml", "--nproc", "4", "--min-nproc", "2", "--heal", "--run-dir",
             str(run_dir), *SETS, *(arg for value in sets for arg in ("--set", value)), env=plan.env) as job:
        try:
            # The first joiner asks while replica 1 trains alone; it is held, named as waiting for 1 more.
            job.wait_for(lambda: job.held() == len(holding), timeout=300,
                         what=f"the survivors to hold at step {FIRST_HOLD}")
            joiners.append(Job("join", str(run_dir)).__enter__())
            joiners[0].wait_for_line(f"asked to join as member {JOINER_BASE + 1}", timeout=120)
            job.resume_workers()
            job.wait_for_line(f"member {JOINER_BASE + 1} asked to join: waiting for 1 more to complete a replica of 2",
                              timeout=120)
            # The second completes the replica: both are admitted together.
            job.wait_for(lambda: job.held() == len(holding), timeout=300,
                         what=f"the survivors to hold at step {SECOND_HOLD}")
            assert not records(run_dir, "join"), "a lone joiner was admitted without its replica"
            joiners.append(Job("join", str(run_dir)).__enter__())
            joiners[1].wait_for_line(f"asked to join as member {JOINER_BASE + 2}", timeout=120)
            job.resume_workers()
            code = job.finish(timeout=600)
            join_codes = [joiner.finish(timeout=120) for joiner in joiners]
        finally:
            for joiner in joiners:
                joiner.__exit__(None, None, None)
    logs = job.stderr + "".join(f"\n[joiner {n}]\n{j.stderr}" for n, j in enumerate(joiners))
    assert code == 0 and join_codes == [0, 0], (code, join_codes, logs)
    heals, joins = records(run_dir, "heal"), records(run_dir, "join")
    print(f"{split} 2 x 2: healed at step {heals[0]['step']} (replica {heals[0]['replica']}), joined after step "
          f"{joins[0]['step']} (replica {joins[0]['replica']}, admit_s {joins[0]['admit_s']})")
    assert len(heals) == 1 and heals[0]["replica"] == 0 and heals[0]["replica_ranks"] == [0, 1], (heals, logs)
    assert heals[0]["steps_lost"] == 0, heals
    assert len(joins) == 1, (joins, logs)
    assert joins[0]["replica"] == 1 and joins[0]["replica_ranks"] == [2, 3] and joins[0]["joined_ranks"] == [2, 3]
    assert joins[0]["world_size"] == 4 and joins[0]["step"] >= SECOND_HOLD, joins
    assert "joined as rank 2 of 4" in joiners[0].stderr + joiners[1].stderr, logs
    done = summary(run_dir)
    assert done["steps"] == STEPS and done["world_size"] == 4 and done["heals"] == 1, done
    # Every rank's full parameters (gathered over tp) the same: the two replicas' tp shards are equal.
    assert len(done["param_sha256"]) == 4 and len(set(done["param_sha256"])) == 1, done["param_sha256"]
    # Every step once; the data-parallel size 2, then 1 (replica 1 alone), then 2 (the replica restored); every
    # sample at most once (max_steps cuts the last epoch short).
    ledger = ledger_steps(run_dir)
    assert [r["step"] for r in ledger] == list(range(1, STEPS + 1)), ledger
    sizes = [r["world_size"] for r in ledger]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [2, 1, 2], sizes
    assert all(sum(len(ids) for ids in r["ids"]) == 16 for r in ledger)
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert all(r.exactly_once for r in reports), reports
