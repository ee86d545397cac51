"""A DistContext placed on a layout (``DistContext.on_layout``) on real Gloo ranks: the mesh it builds, and this
rank's data-parallel coordinates read from it, against rank arithmetic (the model-parallel ranks, pp x cp x tp,
are consecutive: rank // that is the data-parallel index, and the first of them is the data leader). The ranks of
each data-parallel group sum their ranks over ``dp_group`` to what the arithmetic says."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext
from ringtrain.layout import Layout
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def place(rank: int, world_size: int, layout: Layout):
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    ctx = DistContext(env, "gloo", torch.device("cpu"), host_rank=rank, host_world_size=world_size).on_layout(layout)
    ranks = torch.tensor([float(rank)])
    if ctx.dp_group is not None:
        dist.all_reduce(ranks, group=ctx.dp_group)
    names = None if ctx.mesh is None else ctx.mesh.mesh_dim_names
    return ctx.dp_rank, ctx.dp_size, ctx.data_leader, float(ranks), names


LAYOUTS = {
    "dp4": Layout(dp_replicate=4),
    "hsdp2x2": Layout(dp_replicate=2, dp_shard=2, owner="dp_shard"),
    "fsdp2-tp2": Layout(dp_shard=2, tp=2, owner="dp_shard"),
    "ddp2-tp2": Layout(dp_replicate=2, tp=2),
    "pp2-tp2": Layout(pp=2, tp=2),
    "ddp2-pp2": Layout(dp_replicate=2, pp=2),
    "pp4": Layout(pp=4),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_data_parallel_coordinates_come_from_the_mesh(name):
    layout = LAYOUTS[name]
    results = run_distributed(place, layout.world_size, layout, timeout_s=120)
    split = layout.model_parallel
    for rank, (dp_rank, dp_size, leader, dp_sum, names) in enumerate(results):
        if split == 1:  # every rank reads samples of its own over the whole group
            assert (dp_rank, dp_size, leader) == (rank, layout.world_size, True)
            continue
        assert (dp_rank, dp_size, leader) == (rank // split, layout.dp, rank % split == 0)
        # The ranks of this rank's data-parallel group: the same place in the model, every replica.
        assert dp_sum == sum(rank % split + split * i for i in range(layout.dp))
        assert names == layout.mesh_shape()[0]
