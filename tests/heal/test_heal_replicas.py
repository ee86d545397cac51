"""Chaos: healing across layouts (issue 40). 4 workers as 2 model-parallel replicas of 2 ranks (tp 2, pp 2 or cp 2);
one rank is SIGKILLed mid-run under --heal: its replica's other rank leaves the job with it (a replica cannot
train without its part), and the whole replica left goes on at 2 workers with the same tp (pp, cp) degree and the
data-parallel degree shrunk from 2 to 1, rebuilt in the same processes (heal/replicas.py).

Checked: exit 0; one 'heal' record naming the lost replica (``replica``, ``replica_ranks``), 0 steps lost; the
ledger holds every step once and every sample of the epochs trained exactly once (the lost replica's share of
each later window dealt to the replica left); the lost rank's peer says it leaves and exits 0.
"""

from __future__ import annotations

import pytest

from ringtrain.data.ledger import check_ledger
from tests.jobs import Job, ledger_steps, records
from tests.runs import summary

# In the shared phase: its four jobs passed 3 times of 3 beside two busy loops and other tests' workers (2-core
# machine; 154-242 s a run of all four).
pytestmark = pytest.mark.job

STEPS = 24
SETS = ["--set", f"train.max_steps={STEPS}", "--set", "train.auto_micro_batch=false", "--set", "train.precision=fp32",
        "--set", "train.lr_schedule=constant", "--set", "train.global_batch_size=16", "--set", "train.local_batch_size=4",
        "--set", "data.ledger=true", "--set", "monitor.log_every_steps=1", "--set", "monitor.progress=false",
        "--set", "dist.timeout_s=20", "--set", "checkpoint.every_steps=1000", "--set", "model.n_heads=2"]


DILOCO = ["--set", "comm.strategy=diloco", "--set", "diloco.sync_every=4"]


@pytest.mark.parametrize("split", ["tp", "pp", "cp", "tp-diloco"])
def test_a_killed_rank_takes_its_replica_out_and_the_other_replica_heals_in_place(tmp_path, split):
    """tp-diloco: DiLoCo's replicas are the tp groups; the replica left goes back to the last outer step's model
    (its inner steps since are dropped, as any DiLoCo heal does) and keeps its outer state (heal/replicas.py)."""
    run_dir = tmp_path / split
    dim = split.split("-")[0]
    degrees = (["--set", f"parallel.{dim}=2"] + (["--set", "parallel.pp_microbatches=2"] if dim == "pp" else [])
               + (DILOCO if split.endswith("diloco") else []))
    with Job("train", "configs/debug_lm.toml", "--nproc", "4", "--min-nproc", "2", "--heal",
             "--run-dir", str(run_dir), *SETS, *degrees) as job:
        job.wait_for(lambda: len(ledger_steps(run_dir)) >= 10, timeout=300, what="step 10")
        job.worker(1).kill()  # replica 0 is ranks 0 and 1: rank 0, the writer, leaves with it
        code = job.finish(timeout=600)
    assert code == 0, job.stderr
    heals = records(run_dir, "heal")
    assert len(heals) == 1, job.stderr
    heal = heals[0]
    print(f"{split} 2 x 2: healed at step {heal['step']}: replica {heal['replica']} (ranks {heal['replica_ranks']}) "
          f"left, recovery_s {heal['recovery_s']}, steps_lost {heal['steps_lost']}")
    assert heal["replica"] == 0 and heal["replica_ranks"] == [0, 1], heal
    assert heal["lost_ranks"] == [0, 1] and heal["remaining_ranks"] == [2, 3] and heal["world_size"] == 2, heal
    assert heal["steps_lost"] == 0, heal
    if split.endswith("diloco"):
        assert 0 <= heal["inner_steps_dropped"] < 4, heal
    assert "a worker of its model-parallel replica was lost, so the replica left the job" in job.stderr
    done = summary(run_dir)
    assert done["heals"] == 1 and done["steps"] == STEPS and done["world_size"] == 2, done
    if split.endswith("diloco"):  # the outer state went on through the heal (a fresh one counts from the heal)
        assert done["outer_steps"] == STEPS // 4, done
    # Every step once, the data-parallel ranks 2 then 1 (the lost replica's share dealt to the one left),
    # and every sample of every epoch at most once (the last epoch is cut short by max_steps).
    steps = [r["step"] for r in ledger_steps(run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps
    sizes = [r["world_size"] for r in ledger_steps(run_dir)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [2, 1], sizes
    assert all(sum(len(ids) for ids in r["ids"]) == 16 for r in ledger_steps(run_dir))
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert all(r.exactly_once for r in reports), reports
    # The surviving replica's model went on (not one built anew, which starts over near the first step's loss):
    # the loss right after the heal is nearer the one before it than the first step's (seen: 5.42 at step 1,
    # 4.16 before a heal at step 11, 4.10 after it; 5.21 after it when the last stage's own copy of the tied
    # weight was not moved).
    # (The last logged step before it: the lost writer's record of the step it committed last may be missing.)
    losses = {r["step"]: r["loss"] for r in records(run_dir, "train")}
    before = losses[max(step for step in losses if step < heal["step"])]
    after = losses[min(step for step in losses if step >= heal["step"])]
    print(f"loss at step 1 {losses[1]:.3f}, before the heal {before:.3f}, after {after:.3f}")
    assert after < (losses[1] + before) / 2, losses
