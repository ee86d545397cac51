"""Sharded (DCP) checkpoints across model-parallel layouts, through `ringtrain train` on real workers: a 2-D
FSDP2 (dp_shard = 2) x tensor-parallel (tp = 2) run's checkpoint resumed at its own layout, by four FSDP2 workers
and by a two-stage pipeline, and a pipeline's resumed under tensor parallelism ("train at tp2 x dp2, resume at
dp4 or pp2, and back"). Each resume ends where one worker training the unsplit model did (loss at every step
within fp32 rounding); resumed at its own layout the run goes on bit for bit. Each layout's model state per
worker is `ringtrain plan layouts`' analytic figure within 10% (measured: within 2.6%).

The tensor-parallel ranks hold the fused qkv rows in rank order (ringtrain/parallel/tensor.py): the checkpoint
stores them in the unsplit model's order, or no other layout could read them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ringtrain.bench.plan_layouts import Layout, ModelShape, layout_memory
from tests.conftest import run_clis

STEPS, SAVED = 12, 6
COMMON = ["--set", "train.precision='fp32'", "--set", "monitor.log_every_steps=1",
          "--set", f"checkpoint.every_steps={SAVED}", "--set", f"train.max_steps={STEPS}"]
SHARDED = ["checkpoint.sharded=true", "checkpoint.async=true"]
LAYOUTS = {  # name: (workers, settings) on configs/debug_pp.toml (4 blocks, 2 heads; pp = 2 unless set)
    "one": (1, ["parallel.pp=1"]),
    "tp2_dp2": (4, ["parallel.pp=1", "parallel.tp=2", "comm.strategy='fsdp'", *SHARDED]),
    "pp2": (2, SHARDED),
    "dp4": (4, ["parallel.pp=1", "comm.strategy='fsdp'", *SHARDED]),
    "tp2": (2, ["parallel.pp=1", "parallel.tp=-1", *SHARDED]),
}


SHAPE = ModelShape(layers=4, hidden=64, heads=2, seq=128, vocab=256)  # configs/debug_pp.toml's model
PLANNED = {"one": Layout(1, 1, 1), "tp2_dp2": Layout(2, 2, 1, "fsdp"), "pp2": Layout(1, 1, 2),
           "dp4": Layout(4, 1, 1, "fsdp"), "tp2": Layout(1, 2, 1)}
"""Each layout as `ringtrain plan layouts` models it, for its model-state bound."""


def train(run_dir: Path, layout: str) -> list[str]:
    nproc, settings = LAYOUTS[layout]
    return ["train", "configs/debug_pp.toml", "--nproc", str(nproc), "--run-dir", str(run_dir), *COMMON,
            *(arg for s in settings for arg in ("--set", s))]


def losses(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}


def digests(run_dir: Path) -> list[str]:
    return json.loads((run_dir / "summary.json").read_text())["param_sha256"]


def test_tensor_parallel_checkpoints_resume_as_fsdp_and_as_a_pipeline_and_back(tmp_path):
    base = {layout: tmp_path / f"base_{layout}" for layout in ("one", "tp2_dp2", "pp2")}
    for result in run_clis(*(train(run_dir, layout) for layout, run_dir in base.items()), timeout=500):
        assert result.returncode == 0, result.stderr[-2000:]
    oracle = losses(base["one"])
    resumes = {"tp2_dp2": "tp2_dp2", "dp4": "tp2_dp2", "pp2": "tp2_dp2", "tp2": "pp2"}  # into: from
    commands = []
    for into, source in resumes.items():
        run_dir = tmp_path / f"{source}_into_{into}"
        shutil.copytree(base[source], run_dir)
        for later in (run_dir / "checkpoints").glob(f"step_{STEPS:08d}.dcp*"):
            shutil.rmtree(later) if later.is_dir() else later.unlink()
        commands.append([*train(run_dir, into), "--resume"])
    for result in run_clis(*commands, timeout=500):
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"resumed from step_{SAVED:08d}.dcp (step {SAVED})" in result.stderr
    for into, source in resumes.items():
        run_dir = tmp_path / f"{source}_into_{into}"
        mine = {step: loss for step, loss in losses(run_dir).items() if step > SAVED}
        assert sorted(mine) == list(range(SAVED + 1, STEPS + 1)), (into, sorted(mine))
        for step, loss in mine.items():
            assert loss == pytest.approx(oracle[step], rel=1e-5), f"{source} into {into}, step {step}"
        assert len(set(digests(run_dir))) == 1  # every rank gathers one model
    # Each layout's model state per worker (the fullest rank's parameters, gradients and AdamW moments) is the
    # planner's analytic figure within 10% (it counts 12 h^2 a block and the embeddings, not biases and norms).
    measured = {layout: json.loads((run_dir / "summary.json").read_text())["model_state_mb"]
                for layout, run_dir in [*base.items(), *((into, tmp_path / f"{source}_into_{into}")
                                                         for into, source in resumes.items())]}
    for layout, mb in measured.items():
        planned = layout_memory(SHAPE, PLANNED[layout], global_batch=32)["state_bytes"] / 2**20
        print(f"{layout}: model state {mb:.3f} MiB, planned {planned:.3f} MiB")
        assert abs(mb / planned - 1) < 0.10, (layout, mb, planned)
    # At its own layout the resume is the uninterrupted run, bit for bit (the saves changed nothing either).
    assert digests(tmp_path / "tp2_dp2_into_tp2_dp2") == digests(base["tp2_dp2"])
    uninterrupted = losses(base["tp2_dp2"])
    assert all(uninterrupted[step] == pytest.approx(oracle[step], rel=1e-5) for step in oracle)
