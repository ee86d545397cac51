"""Randomness derived, not carried (data/seeding.py): a sample's augmentation from (seed, epoch, sample id),
the model's randomness from (seed, step, rank).

- two ranks draw different dropout masks in the same step;
- a sample's augmented tensor is the same at world size 1 and 2, with or without loader workers;
- a resume with random crops and 2 DataLoader workers per rank is bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ringtrain.config import load_config
from ringtrain.data import ResumableSampler, build_datasets, build_train_loader
from ringtrain.train.resume import ResumePlan
from tests.distributed import run_distributed
from tests.trainers import REPO, build_test_trainer, params_of

pytestmark = pytest.mark.ranks

DEBUG_LM = REPO / "configs" / "debug_lm.toml"
DEBUG_RESNET = REPO / "configs" / "debug_resnet.toml"


def dropout_masks(rank: int, world_size: int, run_dir: str) -> list[np.ndarray]:
    trainer = build_test_trainer(rank, world_size, DEBUG_LM, ["train.max_steps=2", "model.dropout=0.5"], run_dir)
    masks: list[np.ndarray] = []
    dropout = next(m for m in trainer.module.modules() if isinstance(m, torch.nn.Dropout))
    # The mask of the first micro-batch of each step: which inputs the dropout zeroed.
    dropout.register_forward_hook(lambda m, args, out: masks.append((out == 0).flatten()[:4096].numpy().copy()))
    trainer.resume(ResumePlan.fresh())
    trainer.fit()
    return masks


def test_two_ranks_draw_different_dropout_masks(tmp_path):
    rank0, rank1 = run_distributed(dropout_masks, 2, str(tmp_path / "run"))
    first0, first1 = rank0[0], rank1[0]
    size = min(len(first0), len(first1))
    agree = float((first0[:size] == first1[:size]).mean())
    print(f"dropout p=0.5, step 1, first micro-batch: the ranks' masks agree on {agree:.1%} of positions")
    assert 0.3 < agree < 0.7, "both ranks drew the same dropout mask"


def augmented_samples(world_size: int, num_workers: int) -> dict[int, torch.Tensor]:
    """Every training sample of epoch 0 as this world size's ranks load it (random crops on)."""
    config = load_config(DEBUG_RESNET, ["data.crop_scale_min=0.3", "data.hflip=true"])
    data = build_datasets(config.data)
    samples: dict[int, torch.Tensor] = {}
    for rank in range(world_size):
        sampler = ResumableSampler(len(data.train), 64, seed=0)
        loader = build_train_loader(data.train, sampler, rank, world_size, num_workers=num_workers)
        for step, batch in enumerate(loader):
            if step == 4:
                break
            samples.update(zip(batch.indices.tolist(), batch.inputs))
    return samples


def test_a_sample_is_augmented_the_same_at_any_world_size_and_loader_worker():
    alone, pair, pair_workers = augmented_samples(1, 0), augmented_samples(2, 0), augmented_samples(2, 2)
    assert set(alone) == set(pair) == set(pair_workers) and len(alone) == 256
    for index, image in alone.items():
        assert torch.equal(image, pair[index]), f"sample {index} differs between 1 and 2 workers"
        assert torch.equal(image, pair_workers[index]), f"sample {index} differs with loader workers"
    # The crops are random: two samples of one class do not come out the same.
    assert len({alone[i].sum().item() for i in alone}) > 250


def train_on_crops(rank: int, world_size: int, run_dir: str, resume: bool, stop_at: int | None):
    trainer = build_test_trainer(rank, world_size, DEBUG_RESNET,
                                 ["train.max_steps=6", "data.num_workers=2", "monitor.log_every_steps=1",
                                  "model.name='mlp'", "model.hidden_sizes=[32]"], run_dir)
    if stop_at is not None:
        trainer.total_steps = stop_at  # interrupted after this step (the schedule still plans 6)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    summary = trainer.fit()
    return summary["param_sha256"], params_of(trainer)


def test_resume_with_random_crops_and_loader_workers_is_bit_exact(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    ref = run_distributed(train_on_crops, 2, straight, False, None, timeout_s=120)
    run_distributed(train_on_crops, 2, split, False, 3, timeout_s=120)
    got = run_distributed(train_on_crops, 2, split, True, None, timeout_s=120)
    assert got[0][0] == ref[0][0], "the resumed run's parameters differ from the uninterrupted run's"
    for name, tensor in ref[0][1].items():
        assert np.array_equal(tensor, got[0][1][name]), name
    assert Path(split, "checkpoints").is_dir()
