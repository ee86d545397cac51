"""Real Trainers inside ``run_distributed`` workers, and the tools tests use on them: the trainer
``ringtrain train`` builds, built inside a harness rank instead of a launched worker, for reference runs
that a chaos test compares a real, interrupted job against, and for tests that inject faults into a part.

    def check(rank, world_size, run_dir):
        trainer = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", ["train.max_steps=3"], run_dir)
        counter = count_gradient_syncs(trainer)
        trainer.fit()
        return counter.syncs
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ringtrain.config import load_config, validate_for_world_size
from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.train.build import build_trainer
from ringtrain.train.loop import Trainer
from ringtrain.train.resume import ResumePlan
from tests.faults import opt_in_of

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "build_test_trainer", "count_gradient_syncs", "flat_params", "params_of", "train_uninterrupted",
           "train_run", "make_image_folder"]


def build_test_trainer(
    rank: int, world_size: int, config: str | Path, overrides: list[str], run_dir: str | Path,
    fault_plan: str | Path | None = None,
) -> Trainer:
    """The trainer `ringtrain train` would build, on this harness's Gloo group (no progress bar); armed with the
    test's ``fault_plan`` (tests/faults.py) as a launched worker would be, if given (it stays armed in this
    process: its faults fire once per plan)."""
    config = load_config(REPO / config, [*overrides, "monitor.progress=false"], run_dir=str(run_dir))
    validate_for_world_size(config, world_size)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                  fault_plan=None if fault_plan is None else str(fault_plan), fault_plan_opt_in=opt_in_of(fault_plan))
    ctx = DistContext(env, "gloo", torch.device("cpu"), host_rank=rank, host_world_size=world_size)
    return build_trainer(config, ctx)


def count_gradient_syncs(trainer: Trainer) -> CommTimer:
    """The trainer strategy's CommTimer, which DDP's reducer calls for every bucket it all-reduces:
    ``.buckets`` handed over and ``.syncs`` completed (the bucket DDP marks last) since it was made."""
    return trainer.comm_timer


def flat_params(module: torch.nn.Module) -> np.ndarray:
    """The parameters as one numpy vector: a numpy array crosses the harness's queue by value (a tensor
    would go through shared memory, gone when the worker exits)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def params_of(trainer: Trainer) -> dict[str, np.ndarray]:
    """Parameters by name, as numpy arrays (see ``flat_params``)."""
    return {name: p.detach().numpy().copy() for name, p in trainer.module.named_parameters()}


def train_uninterrupted(rank: int, world_size: int, config: str, overrides: list[str], run_dir: str):
    """Train the job start to finish; return this rank's final parameters.

        params = run_distributed(train_uninterrupted, 2, "configs/debug_mlp.toml", ["train.epochs=4"], str(run_dir))[0]
    """
    trainer = build_test_trainer(rank, world_size, config, overrides, run_dir)
    trainer.resume(ResumePlan.fresh())
    trainer.fit()
    return params_of(trainer)


def train_run(rank: int, world_size: int, config: str, overrides: list[str], run_dir: str, resume: bool) -> None:
    """What ``ringtrain train CONFIG --set OVERRIDES --run-dir RUN_DIR [--resume]`` does in its workers: train
    to the end (or to train.max_steps), resuming from the newest checkpoint when ``resume`` (required then).
    A chaos test's reference run, without a launch (summary.json's param_sha256 is the oracle):

        run_distributed(train_run, 3, "configs/digits_mlp.toml", ["train.max_steps=10"], str(ref), False)
        run_distributed(train_run, 2, "configs/digits_mlp.toml", [], str(ref), True)
    """
    trainer = build_test_trainer(rank, world_size, config, overrides, run_dir)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    trainer.fit()


def make_image_folder(root: Path, train_per_class: int = 3, val_per_class: int = 2) -> None:
    """Two classes of solid-colour JPEGs of several sizes, in the ImageNet layout."""
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (48 + 8 * (i % 4), 40), colour).save(folder / f"{i}.jpg")
