"""What ringtrain's shm leaves behind: no process group kept past its destruction, no bucket kept mapped
after its model is wrapped again or unwrapped (issue 9, items 4 and 6)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.parallel import ManualStrategy
from ringtrain.parallel.manual import BucketedDataParallel
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def destroy_used_groups(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    comm.all_reduce(torch.ones(100), algorithm="shm", group=group)  # direct
    comm.all_reduce(torch.ones(200_000), algorithm="shm", group=group)  # staged
    comm.all_reduce(shm.shared_empty(100_000, group=group).fill_(1), algorithm="shm", group=group)  # in place
    # A wrapped model the user keeps (a module-level variable, say): it must not keep its group either.
    model = BucketedDataParallel(nn.Linear(4, 4), algorithm="shm", group=group)
    kept = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return {"group_alive": kept() is not None, "model": type(model).__name__}


def test_a_destroyed_group_is_freed_although_shm_and_a_wrapped_model_used_it():
    # Before, the shm workspace (until 9e997ea) and the manual strategy's model held the group, so
    # destroy_process_group() left its Gloo threads running into interpreter shutdown, where they abort
    # (tests/comm/test_shm_exit.py; a module-level wrapped model under torchrun: 5 of 12 jobs).
    for result in run_distributed(destroy_used_groups, 2):
        assert not result["group_alive"], "something still holds the destroyed process group"


def _mapped_arena_bytes() -> int:
    """Bytes of this process's address space mapped from ringtrain's shared segments, workspace excluded."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/ringtrain-" in line and "-arena" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))  # 0.5 MB of float32 gradients


def rewrap(rank: int, world_size: int) -> dict:
    strategy = ManualStrategy(torch.device("cpu"), bucket_mb=0.25, algorithm="shm")
    module = _model()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    mapped, grads_ok = [], []
    for _ in range(4):  # wrap the same module again, as a second fit() on one model does
        model = strategy.wrap(module)
        module.zero_grad(set_to_none=True)
        with strategy.no_sync(model):
            model(x).square().sum().backward()
        expected = [p.grad.clone() for p in module.parameters()]
        for g in expected:
            dist.all_reduce(g)
            g.div_(world_size)
        module.zero_grad(set_to_none=True)
        model(x).square().sum().backward()  # synchronised: once, by this wrapping alone
        grads_ok.append(all(torch.allclose(p.grad, e, rtol=1e-5, atol=1e-6) for p, e in zip(module.parameters(), expected)))
        gc.collect()
        mapped.append(_mapped_arena_bytes())
    grads = [p.grad.clone() for p in module.parameters()]
    strategy.unwrap(model, release=True)
    del model
    gc.collect()
    kept = all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads))
    return {"mapped": mapped, "after_unwrap": _mapped_arena_bytes(), "grads_ok": grads_ok, "grads_kept": kept}


def test_rewrapping_and_unwrapping_release_the_shared_buckets():
    for result in run_distributed(rewrap, 2):
        mapped = result["mapped"]
        assert mapped[0] > 0 and mapped == [mapped[0]] * 4, f"arena bytes mapped after each wrap: {mapped}"
        assert all(result["grads_ok"]), f"gradients after each wrap equal the average: {result['grads_ok']}"
        assert result["after_unwrap"] == 0, "unwrap(release=True) left shared buckets mapped"
        assert result["grads_kept"], "releasing changed the gradients"
