"""DiLoCo with replicas of several workers (issue 24's composition, INTELLECT-1's shape): the workers of one host
train as one data-parallel replica (DDP inside it, every step) and only the hosts' leaders exchange
pseudo-gradients. Four real processes on two "hosts" (``hosts=`` names them, as ``shm.init_shm`` takes them;
tests/multihost runs the same through ``ringtrain train`` on two network namespaces)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.comm.objects import all_gather_json
from ringtrain.parallel.diloco import DiLoCoStrategy, replicas_of
from tests.diloco.test_diloco import OUTER_LR, OUTER_MOMENTUM, _batch, _digest, _model

HOSTS = ["a", "a", "b", "b"]
LR = 0.1


def train(rank: int, world_size: int, algorithm: str, steps: int, sync_every: int, fragments: int, delay: int,
          dtype: str) -> dict:
    strategy = DiLoCoStrategy(torch.device("cpu"), sync_every=sync_every, outer_lr=OUTER_LR,
                              outer_momentum=OUTER_MOMENTUM, algorithm=algorithm, fragments=fragments, delay=delay,
                              dtype=dtype, inner="auto", hosts=HOSTS)
    model = strategy.wrap(_model())
    optimizer = strategy.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    digests = []
    for step in range(1, steps + 1):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if strategy.sync_due(step, last=step == steps):
            strategy.outer_step(step, last=step == steps)
        digests.append(all_gather_json(_digest(model)))
    return {"digests": digests, "final": [p.detach().clone() for p in strategy.unwrap(model).parameters()],
            "leader": strategy.is_leader, **strategy.figures()}


def oracle(steps: int, sync_every: int) -> list[torch.Tensor]:
    """One process: two replicas, each stepping SGD on the mean gradient of its two ranks' batches; every H steps
    (and at the last) Nesterov SGD on the mean of (global - replica), which both replicas then take."""
    global_ = [p.detach().clone() for p in _model().parameters()]
    outer = torch.optim.SGD(global_, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    replicas = [_model() for _ in range(2)]
    for step in range(1, steps + 1):
        for index, replica in enumerate(replicas):
            grads = []
            for rank in (2 * index, 2 * index + 1):
                replica.zero_grad()
                x, y = _batch(rank, step)
                nn.functional.cross_entropy(replica(x), y).backward()
                grads.append([p.grad.clone() for p in replica.parameters()])
            with torch.no_grad():
                for i, p in enumerate(replica.parameters()):
                    p -= LR * (grads[0][i] + grads[1][i]) / 2
        if step % sync_every == 0 or step == steps:
            for i, g in enumerate(global_):
                g.grad = torch.stack([g.detach() - list(r.parameters())[i].detach() for r in replicas]).mean(0)
            outer.step()
            with torch.no_grad():
                for replica in replicas:
                    for p, g in zip(replica.parameters(), global_):
                        p.copy_(g)
    return global_


@pytest.mark.unit
def test_replicas_of_follow_the_hosts():
    assert replicas_of(["a", "a", "b", "b"], "auto") == [[0, 1], [2, 3]]
    assert replicas_of(["a", "b", "a", "b"], "host") == [[0, 2], [1, 3]]
    assert replicas_of(["a", "b"], "auto") == [[0], [1]]  # one worker a host: every worker its own replica
    assert replicas_of(["a", "a"], "auto") == [[0], [1]]  # one host: the same
    assert replicas_of(["a", "a", "b", "b"], "worker") == [[0], [1], [2], [3]]


@pytest.mark.ranks
@pytest.mark.parametrize("algorithm", ["torch", "shm"])
def test_a_hosts_workers_are_one_replica_and_the_outer_steps_are_the_oracles(algorithm):
    steps, sync_every = 7, 3
    results = run(algorithm, steps, sync_every, fragments=1, delay=0, dtype="fp32")
    for step, digests in enumerate(results[0]["digests"], start=1):
        synced = step % sync_every == 0 or step == steps
        # Every step: the two ranks of a host hold the same bits (DDP inside the replica). Between outer steps
        # the hosts differ (nothing crossed); after one, every rank holds the same model.
        assert digests[0] == digests[1] and digests[2] == digests[3], (step, digests)
        assert (digests[0] == digests[2]) == synced, (step, digests)
    for got, want in zip(results[0]["final"], oracle(steps, sync_every)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    payload = sum(p.numel() for p in _model().parameters()) * 4
    # Only the leaders (ranks 0 and 2) put pseudo-gradients on the link between hosts: one payload an outer step.
    assert [r["leader"] for r in results] == [True, False, True, False]
    assert [r["comm_bytes_per_worker"] for r in results] == [3 * payload, 0, 3 * payload, 0]
    assert all(r["diloco_replicas"] == 2 and r["outer_steps"] == 3 for r in results)


@pytest.mark.ranks
def test_streaming_quantised_replicas_stay_in_step_inside_each_host():
    """Two fragments with a delay of one step, int8 packets with error feedback: every
    rank of a host holds the same bits at every step, and the run ends on one model (torch's asynchronous ops)."""
    steps, sync_every = 9, 4
    results = run("torch", steps, sync_every, fragments=2, delay=1, dtype="int8")
    for step, digests in enumerate(results[0]["digests"], start=1):
        assert digests[0] == digests[1] and digests[2] == digests[3], (step, digests)
    assert len(set(results[0]["digests"][-1])) == 1
    assert all(r["outer_steps"] == results[0]["outer_steps"] > 0 for r in results)
    assert results[1]["comm_bytes_per_worker"] == 0 < results[0]["comm_bytes_per_worker"]


def run(algorithm: str, steps: int, sync_every: int, fragments: int, delay: int, dtype: str) -> list[dict]:
    from tests.distributed import run_distributed

    return run_distributed(train, 4, algorithm, steps, sync_every, fragments, delay, dtype, timeout_s=120)


def heal_with_a_joiner(rank: int, world_size: int) -> dict:
    """Two host replicas train with Adam (state that differs between the replicas), then a heal regroups them
    as ``Trainer.regroup`` does: each rank abandons the interval, a new strategy wraps the same module and takes
    over; rank 3 stands for a joiner, holding the inner optimizer state it received from rank 0 (another
    replica's rank: what a heal's transfer sends). Returns every rank's digests over the inner steps after."""
    def build() -> DiLoCoStrategy:
        return DiLoCoStrategy(torch.device("cpu"), sync_every=100, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                              inner="auto", hosts=HOSTS)

    def inner_steps(model, optimizer, strategy, steps) -> list[list[str]]:
        digests = []
        for step in steps:
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            digests.append(all_gather_json(_digest(strategy.unwrap(model))))
        return digests

    old = build()
    model = old.wrap(_model())
    optimizer = old.shard_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    inner_steps(model, optimizer, old, range(1, 4))
    from ringtrain.comm.objects import broadcast_weights_only

    received = broadcast_weights_only(optimizer.state_dict() if rank == 0 else None, 0)
    if rank == 3:
        optimizer.load_state_dict(received)
    old.abandon_interval()
    module = old.unwrap(model)
    new = build()
    model = new.wrap(module)
    new.take_over(old, optimizer)
    return {"digests": inner_steps(model, optimizer, new, range(4, 7))}


@pytest.mark.ranks
def test_a_heals_replica_steps_one_inner_optimizer_state_on_every_rank():
    """After a heal whose replica holds a rank with another replica's inner optimizer state (a joiner), the
    replica's ranks still hold the same bits at every inner step: the leader's state is every member's
    (``DiLoCoStrategy._share_inner_state``). With Adam, two states would move the two ranks apart at once."""
    from tests.distributed import run_distributed

    results = run_distributed(heal_with_a_joiner, 4, timeout_s=120)
    for step, digests in enumerate(results[0]["digests"], start=4):
        assert digests[0] == digests[1] and digests[2] == digests[3], (step, digests)
        assert digests[0] != digests[2], (step, digests)  # the replicas train apart between outer steps
