"""A user's tensor-parallel plan whose "colwise" layer has no "rowwise" partner (ringtrain/parallel/tp_plan_check.py):
one line naming the plan entry, where torch would fail in forward with ``mat1 and mat2 shapes cannot be
multiplied``. The pairs plans are written with pass: Megatron's MLP, attention with grouped k/v heads (whose k and
v width is not o's), nested paths; the check is wired into the tensor-parallel strategy (two ranks, harness)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.parallel.tp_plan_check import check_colwise_partners
from tests.distributed import run_distributed


class Attention(nn.Module):
    def __init__(self, width: int = 32, kv: int = 16):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(width, width), nn.Linear(width, kv), nn.Linear(width, kv), \
            nn.Linear(width, width)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def model() -> nn.Module:
    return nn.ModuleDict({"layers": nn.ModuleList([Block(), Block()]), "head": nn.Linear(32, 10)})


@pytest.mark.unit
@pytest.mark.parametrize("plan", [
    {"layers.*.mlp.0": "colwise", "layers.*.mlp.2": "rowwise"},
    {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
     "layers.*.attn.o": "rowwise"},
    {"layers.*.attn.o": "rowwise"},  # rowwise alone: its input is split by the caller's own code
])
def test_plans_written_in_pairs_pass(plan):
    check_colwise_partners(model(), plan)


@pytest.mark.unit
def test_a_colwise_layer_without_a_rowwise_partner_is_one_line_naming_the_entry():
    plan = {"layers.*.mlp.0": "colwise", "layers.*.attn.o": "rowwise"}
    with pytest.raises(ConfigError) as err:
        check_colwise_partners(model(), plan)
    line = str(err.value)
    assert line.startswith("tp_plan['layers.*.mlp.0'] = 'colwise' splits layers.0.mlp.0's 64 output features")
    assert "(e.g. 'layers.0.mlp.2': 'rowwise')" in line and "\n" not in line


def _wrap(rank: int, world_size: int, plan: dict) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from ringtrain.parallel.tensor import TensorParallelStrategy

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))
    try:
        wrapped = TensorParallelStrategy(torch.device("cpu"), mesh, plan=plan).wrap(net)
        return f"ran: {tuple(wrapped(torch.randn(8, 16)).shape)}"
    except ConfigError as err:
        return f"refused: {err}"


@pytest.mark.ranks
def test_the_tensor_parallel_strategy_refuses_the_plan_before_any_forward():
    refused = run_distributed(_wrap, 2, {"0": "colwise"})
    assert all(r.startswith("refused: tp_plan['0'] = 'colwise' splits 0's 128 output features") for r in refused), refused
    paired = run_distributed(_wrap, 2, {"0": "colwise", "2": "rowwise"})
    assert paired == ["ran: (8, 64)"] * 2, paired
