"""Chaos: heal in place when a worker dies *inside* something (issue 12): inside ringtrain's ring all-reduce,
inside the shm all-reduce, inside a checkpoint save.

The kills are placed by a fault plan (``ringtrain/testing/faults.py``, ``tests/faults.py``: a worker SIGKILLs
itself at a named fault point, as a breakpoint would), in two runs of the digits MLP (hidden sizes 256, 256: one gradient
bucket of about 340 KB; global_batch_size 96, 2 epochs = 30 steps, a checkpoint every 10), 3 workers,
``--min-nproc 1``, comm.strategy = "manual":

- ring: rank 2 dies in step 1's gradient all-reduce after 3 of its 4 ring steps (``ring.step``, hit 3: the
  reduce-scatter done and one all-gather step: the survivors hold partially reduced gradients); then the writer,
  rank 0, dies in the save of step 20 with the data file in place but its manifest unwritten
  (``checkpoint.save.commit``). 3 -> 2 -> 1 workers; the last one
  takes over the run directory.
- shm: rank 1 dies in step 1 after the first of the three barriers of the all-reduce in place (``shm.arrive``:
  its bucket in shared memory, published to the peers, which sum their shards from it and then wait for it in
  vain). A plan armed at ``shm.arrive`` puts the victim, hence its whole first group, on shm's Python path (the
  native one is one C++ call); the survivors' new group takes the native path, which the second heal tears
  down in turn. Then the non-writer (the launched rank 2) dies as the save of step 20 starts, while rank 0
  writes (``checkpoint.save.enter``). 3 -> 2 -> 1.

Both must exit 0 with two heals, 0 steps lost and every sample once, and apply no partial gradient: every
committed checkpoint (10, 20, 30) is bit-identical to the one of a reference that trained with 2 workers
from the start (a step never completed with 3, and with 2 ranks the ring, shm and Gloo sums are the same
floats), stopped at step 20 and resumed with 1 worker (the reference runs in the test harness: no launch).
No committed checkpoint is corrupt: each verifies against its manifest and holds its own step, and the
writer's half-finished save is never taken for the newest. shm leaves nothing in /dev/shm, and after the heal
a survivor maps only the new generation's workspace (named for it), never the broken group's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import manifest_path
from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from ringtrain.data.ledger import check_ledger
from ringtrain.errors import CorruptCheckpoint
from ringtrain.train.resume import ResumePlan
from tests.jobs import Job, ledger_steps, records
from tests.distributed import run_distributed
from tests.faults import Fault, Plan, fault_plan
from tests.trainers import build_test_trainer

# These share the machine: a --heal member is lost only when its exit is known (ringtrain/heal/liveness.py), or
# hung after dist.timeout_s (20 s here), never for a heartbeat starved for a moment (it was 0.5 s once, and
# these ran alone); the /dev/shm check looks only for segments named for this job's own workers' pids. Each job
# (a launcher, 3 agents, 3 workers, each importing torch) took minutes to start beside other tests at load 25.
pytestmark = pytest.mark.timeout(900)

STEPS = 30  # 2 epochs of 15 steps
OVERRIDES = ["model.hidden_sizes=[256,256]", "train.global_batch_size=96", "train.local_batch_size=16", "train.lr_schedule=constant",
             "data.ledger=true", "monitor.log_every_steps=1", "dist.timeout_s=20", "checkpoint.every_steps=10",
             "train.epochs=2"]
SETS = [arg for override in [*OVERRIDES, "monitor.progress=false"] for arg in ("--set", override)]


def _train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool) -> None:
    trainer = build_test_trainer(rank, world_size, "configs/digits_mlp.toml", [*OVERRIDES, *overrides], run_dir)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    trainer.fit()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Checkpoints 10, 20 and 30 of a run with 2 workers to step 20, resumed with 1 to the end."""
    run_dir = tmp_path_factory.mktemp("reference")
    run_distributed(_train, 2, str(run_dir), ["train.max_steps=20"], False, timeout_s=120)
    run_distributed(_train, 1, str(run_dir), [], True, timeout_s=120)
    return run_dir


