"""ringtrain's shared-memory all-reduce as a torch.distributed backend (``ringtrain/comm/c10d_backend.py``):
torch's own callers reach it through c10d. A 2-D mesh whose tp dimension is ``ringtrain_shm``: DTensor's
redistribution of a partial sum (the row-parallel layer's all-reduce) and its backward run on shared memory and
give torch's values; so do integers, max, gathers and broadcasts, which run on shm too (tests/comm/
test_shm_c10d_ops.py checks every op against Gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def dtensor_over_shm(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ringtrain.comm.c10d_backend import BACKEND, ShmProcessGroup

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"), backend_override={"tp": BACKEND})
    group = mesh.get_group("tp")
    assert isinstance(group, ShmProcessGroup) and group.group_name
    torch.manual_seed(0)  # the same full tensors on every rank
    x, w = torch.randn(64, 96, dtype=torch.float64), torch.randn(96, 80, dtype=torch.float64)
    x_split = distribute_tensor(x, mesh["tp"], [Shard(1)]).requires_grad_()
    w_split = distribute_tensor(w, mesh["tp"], [Shard(0)]).requires_grad_()
    before = group.shm_calls
    out = (x_split @ w_split).redistribute(mesh["tp"], [Replicate()])  # a partial sum, all-reduced
    forward_calls = group.shm_calls - before
    out.to_local().square().sum().backward()
    expected = x @ w
    # On shm too: integers and max, gathers and broadcasts (and an object broadcast's).
    before = dict(group.shm_ops)
    ints = torch.tensor([rank + 1, 10 * (rank + 1)])
    dist.all_reduce(ints, group=group)
    biggest = torch.tensor([float(rank)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
    gathered = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
    word = [f"rank {rank}"]
    dist.broadcast_object_list(word, src=0, group=group)
    return {
        "forward_calls": forward_calls,
        "forward_error": (out.to_local() - expected).abs().max().item(),
        "x_grad_error": (x_split.grad.full_tensor() - 2 * expected @ w.T).abs().max().item(),
        "w_grad_error": (w_split.grad.full_tensor() - x.T @ (2 * expected)).abs().max().item(),
        "shm_ops": {op: n - before.get(op, 0) for op, n in group.shm_ops.items() if n != before.get(op, 0)},
        "ints": ints.tolist(), "max": biggest.item(), "gathered": [g[0].item() for g in gathered], "word": word[0],
    }


def test_dtensor_collectives_and_the_other_ops_run_on_ringtrain_shm():
    for result in run_distributed(dtensor_over_shm, 2, timeout_s=120):
        assert result["forward_calls"] == 1
        assert result["forward_error"] < 1e-10  # float64: two partial sums added, as torch adds them
        assert result["x_grad_error"] < 1e-10 and result["w_grad_error"] < 1e-10
        ops = result["shm_ops"]  # (how many gathers and broadcasts an object broadcast takes is torch's choice)
        assert set(ops) == {"all_reduce", "all_gather", "broadcast"} and ops["all_reduce"] == 2, ops
        assert result["ints"] == [3, 30] and result["max"] == 1.0 and result["gathered"] == [0.0, 1.0]
        assert result["word"] == "rank 0"
