"""A user's loss gives the full-batch gradient under accumulation, uneven shares and token budgets.

accelerate's test_sync pattern on ``fit``'s parts (the trainer ``build_trainer`` makes from ``UserParts``):
one optimizer step of plain SGD at lr 1 on W real Gloo workers moves the weights by exactly the gradient
one process computes on the whole window with the mean loss. Losses: a user's mean (``F.cross_entropy``),
a user's sum with ``loss_reduction="sum"``, the built-in ``"mse"``, and a per-token sum over sequences cut
by ``train.max_tokens`` (items are tokens: every token weighs the same whichever micro-batch holds it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from ringtrain.config import load_config_dict
from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext
from ringtrain.train.build import build_trainer
from ringtrain.train.user_parts import UserParts
from tests.distributed import run_distributed
from tests import user_code
from tests.trainers import flat_params

pytestmark = pytest.mark.ranks

PLAIN_SGD = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.0, "lr_schedule": "constant", "weight_decay": 0.0}


def regression_data():
    train, _ = user_code.digits()
    x, y = train.tensors
    return torch.utils.data.TensorDataset(x, (y.float() - 4.5) / 3)


def regression_model():
    return torch.nn.Linear(64, 1)


# name -> (parts, train config, samples left in the epoch before the step (None: a full window))
CASES = {
    "mean_loss": (dict(model=user_code.digits_mlp, loss=user_code.mean_cross_entropy),
                  {"global_batch_size": 48, "local_batch_size": 4}, None),
    "sum_loss": (dict(model=user_code.digits_mlp, loss=user_code.sum_cross_entropy, loss_reduction="sum"),
                 {"global_batch_size": 48, "local_batch_size": 4}, None),
    "mean_loss_uneven": (dict(model=user_code.digits_mlp, loss=user_code.mean_cross_entropy),
                         {"global_batch_size": 48, "local_batch_size": 1}, 5),
    "mse_uneven": (dict(model=regression_model, loss="mse", data=regression_data),
                   {"global_batch_size": 48, "local_batch_size": 2}, 7),
    "token_budget": (dict(model=user_code.TinyLM, loss=user_code.token_sum_loss, loss_reduction="sum",
                          data=user_code.Sequences, collate_fn=user_code.pad_sequences),
                     {"global_batch_size": 24, "local_batch_size": 4, "max_tokens": 40}, None),
    "token_budget_builtin": (dict(model=user_code.TinyLM, loss="cross_entropy", data=user_code.Sequences,
                                  collate_fn=user_code.pad_sequences),
                             {"global_batch_size": 24, "local_batch_size": 4, "max_tokens": 40,
                              "auto_micro_batch": True}, None),
}


def user_parts(spec: dict) -> UserParts:
    spec = dict(spec)
    data = spec.pop("data", None)
    train = data() if data else user_code.digits()[0]
    return UserParts.checked(train_data=train, **spec)


def one_step(rank: int, world_size: int, run_root: str) -> dict:
    results = {}
    ctx = DistContext(DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size),
                      "gloo", torch.device("cpu"), host_rank=rank, host_world_size=world_size)
    for name, (spec, train, left) in CASES.items():
        # The factories are named for the record, as fit() does; the parts themselves are handed over.
        config = load_config_dict({"model": {"factory": "tests.user_code:digits_mlp"},
                                   "data": {"factory": "tests.user_code:digits"},
                                   "train": {**PLAIN_SGD, **train}, "monitor": {"progress": False}},
                                  run_dir=f"{run_root}/{name}")
        trainer = build_trainer(config, ctx, parts=user_parts(spec))
        sampler = trainer.parts.sampler
        if left is not None:
            sampler.load_state_dict({**sampler.state_dict(), "cursor": sampler.num_samples - left})
        before = flat_params(trainer.module)
        batch = next(iter(trainer.parts.train_loader))
        micro = len(trainer.batcher.plan(batch, sampler.next_window_size()).micro_batches)
        trainer.train_step(batch)
        shares: list = [None] * world_size
        dist.all_gather_object(shares, batch.indices.tolist())
        results[name] = {"before": before, "after": flat_params(trainer.module), "micro_batches": micro,
                         "window": sorted(i for share in shares for i in share)}
    return results


def full_batch_gradient(spec: dict, before: torch.Tensor, window: list[int]) -> torch.Tensor:
    """One process, no DDP, no micro-batches: the mean loss over the window's items (samples, or tokens)."""
    parts = user_parts(spec)
    model = parts.build_model(seed=0)
    vector_to_parameters(before.clone(), model.parameters())
    samples = [parts.train_data[i] for i in window]
    inputs, targets = (parts.collate_fn or torch.utils.data.default_collate)(samples)
    outputs = model(inputs)
    if parts.task.loss == "mse":
        loss = F.mse_loss(outputs.reshape(targets.shape), targets)
    elif targets.dim() == 2:  # tokens: the mean over every real target token of the window
        loss = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100)
    else:
        loss = F.cross_entropy(outputs, targets)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_user_loss_gives_the_full_batch_gradient(world_size, tmp_path):
    per_rank = run_distributed(one_step, world_size, str(tmp_path), timeout_s=120)
    for name, (spec, train, left) in CASES.items():
        got = {k: torch.from_numpy(v) if k in ("before", "after") else v for k, v in per_rank[0][name].items()}
        for other in per_rank[1:]:
            assert (other[name]["after"] == per_rank[0][name]["after"]).all(), f"{name}: ranks disagree"
        assert len(got["window"]) == len(set(got["window"])) == (left or train["global_batch_size"]), name
        applied = got["before"] - got["after"]  # SGD at lr 1: the gradient itself
        reference = full_batch_gradient(spec, got["before"], got["window"])
        torch.testing.assert_close(applied, reference, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    assert per_rank[0]["mean_loss"]["micro_batches"] == 48 // (4 * world_size), "no accumulation"
    assert per_rank[0]["token_budget"]["micro_batches"] > 1, "the token budget cut no micro-batches"