def heal(run_dir: Path, algorithm: str, plan: Plan, *sets: str) -> tuple[int, Job, list, dict]:
    """Run the job with the plan's kills; return its exit code, the job, the workers' pids, and the shm segments
    a survivor (rank 0) mapped once the first heal was done."""
    env = plan.env
    with Job("train", "configs/digits_mlp.toml", "--nproc", "3", "--min-nproc", "1", "--heal", "--run-dir",
             str(run_dir), *SETS, "--set", "comm.strategy=manual", "--set", f"comm.algorithm={algorithm}", *sets,
             env=env) as job:
        workers = job.wait_for(lambda: len(job.workers()) == 3 and job.workers(), what="3 workers")
        pids = [p.pid for p in workers.values()]
        job.wait_for(lambda: records(run_dir, "heal"), what="the first heal")
        mapped = shm_mappings(workers[0].pid)
        code = job.finish()
    return code, job, pids, mapped


def shm_mappings(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(SHM_DIR + "/", 1)[1].split()[0] for line in f if SHM_DIR + "/" + PREFIX in line}
    except OSError:
        return set()


def check_healed(run_dir: Path, job: Job, code: int, lost: list[list[int]]) -> None:
    assert code == 0, job.stderr
    heals = records(run_dir, "heal")
    print(f"heals at steps {[h['step'] for h in heals]}: lost {[h['lost_ranks'] for h in heals]}, recovery_s "
          f"{[h['recovery_s'] for h in heals]}, steps_lost {[h['steps_lost'] for h in heals]}")
    assert [h["step"] for h in heals] == [1, 21] and [h["lost_ranks"] for h in heals] == lost, heals
    assert heals[0]["cause"].startswith("step 1: all_reduce (ringtrain's gradient buckets) failed"), heals  # inside the sync
    assert all(h["steps_lost"] == 0 for h in heals) and [h["world_size"] for h in heals] == [2, 1], heals
    assert "2 workers go on (generation 1)" in job.stderr and "1 worker goes on (generation 2)" in job.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["heals"] == 2 and summary["world_size"] == 1
    sizes = [r["world_size"] for r in ledger_steps(run_dir)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [2, 1]  # step 1 never completed with 3
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert len(reports) == 2 and all(r.exactly_once and r.complete for r in reports), reports


def committed(run_dir: Path) -> dict[int, dict]:
    """Every committed checkpoint, verified against its manifest (ringtrain's load), by the step it holds."""
    manager = CheckpointManager(run_dir / "checkpoints")
    found = {}
    for path in manager.checkpoints():
        if manifest_path(path).exists():
            state = manager.load(path)  # CorruptCheckpoint if it does not match its manifest
            assert path.name == f"step_{state['train_state']['step']:08d}.pt", f"{path.name} holds another step"
            found[state["train_state"]["step"]] = state["model"]
    return found


def assert_same_model(mine: dict, theirs: dict, what: str) -> None:
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), what


@pytest.mark.job
def test_kills_inside_the_ring_all_reduce_and_inside_the_writers_save_are_healed_with_no_partial_state(
        tmp_path, reference):
    run_dir = tmp_path / "ring"
    plan = fault_plan(tmp_path, Fault("ring.step", member=2, step=1, hit=3),
                      Fault("checkpoint.save.commit", member=0, step=20))
    code, job, _, _ = heal(run_dir, "ring", plan)
    fired = [(f["point"], f["member"], f["step"], f["hit"]) for f in plan.fired()]
    assert fired == [("ring.step", 2, 1, 3), ("checkpoint.save.commit", 0, 20, 1)], (fired, job.stderr)
    check_healed(run_dir, job, code, lost=[[2], [0]])
    assert "is now rank 0 and writes the run directory" in job.stderr

    # The writer died between the data file and its manifest: step 20 is on disk, uncommitted.
    checkpoints = run_dir / "checkpoints"
    half = checkpoints / "step_00000020.pt"
    assert half.exists() and not manifest_path(half).exists()
    with pytest.raises(CorruptCheckpoint, match="no manifest"):
        CheckpointManager(checkpoints).load(half)
    done = committed(run_dir)
    assert sorted(done) == [10, 30]
    # Were it the newest file (the run stopped there), a resume would skip it for step 10.
    cut = tmp_path / "cut"
    shutil.copytree(checkpoints, cut, ignore=shutil.ignore_patterns("step_00000030*"))
    warnings: list[str] = []
    newest, _ = CheckpointManager(cut).load_latest(warnings.append)
    assert newest.name == "step_00000010.pt" and "step_00000020.pt" in warnings[0], warnings

    ref = committed(reference)
    for step in (10, 30):
        assert_same_model(done[step], ref[step], f"step {step} differs from the reference: a partial gradient?")
    print("ring: checkpoints 10 and 30 bit-identical to the reference; step 20's half-finished save skipped")


