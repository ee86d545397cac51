"""Healing's state agreement on real Gloo processes: a collective can complete on one rank and fail on the
others, so after regrouping one survivor may have applied a step the others have not. ``heal.transfer.agree_on_state``
must bring every rank to that newest state (parameters, optimizer moments, sampler cursor, step), from the
rank that has it, and leave nothing to copy when all agree already.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ringtrain.heal.transfer import agree_on_state, state_digest
from ringtrain.train.resume import ResumePlan
from tests.distributed import run_distributed
from tests.faults import Fault, fault_plan
from tests.trainers import build_test_trainer

pytestmark = pytest.mark.ranks

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(state.items()):
            digest.update(f"{index}/{name}".encode())
            digest.update(torch.as_tensor(value).reshape(-1).numpy().tobytes())
    return digest.hexdigest()


def _agree_on_state(trainer):
    return agree_on_state(trainer.position, state_digest(trainer.module), trainer.transfer_state,
                          trainer.load_transfer_state)


def roll_forward(rank: int, world_size: int, run_dir: str, ahead_rank: int | None, fault_plan: str | None = None):
    trainer = build_test_trainer(rank, world_size, str(DEBUG), ["train.momentum=0.9", "train.global_batch_size=96"],
                                 f"{run_dir}/{rank}", fault_plan=fault_plan)
    trainer.resume(ResumePlan())
    batches = iter(trainer.parts.train_loader)
    for _ in range(2):
        trainer.train_step(next(batches))
    agreed_before = _agree_on_state(trainer)
    if rank == ahead_rank:
        # This rank applied step 3 on its own (its collectives completed; the others' failed).
        for param in trainer.module.parameters():
            param.grad = torch.full_like(param, 0.01 * (1 + rank))
        trainer.parts.optimizer.step()
        trainer.parts.scheduler.step()
        trainer.parts.optimizer.zero_grad(set_to_none=True)
        trainer.state.samples_seen += trainer.parts.sampler.advance()
        trainer.state.step += 1
    source = _agree_on_state(trainer)
    return (agreed_before, source, trainer.state.step, trainer.parts.sampler.cursor, trainer.state.samples_seen,
            state_digest(trainer.module), optimizer_digest(trainer.parts.optimizer),
            trainer.parts.scheduler.last_epoch)


def test_survivors_behind_receive_the_newest_state_from_the_rank_that_applied_it(tmp_path):
    results = run_distributed(roll_forward, 3, str(tmp_path), 1)
    assert all(r[0] is None for r in results), "after two steps together nothing differs: nothing is copied"
    assert all(r[1] == 1 for r in results), [r[1] for r in results]  # copied from rank 1, the one ahead
    states = {r[2:] for r in results}
    assert len(states) == 1, states  # step, cursor, samples, parameters, optimizer moments, lr position
    step, cursor, samples, _, _, lr_position = states.pop()
    assert step == 3 and cursor == samples == 3 * 96 and lr_position == 3


def test_nothing_is_copied_when_every_survivor_is_at_the_same_step(tmp_path):
    results = run_distributed(roll_forward, 2, str(tmp_path), None)
    assert all(r[1] is None for r in results) and len({r[2:] for r in results}) == 1


def test_a_state_corrupted_in_transit_is_refused_and_sent_again(tmp_path):
    """The sender's bytes get one byte flipped on the wire on the first send (fault point heal.transfer, once per
    job): every receiver's sha256 check refuses it before reading it, and the second send goes through whole."""
    plan = fault_plan(tmp_path, Fault("heal.transfer", action="flip", offset=100, rank=1))
    results = run_distributed(roll_forward, 3, str(tmp_path), 1, str(plan.path))
    assert [(f["point"], f["rank"]) for f in plan.fired()] == [("heal.transfer", 1)]  # rank 1, the one ahead, sent
    assert all(r[1] == 1 for r in results)
    assert len({r[2:] for r in results}) == 1  # and every rank ended at its state
    assert results[0][2] == 3
