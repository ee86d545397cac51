"""Point-to-point on the ``ringtrain_shm`` c10d backend (comm/shm_p2p.py) against Gloo.

A ring exchange at 2 and 3 ranks, every rank sending to the next and receiving from the one before, blocking
(``dist.send``/``dist.recv``) and through ``batch_isend_irecv`` with every rank's send posted first, for fp32,
bf16, int64 and bool at sizes 0, 1, odd and more than one slot (the group's slots are 4 KB here): bit-identical
to the same exchange on Gloo, and each counted on shm. Then the profiler events, a peer SIGKILLed while a rank
waits in a recv (named in one line, the flight recorder's last entry the recv that never ended, nothing left in
/dev/shm), and torch's pipelining (a 2-stage ``ScheduleGPipe``) on ``ringtrain_shm`` against Gloo.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
SIZES = (0, 1, 7, 5003)  # 5003 fp32: 20 KB, five 4 KB slots
PIECE_KB = 4


def _values(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, (numel,), generator=gen).to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def ring_against_gloo(rank: int, world_size: int) -> dict:
    from ringtrain.comm.c10d_backend import BACKEND

    shm = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=60))  # a deadlock fails in one line
    shm.init_shm(piece_kb=PIECE_KB)
    gloo = dist.group.WORLD
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    mismatched, not_on_shm, cases = [], [], 0

    def blocking(group, mine, out):
        if rank == 0:  # the others receive first, so a message larger than the slot cannot block the ring
            dist.send(mine, group_dst=after, group=group, tag=3)
            dist.recv(out, group_src=before, group=group, tag=3)
        else:
            dist.recv(out, group_src=before, group=group, tag=3)
            dist.send(mine, group_dst=after, group=group, tag=3)

    def batched(group, mine, out):
        ops = [dist.P2POp(dist.isend, mine, group_peer=after, group=group),  # every rank's send first
               dist.P2POp(dist.irecv, out, group_peer=before, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for dtype in DTYPES:
        for numel in SIZES:
            mine = _values(dtype, numel, 100 * rank + numel)
            for name, run in (("send/recv", blocking), ("batch_isend_irecv", batched)):
                cases += 1
                sent, received = shm.shm_ops["send"], shm.shm_ops["recv"]
                got, expected = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=dtype)
                run(shm, mine, got)
                if (shm.shm_ops["send"], shm.shm_ops["recv"]) != (sent + 1, received + 1):
                    not_on_shm.append(f"{name} {dtype}×{numel}")
                run(gloo, mine, expected)
                if not torch.equal(_bits(got), _bits(expected)):
                    mismatched.append(f"{name} {dtype}×{numel}")
    # Several messages between one pair in one direction, each larger than the slot, all posted before any wait:
    # they arrive in the order posted.
    outs = [torch.zeros(3000) for _ in range(3)]
    works = [dist.isend(torch.full((3000,), float(10 * rank + k)), group_dst=after, group=shm) for k in range(3)]
    works += [dist.irecv(out, group_src=before, group=shm) for out in outs]
    for work in reversed(works):
        work.wait()
    in_order = all(torch.equal(out, torch.full((3000,), float(10 * before + k))) for k, out in enumerate(outs))
    return {"cases": cases, "mismatched": mismatched, "not_on_shm": not_on_shm, "in_order": in_order}


@pytest.mark.parametrize("world_size", [2, 3])
def test_send_recv_and_batch_isend_irecv_match_gloo_bit_for_bit_on_shm(world_size):
    for result in run_distributed(ring_against_gloo, world_size, timeout_s=300, collective_timeout_s=60):
        assert result["cases"] == 32
        assert result["mismatched"] == [], result["mismatched"]
        assert result["not_on_shm"] == [], result["not_on_shm"]
        assert result["in_order"]


def profiled(rank: int, world_size: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=BACKEND)
    x = torch.ones(8)
    peer = 1 - rank
    # A group of two sets up its workspace on its first send or recv: both ranks take part.
    ops = [dist.P2POp(dist.isend, x, group_peer=peer, group=group), dist.P2POp(dist.irecv, torch.zeros(8), group_peer=peer, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    names = sorted({event.name for event in prof.events() if event.name.startswith("ringtrain_shm:")})
    return {"names": names, "ops": dict(group.shm_ops)}


def test_sends_and_recvs_on_shm_record_profiler_events():
    for result in run_distributed(profiled, 2, timeout_s=120):
        assert result["names"] == ["ringtrain_shm:recv", "ringtrain_shm:send"], result
        assert result["ops"] == {"send": 2, "recv": 2}, result["ops"]  # the set-up's own exchanges on Gloo


def killed_during_recv(rank: int, world_size: int) -> dict:
    from ringtrain.comm import flight
    from ringtrain.comm.c10d_backend import BACKEND
    from ringtrain.comm.errors import CollectiveError

    group = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=5))
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    flight.enable(100)
    x = torch.ones(1 << 18)  # 1 MB: several slots
    if rank == 0:
        dist.recv(x, group_src=1, group=group)
        try:
            dist.recv(x, group_src=1, group=group)  # rank 1 dies instead of sending this
        except CollectiveError as err:
            entries = flight.recorder().snapshot()["collectives"][-2:]
            return {"type": type(err).__name__, "message": str(err), "peer": err.peer, "pids": pids,
                    "last": [{"op": e["op"], "algorithm": e["algorithm"], "ended": e["end_ns"] is not None}
                             for e in entries]}
        return {"type": None}
    dist.send(x, group_dst=0, group=group)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.exclusive
def test_a_peer_killed_while_a_rank_waits_in_a_recv_is_named_in_one_line():
    results = run_distributed(killed_during_recv, 2, lost_ranks={1}, collective_timeout_s=5.0, timeout_s=120)
    result = results[0]
    assert result["type"] == "PeerDiedError" and result["peer"] == 1, result
    message = result["message"]
    assert "\n" not in message and message.startswith("shm recv: rank 1 (pid") and "died" in message, message
    assert result["last"] == [{"op": "recv", "algorithm": "shm", "ended": ended} for ended in (True, False)], result["last"]
    pids = {str(pid) for pid in result["pids"]}
    assert [name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX) and name.split("-")[1] in pids] == []


def pipelined(rank: int, world_size: int, backend: str) -> dict:
    """Three steps of a 2-stage GPipe schedule (4 micro-batches; activations of 8 KB, two 4 KB slots on shm): 12
    activations one way, 12 gradients the other, on shm."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from ringtrain.comm.c10d_backend import BACKEND

    group = dist.new_group(backend=backend)
    if backend == BACKEND:
        group.init_shm(piece_kb=PIECE_KB)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 64), nn.Tanh(), nn.Linear(64, 4))
    part = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, world_size, torch.device("cpu"), group=group)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
        step_losses: list = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=step_losses)
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    return {"losses": losses, "params": [p.detach().clone() for p in part.parameters()],
            "ops": dict(getattr(group, "shm_ops", {}))}


