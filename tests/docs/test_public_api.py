"""The public names of ``ringtrain``, as a user outside the package sees them, and the small conveniences the
building blocks have for a hand-written loop (examples/custom_loop.py runs them under torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

PUBLIC = {
    "__version__", "fit", "FitResult", "Session",
    "DistEnv", "DistConfig", "init_distributed",
    "ResumableSampler", "StepBatch", "build_train_loader", "Ledger", "check_ledger",
    "DDPStrategy", "ManualStrategy",
    "CheckpointManager", "ShardedCheckpointer", "StepGuard", "TrainState",
    "StepClock", "RunDirLogger", "NullLogger",
}

OUTSIDE = """
import inspect, json, sys
import ringtrain
report = {"torch_on_import": "torch" in sys.modules, "all": sorted(ringtrain.__all__)}
namespace = {}
exec("from ringtrain import *", namespace)
report["star"] = sorted(k for k in namespace if k != "__builtins__")
report["undocumented"] = [n for n in ringtrain.__all__ if n != "__version__" and not inspect.getdoc(getattr(ringtrain, n))]
report["homes"] = {n: getattr(ringtrain, n).__module__ for n in ringtrain.__all__ if n != "__version__"}
report["in_dir"] = sorted(set(ringtrain.__all__) - set(dir(ringtrain)))
try:
    ringtrain.Trainer
except AttributeError as err:
    report["missing"] = str(err)
print(json.dumps(report))
"""


@pytest.mark.job
def test_every_public_name_imports_from_outside_the_package_documented():
    """A fresh interpreter in another folder: ``import ringtrain`` does not import torch; every name of
    ``__all__`` resolves (``from ringtrain import *`` too), has a docstring, and lives in its block's module."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", OUTSIDE], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["torch_on_import"] is False
    assert set(report["all"]) == PUBLIC
    assert set(report["star"]) == PUBLIC
    assert report["undocumented"] == []
    assert report["in_dir"] == []
    assert all(home.startswith("ringtrain.") for home in report["homes"].values())
    assert report["missing"] == "module 'ringtrain' has no attribute 'Trainer'"


@pytest.mark.unit
def test_public_names_are_the_blocks_the_trainer_uses():
    import ringtrain
    from ringtrain.checkpoint.manager import CheckpointManager
    from ringtrain.data.loader import build_train_loader
    from ringtrain.data.sampler import ResumableSampler
    from ringtrain.train.guards import StepGuard

    assert ringtrain.CheckpointManager is CheckpointManager
    assert ringtrain.build_train_loader is build_train_loader
    assert ringtrain.ResumableSampler is ResumableSampler
    assert ringtrain.StepGuard is StepGuard


@pytest.mark.unit
def test_the_step_guard_needs_no_more_than_rank_world_size_and_device():
    from ringtrain import StepGuard, TrainState

    guard = StepGuard(0, 1, torch.device("cpu"))
    assert guard.max_consecutive == 3
    previous = signal.getsignal(signal.SIGTERM)
    with guard:
        assert signal.getsignal(signal.SIGTERM) != previous
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next step boundary, not here
        verdict = guard.agree(guard.check(torch.tensor(1.0), [torch.nn.Parameter(torch.ones(2))]))
    assert signal.getsignal(signal.SIGTERM) == previous
    assert verdict.stop and not verdict.skip
    state = TrainState()
    bad = guard.agree(guard.check(torch.tensor(float("nan")), []))
    guard.count(bad, state, 1)
    assert bad.skip and state.skipped_steps == 1 and state.consecutive_skips == 1


@pytest.mark.unit
def test_load_latest_warns_on_stderr_by_default(tmp_path, capsys):
    from ringtrain import CheckpointManager

    checkpoints = CheckpointManager(tmp_path)
    for step in (1, 2):
        checkpoints.save(step, {"w": torch.full((4,), float(step))})
    checkpoints.path_for(2).write_bytes(b"not the saved bytes")
    path, state = checkpoints.load_latest()
    assert path.name == "step_00000001.pt" and state["w"][0] == 1
    err = capsys.readouterr().err
    assert err.startswith("ringtrain: warning: checkpoint ") and "resuming from step_00000001.pt" in err


@pytest.mark.unit
def test_the_run_dir_logger_without_a_config_writes_metrics_and_summary(tmp_path):
    from ringtrain import NullLogger, RunDirLogger, StepClock

    clock = StepClock()
    for logger in (RunDirLogger(tmp_path), NullLogger()):
        logger.start(total_steps=2, start_step=0, steps_per_epoch=2)
        clock.end_step(samples=64)
        logger.log({"type": "train", "step": 1, **clock.flush()})
        logger.finish({"steps": 1})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 1 and records[0]["samples_per_s"] > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}
    assert not (tmp_path / "config.toml").exists()


@pytest.mark.unit
def test_the_step_loader_deals_each_window_once_and_resumes_from_the_cursor():
    """The loader and sampler alone, one process playing both ranks of a world of two."""
    from torch.utils.data import TensorDataset

    from ringtrain import ResumableSampler, StepBatch, build_train_loader

    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    sampler = ResumableSampler(len(data), global_batch_size=4, seed=1)
    loaders = [build_train_loader(data, sampler, rank, 2) for rank in (0, 1)]
    seen = []
    for rank0, rank1 in zip(*loaders):
        assert isinstance(rank0, StepBatch) and len(rank0) + len(rank1) == sampler.next_window_size()
        assert torch.equal(rank0.targets, rank0.indices)  # the ids are the samples'
        seen += rank0.indices.tolist() + rank1.indices.tolist()
        sampler.advance()
        if len(seen) == 4:
            saved = sampler.state_dict()
            break
    resumed = ResumableSampler(len(data), global_batch_size=4, seed=1)
    resumed.load_state_dict(saved)
    for rank in (0, 1):
        for batch in build_train_loader(data, resumed, rank, 2):
            seen += batch.indices.tolist()
    assert sorted(seen) == list(range(10))
