"""fp16 with torch's GradScaler on CPU workers, through `ringtrain train` as a user runs it.

torch's GradScaler scales CPU gradients as it does CUDA ones, so fp16 is no longer refused over Gloo. One
run of the sharded case through the command line (FSDP2: each rank unscales its own gradient shard, the
overflow verdict rides on the step agreement); that the sharded strategies step and skip bit for bit like
the replicated one under fp16 is tests/layouts/test_zero.py's fp16 test.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.job


def test_fp16_trains_on_cpu_workers_through_ringtrain_train(tmp_path):
    run_dir = tmp_path / "fsdp"
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir),
                     "--set", "train.precision=fp16", "--set", "comm.strategy=fsdp",
                     "--set", "train.local_batch_size=32", "--set", "train.auto_micro_batch=false")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("type") == "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"fp16 on CPU, fsdp: loss {losses[0]:.3f} -> {summary['final_loss']:.3f} in {summary['steps']} steps")
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 0.5 * losses[0]
    assert len(set(summary["param_sha256"])) == 1 and len(summary["param_sha256"]) == 2
    assert summary["steps"] > 0
