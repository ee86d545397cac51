"""DiLoCo's strategy in real processes over real Gloo (issue 24): inner steps stay local, every outer step leaves
every rank with the same bits, and the outer step is the single-process oracle's (torch SGD on the mean
pseudo-gradient), for each of ringtrain's algorithms and odd world sizes."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch import nn

from ringtrain.comm.objects import all_gather_json
from ringtrain.config import CommConfig, DiLoCoConfig
from ringtrain.parallel import DiLoCoStrategy, build_strategy
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

H = 3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(rank: int, world_size: int, algorithm: str, steps: int) -> dict:
    """``steps`` inner SGD steps on rank-specific data through the strategy as the trainer builds it; digests
    of every rank after each step, and every rank's local parameters before each outer step."""
    strategy = build_strategy(CommConfig(strategy="diloco", algorithm=algorithm),
                              torch.device("cpu"), DiLoCoConfig(sync_every=H, outer_lr=OUTER_LR,
                                                                outer_momentum=OUTER_MOMENTUM))
    assert isinstance(strategy, DiLoCoStrategy)
    model = strategy.wrap(_model())
    optimizer = strategy.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    same_after, locals_before_outer = [], []
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        with strategy.no_sync(model):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        outer = strategy.sync_due(step, last=step == steps)
        if outer:
            locals_before_outer.append([p.detach().clone() for p in model.parameters()])
            strategy.outer_step()
        digests = all_gather_json(_digest(model))
        same_after.append((step, outer, len(set(digests)) == 1))
    return {"same_after": same_after, "locals": locals_before_outer,
            "final": [p.detach().clone() for p in model.parameters()], **strategy.figures()}


def oracle(per_rank_locals: list[list[list[torch.Tensor]]]) -> list[torch.Tensor]:
    """One process: torch's Nesterov SGD on the mean over ranks of (global - local), outer step after outer step."""
    global_ = [p.detach().clone() for p in _model().parameters()]
    outer = torch.optim.SGD(global_, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for k in range(len(per_rank_locals[0])):
        for i, g in enumerate(global_):
            g.grad = torch.stack([g.detach() - ranks[k][i] for ranks in per_rank_locals]).mean(0)
        outer.step()
    return global_


@pytest.mark.parametrize("world_size,algorithm", [(2, "torch"), (3, "ring"), (2, "shm")])
def test_inner_steps_stay_local_and_every_outer_step_leaves_every_rank_with_the_oracles_bits(world_size, algorithm):
    steps = 2 * H + 1  # two full intervals, then a last one of a single step (the run's last step syncs)
    results = run_distributed(train, world_size, algorithm, steps, timeout_s=120)
    for step, outer, same in results[0]["same_after"]:
        # Bit-identical after every outer step; different after an inner step (nothing was communicated).
        assert same == outer, (step, outer, same)
    assert [outer for _, outer, _ in results[0]["same_after"]] == [False, False, True, False, False, True, True]
    expected = oracle([r["locals"] for r in results])
    for got, want in zip(results[0]["final"], expected):
        # The mean is summed in another order than torch.stack().mean(): equal to rounding, not to the bit.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    payload = sum(p.numel() for p in _model().parameters()) * 4
    assert all(r["outer_steps"] == 3 and r["comm_bytes_per_worker"] == 3 * payload for r in results)


def rank_state_round_trip(rank: int, world_size: int) -> bool:
    """A rank's own state (its parameters and inner momentum) and the outer state load back into a fresh strategy."""
    def build():
        strategy = build_strategy(CommConfig(strategy="diloco"), torch.device("cpu"), DiLoCoConfig(sync_every=2))
        model = strategy.wrap(_model())
        return strategy, model, strategy.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    strategy, model, optimizer = build()
    for step in (1, 2, 3):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if strategy.sync_due(step):
            strategy.outer_step()
    # Copied, as a checkpoint's bytes are (torch's state_dict hands out the optimizer's own tensors).
    mine, outer = copy.deepcopy((strategy.state_dict(), strategy.stateful_parts()["outer"].state_dict()))
    fresh, fresh_model, fresh_optimizer = build()
    fresh.load_state_dict(mine)
    fresh.stateful_parts()["outer"].load_state_dict(outer)
    # One more step and outer step on both: the same bits, and different between ranks before the outer step.
    for s, m, o in ((strategy, model, optimizer), (fresh, fresh_model, fresh_optimizer)):
        x, y = _batch(rank, 4)
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        s.outer_step()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    return same and fresh.outer_steps == strategy.outer_steps == 2 and len(set(all_gather_json(_digest(model)))) == 1


def test_a_ranks_own_state_and_the_outer_state_resume_bit_for_bit():
    assert run_distributed(rank_state_round_trip, 2, timeout_s=60) == [True, True]


def warm_start(rank: int, world_size: int) -> list[bool]:
    """A checkpoint another strategy wrote (no ``outer`` part) loaded into a DiLoCo run: the outer loop starts at
    the loaded model, so an outer step right after it moves nothing (every rank holds that model: the mean
    pseudo-gradient is zero). From a stale global copy it would move half way back (outer_lr 0.5)."""
    from ringtrain.checkpoint.front import load_parts

    strategy = build_strategy(CommConfig(strategy="diloco"), torch.device("cpu"),
                              DiLoCoConfig(sync_every=1, outer_lr=0.5, outer_momentum=0.0))
    model = strategy.wrap(_model())
    trained = _model()  # "a DDP run's checkpoint": other weights than the ones the strategy started from
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(0.5).add_(0.25)
    saved = {"model": trained.state_dict()}

    class ModelPart:
        def state_dict(self):
            return model.state_dict()

        def load_state_dict(self, state):
            model.load_state_dict(state)

    load_parts({"model": ModelPart(), **strategy.stateful_parts()}, saved)
    strategy.outer_step()
    return [torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters())]


def test_a_checkpoint_of_another_strategy_starts_the_outer_loop_at_the_loaded_model():
    """A DDP run continued as DiLoCo (the paper warm-starts from a trained model): without the ``outer`` part the
    global copy would stay at the initial weights and the first outer step would pull every rank back there."""
    assert run_distributed(warm_start, 2, timeout_s=60) == [[True] * 4, [True] * 4]