def test_torch_pipelining_on_ringtrain_shm_matches_gloo():
    from ringtrain.comm.c10d_backend import BACKEND

    on_shm = run_distributed(pipelined, 2, BACKEND, timeout_s=180)
    on_gloo = run_distributed(pipelined, 2, "gloo", timeout_s=180)
    assert on_shm[1]["losses"] == on_gloo[1]["losses"] and len(on_shm[1]["losses"][0]) == 4, (on_shm[1], on_gloo[1])
    for shm_result, gloo_result in zip(on_shm, on_gloo):
        assert all(torch.equal(a, b) for a, b in zip(shm_result["params"], gloo_result["params"]))
        assert shm_result["ops"].get("send", 0) >= 12 and shm_result["ops"].get("recv", 0) >= 12, shm_result["ops"]


def mismatched_sizes(rank: int, world_size: int) -> dict:
    from ringtrain.comm.c10d_backend import BACKEND
    from ringtrain.comm.errors import CollectiveError

    group = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=30))
    try:
        if rank == 0:
            dist.send(torch.ones(10), group_dst=1, group=group)  # fits the slot: done when posted, as on Gloo
            dist.barrier(group=group)  # the group's next op fails: the receiver posted the abort line
        else:
            dist.recv(torch.zeros(12), group_src=0, group=group)  # a mistake: the sizes differ
    except CollectiveError as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None}


def test_a_recv_whose_size_differs_from_its_send_fails_in_one_line_and_the_sender_at_its_next_op():
    results = run_distributed(mismatched_sizes, 2, timeout_s=120)
    assert all(r["type"] == "MismatchError" and "\n" not in r["message"] for r in results), results
    assert "rank 0 sent 40 bytes of float32" in results[1]["message"] and "expected 48 bytes" in results[1]["message"], results
    assert "called a different collective (seen by rank 1)" in results[0]["message"], results  # in or before the barrier


def from_any_source(rank: int, world_size: int) -> dict:
    """Rank 0 receives from any source twice while the group's sends still go to Gloo (a group of 3 before its
    first collective), then once more after a collective put them on shm."""
    from ringtrain.comm.c10d_backend import BACKEND

    shm = dist.new_group(backend=BACKEND, timeout=timedelta(seconds=60))
    got: dict = {}
    if rank == 0:
        senders = []
        for _ in range(world_size - 1):
            out = torch.zeros(3)
            senders.append(dist.recv(out, group=shm, tag=5))
            got[senders[-1]] = out.tolist()
        got["senders"] = sorted(senders)
    else:
        dist.send(torch.full((3,), float(rank)), group_dst=0, group=shm, tag=5)
    dist.barrier(group=shm)  # builds the workspace: from now on the group's sends go to shm
    if rank == 0:
        try:
            dist.recv(torch.zeros(3), group=shm, tag=6)
            got["refused"] = None
        except RuntimeError as err:
            got["refused"] = str(err)
    dist.barrier()  # on Gloo: nobody leaves while rank 0 is refused
    return {"got": got, "on_shm": shm.shm_ops.get("barrier", 0)}


def test_a_recv_from_any_source_runs_on_gloo_until_sends_go_to_shm_then_is_refused_in_one_line():
    """torch's ``test_send_recv_any_source`` hung here: a recv from any source went to Gloo while the group's sends
    went to shm. Now it runs where the sends do (Gloo: the source is each sender), and is refused in one line where
    they go to shm (torch cannot ask a Python backend for the source)."""
    results = run_distributed(from_any_source, 3, timeout_s=120)
    got = results[0]["got"]
    assert got["senders"] == [1, 2] and got[1] == [1.0] * 3 and got[2] == [2.0] * 3, got
    assert results[0]["on_shm"] == 1, results[0]
    refused = got["refused"]
    assert refused is not None and "\n" not in refused, refused
    assert refused.startswith("ringtrain_shm: a recv from any source cannot run on shared memory") and \
        "dist.recv(tensor, src=RANK)" in refused, refused
