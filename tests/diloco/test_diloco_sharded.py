"""Issue 40: DiLoCo's sharded and background checkpoints. Each rank writes its own parameters, inner optimizer
state and error feedback under keys of its own through DCP, the outer state once (beside a split model each rank
its parts); a checkpoint taken between outer steps resumes to the uninterrupted run's bits, at another world size
every worker starts from the checkpoint's model (rank 0's replica's) with one warning line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ringtrain.checkpoint.sharded import ShardedCheckpointer, StoredShards, committed, manifest_of
from ringtrain.train.resume import ResumePlan
from tests.distributed import DistributedTestError, run_distributed
from tests.layouts.composition import CONFIG, JOB
from tests.runs import losses as _losses, records as _records
from tests.trainers import build_test_trainer, params_of

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"
PLAN = ["train.max_steps=12", "monitor.log_every_steps=1", "train.optimizer='adamw'", "train.lr=0.01",
        "comm.strategy='diloco'", "diloco.sync_every=4", "diloco.outer_momentum=0.9"]


def train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool):
    trainer = build_test_trainer(rank, world_size, DEBUG, [*PLAN, *overrides], run_dir)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    resumed_at, loaded = trainer.state.step, params_of(trainer)
    outer = trainer.parts.strategy.outer_loop
    loaded_globals = [g.numpy().copy() for g in outer.global_params]
    in_flight = [(f.in_flight, f.error_before is not None) for f in outer.fragments]
    trainer.fit()
    warnings = [n["message"] for n in trainer.notices if n.get("type") == "warning"]
    return {"resumed_at": resumed_at, "loaded": loaded, "loaded_globals": loaded_globals, "params": params_of(trainer),
            "outer_steps": outer.outer_steps, "in_flight": in_flight, "notices": warnings}


def copy_checkpoint(source: Path, step: int, run_dir: Path) -> None:
    """The run's checkpoint of ``step`` (a committed .dcp folder and its manifest) alone in a new run's folder."""
    folder = next(p for p in committed(source / "checkpoints") if p.name == f"step_{step:08d}.dcp")
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(folder, run_dir / "checkpoints" / folder.name)
    shutil.copy(manifest_of(folder), run_dir / "checkpoints" / manifest_of(folder).name)


def same(a: dict, b: dict) -> list[str]:
    return [name for name in a if not np.array_equal(a[name], b[name])]


CASES = {
    # fp32, whole model: the outer steps at 4, 8, 12; the checkpoint at 6 lies between them.
    "sharded": (["checkpoint.sharded=true", "checkpoint.every_steps=3"], 6, [(False, False)]),
    # streaming, int8 with error feedback, a delay: fragment 0 prepares at 5 and applies at 6, so the checkpoint
    # at 5 holds its exchange in flight (the mean, each rank's error feedback from before it).
    "async-streaming": (["checkpoint.async=true", "checkpoint.every_steps=5", "diloco.fragments=2", "diloco.delay=1",
                         "diloco.dtype='int8'"], 5, [(True, True), (False, False)]),
}


@pytest.mark.ranks
@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_diloco_checkpoint_between_outer_steps_resumes_bit_for_bit(tmp_path, case):
    flags, saved_at, in_flight = CASES[case]
    straight, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    ref = run_distributed(train, 2, str(straight), flags, False)
    copy_checkpoint(straight, saved_at, resumed_dir)
    got = run_distributed(train, 2, str(resumed_dir), flags, True)
    assert [r["resumed_at"] for r in got] == [saved_at, saved_at]
    assert [r["in_flight"] for r in got] == [in_flight, in_flight]  # (exchange in flight, error feedback before it)
    # Between outer steps the workers hold models of their own: each got its own back, not rank 0's.
    assert same(got[0]["loaded"], got[1]["loaded"]), "the ranks loaded one model: the per-rank state was lost"
    assert not same(dict(enumerate(got[0]["loaded_globals"])), dict(enumerate(got[1]["loaded_globals"])))
    steps = range(saved_at + 1, 13)
    ref_losses, got_losses = _losses(straight), _losses(resumed_dir)
    assert [got_losses[s] for s in steps] == [ref_losses[s] for s in steps]
    for rank in (0, 1):
        assert not same(ref[rank]["params"], got[rank]["params"]), f"rank {rank}'s parameters differ after the resume"
        assert got[rank]["outer_steps"] == ref[rank]["outer_steps"]
        assert not got[rank]["notices"], got[rank]["notices"]
    saves = _records(resumed_dir, "checkpoint")
    assert saves and all(r["sharded"] and r["async"] == case.startswith("async") for r in saves), saves
    # Each rank's own state went through DCP under its own keys, not gathered into rank 0's extra.pt.
    folder = committed(resumed_dir / "checkpoints")[-1]
    extra, stored = ShardedCheckpointer.load_extra(folder), StoredShards(None, folder).stored
    assert extra["comm"]["ranks"] is None and "global_params" not in extra["outer"], sorted(extra["outer"])
    for rank in (0, 1):
        assert any(key.startswith(f"replica.rank_{rank}.model.") for key in stored), sorted(stored)
    assert any(key.startswith("outer.global.") for key in stored)
    assert not list((straight / "checkpoints").glob("*.pt")), "a sharded run wrote a full checkpoint"


@pytest.mark.ranks
def test_a_sharded_diloco_checkpoint_resumes_at_another_world_size_from_rank_0s_replica(tmp_path):
    """Saved by 2 workers between outer steps, resumed by 1: one warning line, the worker starts from rank 0's
    replica's model (what the shared keys hold, as a full checkpoint's model) and the outer state loads."""
    flags = ["checkpoint.sharded=true", "checkpoint.every_steps=3"]
    straight, two, one = tmp_path / "straight", tmp_path / "two", tmp_path / "one"
    run_distributed(train, 2, str(straight), flags, False)
    copy_checkpoint(straight, 6, two)
    copy_checkpoint(straight, 6, one)
    at_two = run_distributed(train, 2, str(two), flags, True)
    at_one = run_distributed(train, 1, str(one), [*flags, "train.global_batch_size=16", "train.local_batch_size=16"],
                             True)[0]
    assert at_one["resumed_at"] == 6
    assert not same(at_two[0]["loaded"], at_one["loaded"]), "the model loaded at 1 worker is not rank 0's replica's"
    assert all(np.array_equal(a, b) for a, b in zip(at_two[0]["loaded_globals"], at_one["loaded_globals"]))
    warnings = [n for n in at_one["notices"] if "own parameters" in n]
    assert len(warnings) == 1 and "for 2 workers" in warnings[0] and "\n" not in warnings[0], at_one["notices"]


# --- beside a split model: a replica is a model-parallel group -------------------------------------------------
SPLIT = [*JOB, "model.n_layers=2", "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.sharded=true",
         "train.optimizer='adamw'", "train.lr=0.003", "comm.strategy='diloco'", "diloco.sync_every=2"]
LAYOUTS = {"tp": ["parallel.tp=2"], "pp": ["parallel.pp=2", "parallel.pp_schedule='1f1b'"],
           "cp": ["parallel.cp=2", "model.dropout=0"]}


def split_train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool):
    trainer = build_test_trainer(rank, world_size, CONFIG, [*SPLIT, *overrides], run_dir)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    outer = trainer.parts.strategy.outer_loop
    own = [p.detach().numpy().copy() for p in outer._params]  # this rank's parts (a tp shard, its stages' tensors)
    resumed_at = trainer.state.step
    trainer.fit()
    full = trainer.parts.strategy.full_named_parameters(trainer.model)  # a collective: every rank
    warnings = [n["message"] for n in trainer.notices if n.get("type") == "warning"]
    return {"resumed_at": resumed_at, "own": own, "outer_steps": outer.outer_steps, "notices": warnings,
            "params": {k: v.detach().numpy().copy() for k, v in full.items()}}


@pytest.mark.ranks
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sharded_diloco_checkpoint_beside_a_split_model_resumes_bit_for_bit(tmp_path, layout):
    """dp 2 x (tp 2, pp 2 or cp 2): two replicas, each a model-parallel group; the checkpoint at step 3 between the
    outer steps at 2 and 4. Each rank reads its own state back (beside tp and pp its parts of the global model and
    the outer momentum too; beside cp the outer state is shared) and ends on the uninterrupted run's bits. Resumed
    by 2 ranks (the model-parallel group alone): beside tp and pp the parts cannot map, one line saying why; beside
    cp every rank holds the whole model, so it resumes from rank 0's replica with one warning."""
    flags = LAYOUTS[layout]
    straight, resumed_dir, other = tmp_path / "straight", tmp_path / "resumed", tmp_path / "other"
    ref = run_distributed(split_train, 4, str(straight), flags, False, timeout_s=240)
    copy_checkpoint(straight, 3, resumed_dir)
    copy_checkpoint(straight, 3, other)
    got = run_distributed(split_train, 4, str(resumed_dir), flags, True, timeout_s=240)
    assert [r["resumed_at"] for r in got] == [3] * 4
    # Ranks 0 and 2 hold the same part in different replicas: apart between outer steps, each got its own.
    assert any(not np.array_equal(a, b) for a, b in zip(got[0]["own"], got[2]["own"]))
    ref_losses, got_losses = _losses(straight), _losses(resumed_dir)
    assert [got_losses[s] for s in (4, 5, 6)] == [ref_losses[s] for s in (4, 5, 6)]
    assert not same(ref[0]["params"], got[0]["params"]), "the parameters differ after the sharded resume"
    assert got[0]["outer_steps"] == ref[0]["outer_steps"] == 3
    assert not any(r["notices"] for r in got), [r["notices"] for r in got]
    if layout == "cp":
        [alone, _] = run_distributed(split_train, 2, str(other), flags, True, timeout_s=240)
        assert alone["resumed_at"] == 3 and len(alone["notices"]) == 1 and "for 4 workers" in alone["notices"][0]
        return
    with pytest.raises(DistributedTestError) as refused:
        run_distributed(split_train, 2, str(other), flags, True, timeout_s=240)
    line = str(refused.value).split("ConfigError: ")[-1].strip()
    assert "\n" not in line and line.startswith("checkpoint step 3 holds DiLoCo's outer state as 4 ranks' own"), line
    assert "this run's 2 ranks hold other parts" in line and "resume it with the layout that saved it" in line, line
