"""Gradient accumulation across real Gloo workers, against one process on the full batch.

accelerate's test_sync pattern: K micro-batches on each of W workers must give the gradient one process
computes on the whole window: fixed-size batches, a short last window (with empty micro-batches), ragged
token batches, the recoverable (auto_micro_batch) path, and clipping of the synchronised gradient.
With SGD at lr 1 and no momentum, one step moves the weights by exactly the (clipped) gradient.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from ringtrain.config import load_config
from ringtrain.data import build_datasets
from ringtrain.data.text import IGNORE_INDEX, pad_collate
from ringtrain.models import build_model
from ringtrain.train.optim import lr_factor
from tests.distributed import run_distributed
from tests.faults import fault_plan, oom_at
from tests.trainers import REPO, build_test_trainer, count_gradient_syncs, flat_params

pytestmark = pytest.mark.ranks

PLAIN_SGD = ["train.optimizer=sgd", "train.lr=1.0", "train.momentum=0.0", "train.lr_schedule=constant",
             "train.warmup_steps=0", "train.weight_decay=0.0", "train.precision=fp32"]
MLP = ("configs/debug_mlp.toml", [*PLAIN_SGD, "model.hidden_sizes=[16]", "train.global_batch_size=48"])
TEXT = ("configs/debug_lm.toml", [*PLAIN_SGD, "model.n_layers=1", "model.d_model=16", "data.seq_len=32",
                                  "train.global_batch_size=24",
                                  "train.local_batch_size=4", "train.max_tokens=70", "train.grad_clip_norm=1e9"])

# name -> (job, extra overrides, samples left in the epoch before the step (None: a full window))
CASES = {
    "fixed": (MLP, ["train.local_batch_size=4"], None),
    "short_last_window": (MLP, ["train.local_batch_size=1"], 5),
    "short_last_window_recoverable": (MLP, ["train.local_batch_size=1", "train.auto_micro_batch=true"], 5),
    "clipped": (MLP, ["train.local_batch_size=4", "train.grad_clip_norm=0.05"], None),
    "ragged_tokens": (TEXT, ["train.auto_micro_batch=false"], None),
    "ragged_tokens_recoverable": (TEXT, ["train.auto_micro_batch=true"], None),
}


def one_step(rank: int, world_size: int, run_root: str) -> dict[str, dict]:
    """Every case's weights before and after one optimizer step, and the window's sample ids."""
    results = {}
    for name, ((config, job), extra, left) in CASES.items():
        trainer = build_test_trainer(rank, world_size, config, [*job, *extra], f"{run_root}/{name}")
        sampler = trainer.parts.sampler
        if left is not None:
            sampler.load_state_dict({**sampler.state_dict(), "cursor": sampler.num_samples - left})
        before = flat_params(trainer.module)
        batch = next(iter(trainer.parts.train_loader))
        micro_batches = len(trainer.batcher.plan(batch, sampler.next_window_size()).micro_batches)
        trainer.train_step(batch)
        shares: list = [None] * world_size
        dist.all_gather_object(shares, batch.indices.tolist())
        results[name] = {
            "before": before,
            "after": flat_params(trainer.module),
            "window": sorted(i for share in shares for i in share),
            "micro_batches": micro_batches,
        }
    return results


def full_batch_gradient(config_path: str, overrides: list[str], before: torch.Tensor, window: list[int]) -> torch.Tensor:
    """The oracle: one process, no DDP, no micro-batches, the mean loss over the whole window."""
    config = load_config(REPO / config_path, overrides)
    data = build_datasets(config.data)
    model = build_model(config.model, data)
    vector_to_parameters(before.clone(), model.parameters())
    samples = [data.train[i] for i in window]
    if config.data.dataset == "text":
        inputs, targets = pad_collate(samples)
        outputs = model(inputs)
        loss = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    else:
        inputs = torch.stack([s[0] for s in samples])
        targets = torch.stack([s[1] for s in samples])
        loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    if config.train.grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip_norm)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_accumulated_gradient_equals_the_full_batch_gradient(world_size, tmp_path):
    per_rank = run_distributed(one_step, world_size, str(tmp_path), timeout_s=120)
    for name, ((config, job), extra, left) in CASES.items():
        got = {k: torch.from_numpy(v) if k in ("before", "after") else v for k, v in per_rank[0][name].items()}
        for other in per_rank[1:]:
            assert (other[name]["after"] == per_rank[0][name]["after"]).all(), f"{name}: ranks disagree after the step"
        expected_window = left or load_config(REPO / config, [*job, *extra]).train.global_batch_size
        assert len(got["window"]) == len(set(got["window"])) == expected_window, name
        applied = got["before"] - got["after"]  # SGD, lr 1, no momentum: the gradient itself
        reference = full_batch_gradient(config, [*job, *extra], got["before"], got["window"])
        torch.testing.assert_close(applied, reference, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    # The cases did accumulate: more than one micro-batch per rank.
    assert per_rank[0]["fixed"]["micro_batches"] == 48 // (4 * world_size)
    assert per_rank[0]["ragged_tokens"]["micro_batches"] > 1


def syncs_per_run(rank: int, world_size: int, run_dir: str, overrides: list[str], plan: str | None) -> dict:
    job = ["train.global_batch_size=64", "train.local_batch_size=8", "train.max_steps=6", "train.warmup_steps=2",
           "train.lr_schedule=cosine", "monitor.log_every_steps=1", *overrides]
    trainer = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", job, run_dir, fault_plan=plan)
    counter = count_gradient_syncs(trainer)
    trainer.fit()
    return {"syncs": counter.syncs, "steps": trainer.state.step, "scheduler_steps": trainer.parts.scheduler.last_epoch,
            "micro_batch_size": trainer.batcher.micro_batch_size}


@pytest.mark.parametrize(
    "overrides,oom,micro_batch_size",
    [
        ([], False, 8),
        (["train.auto_micro_batch=true"], False, 8),
        (["train.auto_micro_batch=true"], True, 4),
    ],
    ids=["ddp_no_sync", "recoverable", "recoverable_with_oom"],
)
def test_one_gradient_all_reduce_and_one_lr_step_per_optimizer_step(tmp_path, overrides, oom, micro_batch_size):
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, oom_at(step=2, member=1)) if oom else None
    results = run_distributed(syncs_per_run, 2, str(run_dir), overrides, plan and str(plan.path), timeout_s=120)
    if plan is not None:
        assert plan.fired_points() == ["step.micro_batch"]
    for result in results:
        # 64 = 8 x 4 micro-batches x 2 workers: 4 backward passes per step, one all-reduce.
        assert result["steps"] == 6
        assert result["syncs"] == 6, f"{result['syncs']} gradient all-reduces in 6 optimizer steps"
        assert result["scheduler_steps"] == 6
        assert result["micro_batch_size"] == micro_batch_size
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = [(r["step"], r["lr"]) for r in records if r["type"] == "train"]
    assert [step for step, _ in lrs] == [1, 2, 3, 4, 5, 6]
    for step, lr in lrs:
        assert lr == pytest.approx(0.1 * lr_factor(step, 6, 2, "cosine")), f"lr after step {step}"
