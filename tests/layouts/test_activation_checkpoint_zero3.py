"""zero3 under activation checkpointing: the recompute in backward runs each block's forward pre-hook again;
zero3's hooks must then leave the block gathered for its backward and start no gather (a prefetch of the
block after it, whose backward is already done, would gather it for nothing: 147 collectives instead of 114
in this test before zero.py knew). 2 real Gloo workers, the parameters bit for bit as without checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.config import CommConfig
from ringtrain.models.transformer import TransformerLM
from ringtrain.parallel import build_strategy
from ringtrain.parallel.activation_checkpoint import apply_ac
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def train_zero3(rank: int, world_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    module = TransformerLM(vocab_size=64, seq_len=16, n_layers=3, n_heads=2, d_model=32)
    apply_ac(module, mode)
    strategy = build_strategy(CommConfig(strategy="zero3", prefetch=True), torch.device("cpu"))
    model = strategy.wrap(module)
    optimizer = strategy.shard_optimizer(torch.optim.AdamW(module.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = torch.cat([p.reshape(-1) for p in strategy.full_named_parameters(model).values()])
    return {"params": params, "collectives": model.comm_calls}


def test_zero3_with_checkpointed_blocks_gathers_as_without_and_keeps_the_bits():
    plain = run_distributed(train_zero3, 2, "none", timeout_s=120)
    for mode in ("full", "selective"):
        checkpointed = run_distributed(train_zero3, 2, mode, timeout_s=120)
        for rank in range(2):
            assert torch.equal(checkpointed[rank]["params"], plain[rank]["params"]), f"{mode}, rank {rank}"
            assert checkpointed[rank]["collectives"] == plain[rank]["collectives"], (mode, rank)
