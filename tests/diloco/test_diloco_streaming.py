"""Streaming DiLoCo (issue 24) in real processes over real Gloo: fragments that sync in turn, a delay between a
fragment's exchange and its outer step, and pseudo-gradients sent as bf16, int8 or int4 with error feedback.

Each run is checked against a one-process oracle written from the papers' description, not from the strategy:
its own schedule (fragment f exchanges after the steps s with (s + tau) % H == (f + 1) H / F % H and steps
tau later; the run's last step syncs every fragment at once, superseding an exchange in flight), its own
Nesterov SGD, its own error feedback; only the packet format is shared (``comm/codec.py``, tested alone in
tests/diloco/test_codec.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from ringtrain.comm import codec
from ringtrain.comm.objects import all_gather_json
from ringtrain.config import CommConfig, DiLoCoConfig
from ringtrain.parallel import DiLoCoStrategy, build_strategy
from tests.distributed import run_distributed

# The model and data of tests/diloco/test_diloco.py (and its outer settings). Its tensors hold 48, 8, 24 and
# 3 values: two fragments are [48] and [8, 24, 3] (cut nearest half of 83).
from tests.diloco.test_diloco import OUTER_LR, OUTER_MOMENTUM, _batch, _model

pytestmark = pytest.mark.ranks


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(rank: int, world_size: int, algorithm: str, steps: int, diloco: dict) -> dict:
    strategy = build_strategy(CommConfig(strategy="diloco", algorithm=algorithm), torch.device("cpu"),
                              DiLoCoConfig(outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, **diloco))
    assert isinstance(strategy, DiLoCoStrategy)
    model = strategy.wrap(_model())
    optimizer = strategy.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    locals_, equal_after = {}, []
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        locals_[step] = [p.detach().clone() for p in params]
        last = step == steps
        if strategy.sync_due(step, last):
            strategy.outer_step(step, last)
        # Per tensor: is it the same on every rank now?
        digests = all_gather_json([_digest([p]) for p in params])
        equal_after.append([len({d[i] for d in digests}) == 1 for i in range(len(params))])
    return {"locals": locals_, "equal_after": equal_after, "final": [p.detach().clone() for p in params],
            "fragments": [[next(i for i, q in enumerate(params) if q is p) for p in f.params] for f in strategy.fragments], **strategy.figures()}


def oracle(per_rank_locals: list[dict], steps: int, fragments: list[list[int]], H: int, tau: int, dtype: str):
    """The global parameters after ``steps``, the steps after which each tensor's outer step was applied, and the
    bytes each worker sent: DiLoCo as the papers describe it, by hand."""
    world, F = len(per_rank_locals), len(fragments)
    global_ = [p.detach().clone() for p in _model().parameters()]
    momentum = [torch.zeros_like(g) for g in global_]
    errors = [[torch.zeros(sum(global_[i].numel() for i in f)) for f in fragments] for _ in range(world)]
    in_flight: dict[int, tuple[torch.Tensor, list]] = {}  # fragment -> (mean, the errors before its exchange)
    applied = {i: [] for i in range(len(global_))}
    sent = 0

    def exchange(f: int, step: int) -> tuple[torch.Tensor, list]:
        nonlocal sent
        before = [errors[r][f].clone() for r in range(world)]
        total = torch.zeros_like(before[0])
        for r in range(world):
            delta = torch.cat([(global_[i] - per_rank_locals[r][step][i]).reshape(-1) for i in fragments[f]])
            if dtype == "fp32":
                total += delta
                continue
            delta = delta + errors[r][f]
            decoded = codec.decode(codec.encode(delta, dtype), dtype, delta.numel())
            errors[r][f] = delta - decoded
            total += decoded
        sent += total.numel() * 4 if dtype == "fp32" else codec.packet_bytes(total.numel(), dtype)
        return total / world, before

    def outer(f: int, mean: torch.Tensor, step: int) -> None:
        offset = 0
        for i in fragments[f]:
            g = mean[offset : offset + global_[i].numel()].view_as(global_[i])
            offset += global_[i].numel()
            momentum[i] = OUTER_MOMENTUM * momentum[i] + g
            global_[i] -= OUTER_LR * (g + OUTER_MOMENTUM * momentum[i])  # Nesterov
            applied[i].append(step)

    for step in range(1, steps + 1):
        for f in range(F):
            offset = (f + 1) * (H // F) % H
            if step == steps:  # the run's last step: every fragment at once, an exchange in flight dropped
                if f in in_flight:
                    _, before = in_flight.pop(f)
                    for r in range(world):
                        errors[r][f] = before[r]
                outer(f, exchange(f, step)[0], step)
                continue
            if (step + tau) % H == offset:
                in_flight[f] = exchange(f, step)
            if step % H == offset:
                outer(f, in_flight.pop(f)[0], step)
    return global_, applied, sent


CASES = [
    # (world size, algorithm, steps, [diloco]); the delayed torch case's exchange is an asynchronous op.
    pytest.param(2, "torch", 11, dict(sync_every=8, fragments=2, delay=2), id="F2-tau2-fp32-torch-async"),
    pytest.param(3, "ring", 11, dict(sync_every=8, fragments=2, delay=2, dtype="int4"), id="F2-tau2-int4-ring"),
    pytest.param(2, "shm", 7, dict(sync_every=3, dtype="int8"), id="F1-int8-shm"),
    pytest.param(2, "torch", 6, dict(sync_every=4, fragments=4, dtype="bf16"), id="F4-bf16-torch"),
    pytest.param(2, "torch", 11, dict(sync_every=8, fragments=2, delay=2, dtype="int8"), id="F2-tau2-int8-torch-async"),
]


@pytest.mark.parametrize("world_size,algorithm,steps,diloco", CASES)
def test_fragments_sync_in_turn_as_the_oracle_says_with_every_rank_on_the_same_bits(world_size, algorithm, steps,
                                                                                   diloco):
    results = run_distributed(train, world_size, algorithm, steps, diloco, timeout_s=180)
    H, tau, dtype = diloco["sync_every"], diloco.get("delay", 0), diloco.get("dtype", "fp32")
    fragments = results[0]["fragments"]
    if diloco.get("fragments", 1) == 2:
        assert fragments == [[0], [1, 2, 3]]
    expected, applied, sent = oracle([r["locals"] for r in results], steps, fragments, H, tau, dtype)
    # A tensor is the same on every rank exactly after the steps its fragment's outer step was applied at
    # (the last step's included); inner steps move the ranks apart again.
    for i, steps_applied in applied.items():
        equal_at = [s + 1 for s, row in enumerate(results[0]["equal_after"]) if row[i]]
        assert equal_at == steps_applied, (i, equal_at, steps_applied)
    assert applied[0][-1] == steps and all(s[-1] == steps for s in applied.values())
    for r in results:  # one model everywhere at the end, the oracle's
        assert _digest(r["final"]) == _digest(results[0]["final"])
    for got, want in zip(results[0]["final"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(r["comm_bytes_per_worker"] == sent for r in results), ([r["comm_bytes_per_worker"] for r in results],
                                                                     sent)
    assert results[0]["outer_steps"] == sum(len(applied[f[0]]) for f in fragments)


def three_runs(rank: int, world_size: int, steps: int, diloco: dict) -> list[list[torch.Tensor]]:
    """fp32, int4, and int4 with the error buffer zeroed after every exchange, one after another in one group."""
    exact = train(rank, world_size, "torch", steps, diloco)["final"]
    fed = train(rank, world_size, "torch", steps, {**diloco, "dtype": "int4"})["final"]
    original = DiLoCoStrategy._prepare

    def forgetful(self, fragment):
        original(self, fragment)
        fragment.error.zero_()

    DiLoCoStrategy._prepare = forgetful
    try:
        blind = train(rank, world_size, "torch", steps, {**diloco, "dtype": "int4"})["final"]
    finally:
        DiLoCoStrategy._prepare = original
    return [exact, fed, blind]


def test_compressed_pseudo_gradients_stay_close_to_fp32_and_error_feedback_is_what_keeps_them_close():
    """int4 with error feedback ends near the fp32 run; the same int4 without it ends several times further."""
    exact, fed, blind = run_distributed(three_runs, 2, 24, dict(sync_every=2), timeout_s=180)[0]

    def distance(a, b):
        return float(torch.cat([(x - y).reshape(-1) for x, y in zip(a, b)]).norm())

    print(f"int4 vs fp32: with error feedback {distance(fed, exact):.3g}, without {distance(blind, exact):.3g}")
    assert distance(fed, exact) * 2 < distance(blind, exact)


def scored_weights(rank: int, world_size: int) -> dict:
    """Three inner steps apart (H = 4): inside ``evaluation_weights`` every rank holds the global model (the
    same bits everywhere: the one the last outer step made); after it, each its own parameters again."""
    strategy = build_strategy(CommConfig(strategy="diloco"), torch.device("cpu"), DiLoCoConfig(sync_every=4))
    model = strategy.wrap(_model())
    optimizer = strategy.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started = _digest(model.parameters())
    for step in (1, 2, 3):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert not strategy.sync_due(step)
    own = _digest(model.parameters())
    with strategy.evaluation_weights():
        inside = _digest(model.parameters())
    return {"started": started, "own": own, "inside": inside, "after": _digest(model.parameters())}


def test_evaluation_scores_the_global_model_and_gives_each_worker_its_own_back():
    results = run_distributed(scored_weights, 2, timeout_s=60)
    assert results[0]["own"] != results[1]["own"]  # the workers moved apart
    # The global model: no outer step yet, so the model every rank started from.
    assert {r["inside"] for r in results} == {results[0]["started"]}
    assert all(r["after"] == r["own"] for r in results)
