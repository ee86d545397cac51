"""Pipeline parallelism through `ringtrain train` (``[parallel] pp``, ringtrain/parallel/pipeline.py) on real
workers: a user's nn.Sequential named by a config's factory, cut into stages, trains as one worker; a layout or a
model a pipeline cannot run is one line. The parity proofs of the built-in transformer's pipelines (every schedule,
token budgets, empty and uneven micro-batches, replicas and FSDP2 beside them, their ring and shm all-reduces, each
sample dealt once per pipeline, full and sharded checkpoints crossing layouts and resuming bit for bit) run
in-process: tests/layouts/test_composition_*.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, run_clis
from tests.runs import records

pytestmark = pytest.mark.job


def parameters(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


def test_a_layout_pipeline_parallelism_cannot_run_is_one_line_before_any_worker(tmp_path):
    result = run_cli("train", "configs/debug_lm.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                     "--set", "parallel.pp=2", "--set", "model.n_layers=4")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    # debug_lm shrinks its micro-batches when memory runs out, which a pipeline's schedule cannot.
    assert len(lines) == 1 and "pp = 2 with train.auto_micro_batch" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


SEQUENTIAL = """
[model]
factory = "tests.user_code:dropout_mlp"
[model.args]
p = 0.0
[data]
factory = "tests.user_code:digits"
[train]
max_steps = 12
global_batch_size = 60
local_batch_size = 15
lr = 0.1
precision = "fp32"
[parallel]
pp_microbatches = 4
[checkpoint]
every_steps = 12
[monitor]
progress = false
log_every_steps = 1
"""


def test_a_users_sequential_model_is_cut_into_stages_and_trains_as_one_worker(tmp_path):
    # dropout_mlp with p = 0: Flatten, Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear; its 8 children cut
    # in order into 2 stages of 4, or (V) 4 stages of 2.
    config = tmp_path / "sequential.toml"
    config.write_text(SEQUENTIAL)
    runs = {"one": (1, []), "pp": (2, ["parallel.pp=2"]),
            "zbv": (2, ["parallel.pp=2", "parallel.pp_schedule='zbv_zero_bubble'", "parallel.stages_per_rank=2"])}
    results = run_clis(*(["train", str(config), "--nproc", str(nproc), "--run-dir", str(tmp_path / name),
                          *(arg for s in settings for arg in ("--set", s))] for name, (nproc, settings) in runs.items()),
                       timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    oracle = tmp_path / "one"
    for name in ("pp", "zbv"):
        run_dir = tmp_path / name
        mine = {r["step"]: r["loss"] for r in records(run_dir, "train")}
        reference = {r["step"]: r["loss"] for r in records(oracle, "train")}
        assert sorted(mine) == list(range(1, 13)) and all(mine[s] == pytest.approx(reference[s], rel=1e-5) for s in mine)
        assert records(run_dir, "eval")[-1]["count"] == records(oracle, "eval")[-1]["count"]
        split, whole = parameters(run_dir, 12), parameters(oracle, 12)
        assert split.keys() == whole.keys()  # the Sequential's own names: "1.weight", "4.weight", "7.weight"
        assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 1e-5


def test_a_model_a_pipeline_cannot_cut_is_one_line(tmp_path):
    config = tmp_path / "mlp.toml"
    config.write_text(SEQUENTIAL.replace("tests.user_code:dropout_mlp", "tests.user_code:digits_mlp")
                      .replace("[model.args]\np = 0.0\n", ""))
    result = run_cli("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", "parallel.pp=2")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert ("pipeline parallelism cuts the built-in transformer or an nn.Sequential into stages, and this model is a "
            "MLP; build it as an nn.Sequential") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