@pytest.mark.job
def test_the_writer_lost_after_a_steps_ledger_gather_leaves_no_hole_in_the_ledger(tmp_path):
    """Rank 0 dies after step 5's ledger gather (every rank committed step 5) and before it writes the line:
    the new writer records step 5's window as it was dealt, so every sample is still used exactly once."""
    run_dir = tmp_path / "ledger"
    plan = fault_plan(tmp_path, Fault("ledger.gathered", member=0, step=5))
    code, job, _, _ = heal(run_dir, "ring", plan)
    assert [(f["point"], f["member"], f["step"]) for f in plan.fired()] == [("ledger.gathered", 0, 5)], job.stderr
    assert code == 0, job.stderr
    (heal_record,) = records(run_dir, "heal")
    assert heal_record["lost_ranks"] == [0] and heal_record["from_step"] == 5 and heal_record["steps_lost"] == 0
    steps = [r["step"] for r in ledger_steps(run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps
    assert [r["world_size"] for r in ledger_steps(run_dir)][4:6] == [3, 2]  # step 5 as it was dealt, to 3
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert all(r.exactly_once and r.complete for r in reports), reports


@pytest.mark.job
def test_kills_inside_the_shm_all_reduce_and_during_a_save_are_healed_leaving_nothing_in_dev_shm(
        tmp_path, reference):
    run_dir = tmp_path / "shm"
    plan = fault_plan(tmp_path, Fault("shm.arrive", member=1, step=1, hit=1),
                      Fault("checkpoint.save.enter", member=2, step=20))
    code, job, pids, mapped = heal(run_dir, "shm", plan)
    fired = [(f["point"], f["member"], f["step"], f["hit"]) for f in plan.fired()]
    assert fired == [("shm.arrive", 1, 1, 1), ("checkpoint.save.enter", 2, 20, 1)], (fired, job.stderr)
    check_healed(run_dir, job, code, lost=[[1], [1]])  # the second: launched rank 2, rank 1 of generation 1

    # After the first heal rank 0 maps the new generation's workspace, named for it, and nothing of the old.
    print(f"shm segments rank 0 mapped after the heal: {sorted(mapped)}")
    assert mapped and all("-g1-" in name or "-g2-" in name for name in mapped), mapped
    left = [name for name in os.listdir(SHM_DIR) if any(name.startswith(f"{PREFIX}{pid}-") for pid in pids)]
    assert not left, f"left in {SHM_DIR}: {left}"

    done = committed(run_dir)
    assert sorted(done) == [10, 20, 30]
    ref = committed(reference)
    for step in (10, 20, 30):
        assert_same_model(done[step], ref[step], f"step {step} differs from the reference: a partial gradient?")
    print("shm: checkpoints 10, 20 and 30 bit-identical to the reference; nothing left in /dev/shm")


@pytest.mark.unit
def test_heal_takes_shm_and_refuses_powersgd_in_one_line():
    from ringtrain.config import load_config
    from ringtrain.errors import ConfigError

    for strategy in ("manual", "ddp"):
        config = load_config("configs/digits_mlp.toml", ["dist.heal=true", f"comm.strategy={strategy}", "comm.algorithm=shm"])
        assert config.dist.heal and config.comm.algorithm == "shm"
    with pytest.raises(ConfigError) as refused:
        load_config("configs/digits_mlp.toml", ["dist.heal=true", "comm.algorithm=powersgd"])
    assert "dist.heal = true does not work with comm.algorithm = 'powersgd'" in str(refused.value)
    assert "\n" not in str(refused.value)
