"""Tensor parallelism inside pipeline stages through `ringtrain train` on real workers (``[parallel] tp`` with
``pp``: the 3-D dp x pp x tp mesh on eight workers; ringtrain/parallel/pipeline.py with tensor.py's
``parallelize_stage``), against one worker training the unsplit model on the same batches (the oracle): the CLI
path of a composed layout, its ledger across a real job (each sample dealt once per data-parallel rank), its
sharded checkpoint resumed at three other layouts; each layout's model state per worker is the planner's figure
within 10%. The 2-D pp x tp mesh on four workers (loop, interleaved with sequence parallelism, zero-bubble V, the
split layers' all-reduces on shm) runs in-process: tests/multiproc/test_composition_*.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ringtrain.bench.plan_layouts import Layout, ModelShape, layout_memory
from ringtrain.data.ledger import check_ledger
from tests.conftest import run_cli, run_clis
from tests.runs import losses, records, summary, train_args

STEPS, SAVED = 6, 3
COMMON = ["train.precision='fp32'", "data.ledger=true", "monitor.log_every_steps=1", "train.auto_micro_batch=false",
          f"checkpoint.every_steps={SAVED}"]
SHAPE = ModelShape(layers=4, hidden=64, heads=2, seq=128, vocab=256)  # configs/debug_pp.toml's model


def train(run_dir: Path, nproc: int, *settings: str) -> list[str]:
    return train_args("configs/debug_pp.toml", run_dir, *COMMON, f"train.max_steps={STEPS}", *settings, nproc=nproc)


def assert_same_run(run_dir: Path, oracle: Path) -> None:
    mine, reference = losses(run_dir), losses(oracle)
    assert sorted(mine) == list(range(1, STEPS + 1)), sorted(mine)
    for step in mine:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}: {mine[step]} vs {reference[step]}"
    evaluated, expected = records(run_dir, "eval")[-1], records(oracle, "eval")[-1]
    assert evaluated["count"] == expected["count"] and evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    # The full checkpoint holds the unsplit model (qkv rows in q | k | v order, the tied weight's copies one).
    split, whole = (torch.load(d / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"]
                    for d in (run_dir, oracle))
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    print(f"{run_dir.name}: largest parameter difference from one worker {worst:.2e}")
    assert worst < 1e-5
    assert split["head.weight"].equal(split["token_embedding.weight"])
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
    result = run_cli(*train(run_dir, 1, "parallel.pp=1"))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def test_dp2_by_pp2_by_tp2_on_eight_workers_trains_as_one_worker_and_its_sharded_checkpoint_resumes_elsewhere(
        tmp_path, oracle):
    # The 3-D mesh with FSDP2 over the two pipelines (sharded, asynchronous checkpoints) or plain replicas (ddp).
    fsdp, ddp = tmp_path / "dp2_pp2_tp2_fsdp", tmp_path / "dp2_pp2_tp2_ddp"
    results = run_clis(
        train(fsdp, 8, "parallel.tp=2", "comm.strategy='fsdp'", "checkpoint.sharded=true", "checkpoint.async=true"),
        train(ddp, 8, "parallel.tp=2"), timeout=500)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
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
    # The sharded checkpoint of step 3 resumed by one pipeline of tp pairs, by tp = 2 alone and by one worker.
    into = {"pp2_tp2": (4, ["parallel.tp=2"]), "tp2": (2, ["parallel.pp=1", "parallel.tp=2"]), "one": (1, ["parallel.pp=1"])}
    commands = []
    for name, (nproc, settings) in into.items():
        run_dir = tmp_path / f"3d_into_{name}"
        (run_dir / "checkpoints").mkdir(parents=True)
        for saved in (fsdp / "checkpoints").glob(f"step_{SAVED:08d}.dcp*"):
            (shutil.copytree if saved.is_dir() else shutil.copy)(saved, run_dir / "checkpoints" / saved.name)
        commands.append([*train(run_dir, nproc, *settings), "--resume"])
    for result in run_clis(*commands, timeout=400):
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"resumed from step_{SAVED:08d}.dcp (step {SAVED})" in result.stderr
    for name in into:
        resumed = losses(tmp_path / f"3d_into_{name}")
        assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1)), (name, sorted(resumed))
        for step, loss in resumed.items():
            assert loss == pytest.approx(losses(oracle)[step], rel=1e-5), f"into {name}, step {step}"


def test_what_tensor_parallelism_inside_a_pipeline_cannot_run_with_is_one_line_before_any_worker(tmp_path):
    result = run_cli(*train(tmp_path / "run", 4, "parallel.tp=2", "model.n_heads=1"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tp = 2 with pp = 2: tp does not divide model.n_heads (1)" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
