"""Tensor parallelism inside pipeline stages (``[parallel] tp`` with ``pp``: the 3-D dp x pp x tp mesh on eight
ranks; ringtrain/parallel/pipeline.py with tensor.py's ``parallelize_stage``), against one worker training the unsplit
model on the same batches (the oracle): the composed layout's ledger (each sample dealt once per data-parallel rank),
its sharded checkpoint resumed at three other layouts; each layout's model state per rank is the planner's figure
within 10%. The runs train in the harness's ranks (tests/distributed.py: the trainer `ringtrain train` builds, issue
45); what stays a launched command is the launcher's own refusal, before any worker. The 2-D pp x tp mesh on four
workers (loop, interleaved with sequence parallelism, zero-bubble V, the split layers' all-reduces on shm) runs
in-process too: tests/layouts/test_composition_*.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ringtrain.bench.plan_layouts import Layout, ModelShape, layout_memory
from ringtrain.data.ledger import check_ledger
from ringtrain.train.resume import ResumePlan
from tests.conftest import run_cli
from tests.distributed import run_distributed
from tests.runs import losses, records, summary, train_args
from tests.trainers import build_test_trainer

CONFIG = "configs/debug_pp.toml"
STEPS, SAVED = 4, 2
"""The resumed runs' step 3 is the first update with the checkpoint's AdamW moments, step 4's loss and the last
parameters show it (6 steps saved at 3 before, issue 45: two thirds of the steps for the same proofs)."""
COMMON = ["train.precision='fp32'", "data.ledger=true", "monitor.log_every_steps=1", "train.auto_micro_batch=false",
          f"checkpoint.every_steps={SAVED}", f"train.max_steps={STEPS}"]
SHAPE = ModelShape(layers=4, hidden=64, heads=2, seq=128, vocab=256)  # configs/debug_pp.toml's model


def train_in_ranks(rank: int, world_size: int, overrides: list[str], run_dir: str, resume: bool) -> dict | None:
    """What ``ringtrain train configs/debug_pp.toml --set OVERRIDES --run-dir RUN_DIR [--resume]`` does in its
    workers; rank 0 returns the checkpoint it resumed from and the step it resumed at."""
    trainer = build_test_trainer(rank, world_size, CONFIG, [*COMMON, *overrides], run_dir)
    found = trainer.resume(ResumePlan(resume=resume, required=resume))
    resumed = (None if found is None else found.name, trainer.state.step)
    trainer.fit()
    return {"resumed": resumed} if rank == 0 else None


def train(run_dir: Path, world_size: int, *settings: str, resume: bool = False) -> dict:
    return run_distributed(train_in_ranks, world_size, list(settings), str(run_dir), resume, timeout_s=480,
                           collective_timeout_s=120)[0]


def assert_same_parameters(run_dir: Path, oracle: Path) -> None:
    """The last full checkpoint holds the unsplit model (qkv rows in q | k | v order, the tied weight's copies one),
    within 1e-5 of the one worker's."""
    split, whole = (torch.load(d / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"]
                    for d in (run_dir, oracle))
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    print(f"{run_dir.name}: largest parameter difference from one worker {worst:.2e}")
    assert worst < 1e-5
    assert split["head.weight"].equal(split["token_embedding.weight"])


def assert_same_run(run_dir: Path, oracle: Path) -> None:
    mine, reference = losses(run_dir), losses(oracle)
    assert sorted(mine) == list(range(1, STEPS + 1)), sorted(mine)
    for step in mine:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}: {mine[step]} vs {reference[step]}"
    evaluated, expected = records(run_dir, "eval")[-1], records(oracle, "eval")[-1]
    assert evaluated["count"] == expected["count"] and evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert_same_parameters(run_dir, oracle)
    assert len(set(summary(run_dir)["param_sha256"])) == 1  # every rank gathers one model


def assert_model_state_planned(run_dir: Path, layout: Layout) -> None:
    """The fullest rank's parameters, gradients and AdamW moments against `ringtrain plan layouts`' figure."""
    measured = summary(run_dir)["model_state_mb"]
    planned = layout_memory(SHAPE, layout, global_batch=32)["state_bytes"] / 2**20
    print(f"{layout.name}: model state {measured:.3f} MiB, planned {planned:.3f} MiB")
    assert abs(measured / planned - 1) < 0.10, (layout.name, measured, planned)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tp_pp") / "one_worker"
    train(run_dir, 1, "parallel.pp=1")
    return run_dir


@pytest.mark.ranks
def test_dp2_by_pp2_by_tp2_on_eight_ranks_trains_as_one_worker_and_its_sharded_checkpoint_resumes_elsewhere(
        tmp_path, oracle):
    # The 3-D mesh with FSDP2 over the two pipelines (sharded, asynchronous checkpoints) or plain replicas (ddp).
    fsdp, ddp = tmp_path / "dp2_pp2_tp2_fsdp", tmp_path / "dp2_pp2_tp2_ddp"
    train(fsdp, 8, "parallel.tp=2", "comm.strategy='fsdp'", "checkpoint.sharded=true", "checkpoint.async=true")
    train(ddp, 8, "parallel.tp=2")
    for run_dir, layout in ((fsdp, Layout(2, 2, 2, "fsdp")), (ddp, Layout(2, 2, 2, "ddp"))):
        assert summary(run_dir)["world_size"] == 8
        losses_seen = losses(run_dir)
        assert sorted(losses_seen) == list(range(1, STEPS + 1))
        assert all(loss == pytest.approx(losses(oracle)[step], rel=1e-5) for step, loss in losses_seen.items())
        ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()[1:]]
        assert {r["world_size"] for r in ledger} == {2}  # two data-parallel ranks, each a pipeline of tp pairs
        reports = check_ledger(run_dir / "ledger.jsonl")
        assert reports and all(r.exactly_once for r in reports)
        assert len(set(summary(run_dir)["param_sha256"])) == 1
        assert_model_state_planned(run_dir, layout)
    assert_same_run(ddp, oracle)
    # The sharded checkpoint of step SAVED resumed by one pipeline of tp pairs, by tp = 2 alone and by one worker
    # (each saves its last checkpoint whole: the unsplit model, against the one worker's).
    into = {"pp2_tp2": (4, ["parallel.tp=2"]), "tp2": (2, ["parallel.pp=1", "parallel.tp=2"]), "one": (1, ["parallel.pp=1"])}
    for name, (world_size, settings) in into.items():
        run_dir = tmp_path / f"3d_into_{name}"
        (run_dir / "checkpoints").mkdir(parents=True)
        for saved in (fsdp / "checkpoints").glob(f"step_{SAVED:08d}.dcp*"):
            (shutil.copytree if saved.is_dir() else shutil.copy)(saved, run_dir / "checkpoints" / saved.name)
        assert train(run_dir, world_size, *settings, resume=True)["resumed"] == (f"step_{SAVED:08d}.dcp", SAVED)
        # What the console's "resumed from step_....dcp (step N)" line is made of: the run's resume record.
        assert [(r["checkpoint"], r["step"]) for r in records(run_dir, "resume")] == [(f"step_{SAVED:08d}.dcp", SAVED)]
        resumed = losses(run_dir)
        assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), (name, sorted(resumed))
        for step, loss in resumed.items():
            assert loss == pytest.approx(losses(oracle)[step], rel=1e-5), f"into {name}, step {step}"
        assert_same_parameters(run_dir, oracle)


@pytest.mark.job
def test_what_tensor_parallelism_inside_a_pipeline_cannot_run_with_is_one_line_before_any_worker(tmp_path):
    result = run_cli(*train_args(CONFIG, tmp_path / "run", *COMMON, "parallel.tp=2", "model.n_heads=1", nproc=4))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tp = 2 with pp = 2: tp does not divide model.n_heads (1)" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
