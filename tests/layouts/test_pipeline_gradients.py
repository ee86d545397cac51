"""The pipeline's loss normaliser, seen in one plain-SGD step (issue 45): with SGD at lr 1 and no momentum a step
moves the weights by exactly the gradient, so a pipeline of 2 stages (4 micro-batches, the tied embedding's two
gradients added) must move the whole model as one process does with the mean loss over the step's window. The
bit-exact AdamW runs of test_pipeline_parallel.py hardly see a gradient's scale (a 4x error in the normaliser
moved a loss by 3e-5). Bound: test_accumulation.py's (the sums run in another order than the oracle's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringtrain.config import load_config
from ringtrain.data import build_datasets
from ringtrain.data.text import IGNORE_INDEX, pad_collate
from ringtrain.models import build_model
from tests.distributed import run_distributed
from tests.data.test_accumulation import PLAIN_SGD
from tests.trainers import REPO, build_test_trainer

pytestmark = pytest.mark.ranks

CONFIG = "configs/debug_lm.toml"
JOB = [*PLAIN_SGD, "model.n_layers=2", "model.d_model=16", "data.seq_len=32", "train.global_batch_size=8",
       "train.local_batch_size=2", "train.auto_micro_batch=false", "train.grad_clip_norm=1e9"]
BOUND = dict(rtol=1e-4, atol=2e-6)


def _one_step(rank: int, world_size: int, run_dir: str, schedule: str) -> dict:
    trainer = build_test_trainer(rank, world_size, CONFIG, [*JOB, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                                            "parallel.pp_microbatches=4"], run_dir)
    strategy = trainer.parts.strategy
    before = {k: v.clone() for k, v in strategy.full_named_parameters(trainer.model).items()}
    batch = next(iter(trainer.parts.train_loader))
    trainer.train_step(batch)
    after = strategy.full_named_parameters(trainer.model)
    return {"before": {k: v.numpy() for k, v in before.items()}, "after": {k: v.numpy() for k, v in after.items()},
            "window": batch.indices.tolist()}


def _full_batch_step(before: dict[str, torch.Tensor], window: list[int]) -> dict[str, torch.Tensor]:
    """The oracle: one process, the unsplit model, the mean loss over the window's target tokens."""
    config = load_config(REPO / CONFIG, JOB)
    data = build_datasets(config.data)
    model = build_model(config.model, data)
    model.load_state_dict({**model.state_dict(), **before})
    inputs, targets = pad_collate([data.train[i] for i in window])
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    with torch.no_grad():
        return {name: p - p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_sgd_step_through_two_stages_is_the_full_batchs(tmp_path, schedule):
    ranks = run_distributed(_one_step, 2, str(tmp_path / "run"), schedule, timeout_s=120)
    result = ranks[0]
    assert sorted(result["window"]) == sorted(ranks[1]["window"]) and len(result["window"]) == 8
    before = {k: torch.from_numpy(v) for k, v in result["before"].items()}
    expected = _full_batch_step(before, result["window"])
    assert set(expected) == set(result["after"])
    for name, value in expected.items():
        torch.testing.assert_close(torch.from_numpy(result["after"][name]), value, **BOUND, msg=name)
        assert not torch.equal(value, before[name]), f"{name}: the step moved nothing"
