"""Sharded checkpoints of the zero strategies (parallel/zero_state.py through checkpoint/sharded.py): each rank
writes only its own stretches, and the state loads back exactly, resharded to another world size and into
another strategy (zero1/2/3, ddp, fsdp), through DCP; a truncated zero shard is refused by the manifest.

Layer sizes 13 -> 37 -> 29 -> 5 and 0.002 MB buckets: shards cut parameters inside rows, uneven at 2 and 3.
Loading copies, so "exactly" is bit for bit: every parameter and every optimizer state tensor (AdamW's
moments and step) in the full form equals the one saved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain.checkpoint.sharded import ShardedCheckpointer, verify
from ringtrain.config import CommConfig
from ringtrain.errors import CorruptCheckpoint
from ringtrain.parallel import build_strategy
from tests.layouts.test_zero import _batches, _model, _optimizer
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def _build(name: str):
    extra = {} if name in ("ddp", "fsdp") else {"bucket_mb": 0.002}
    strategy = build_strategy(CommConfig(strategy=name, **extra), torch.device("cpu"))
    model = strategy.wrap(_model())
    optimizer = strategy.shard_optimizer(_optimizer("adamw", strategy.unwrap(model).parameters()))
    return strategy, model, optimizer


def _full(strategy, model, optimizer) -> dict[str, np.ndarray]:
    """The full form (gathered: a collective), flattened to numpy by name."""
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in strategy.model_state_dict(model).items()}
    for index, entry in strategy.optimizer_state_dict(optimizer)["state"].items():
        out.update({f"optim.{index}.{k}": v.detach().numpy().copy() for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def phase(rank: int, world_size: int, directory: str, saves: dict[str, str], loads: list[tuple[str, str]]) -> dict:
    """``saves``: checkpoint name -> strategy that trains 3 steps and saves it (``:async`` in the background);
    ``loads``: (checkpoint name, strategy that loads it). Returns the full forms by checkpoint name."""
    out = {}
    for ckpt_name, how in saves.items():
        name, _, mode = how.partition(":")
        strategy, model, optimizer = _build(name)
        for micro_batches in _batches(rank, world_size, 1)[:3]:
            for x, y in micro_batches:
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ckpt = ShardedCheckpointer(Path(directory) / ckpt_name, rank, world_size)
        pending = ckpt.save(3, strategy.checkpoint_state(model, optimizer), async_save=mode == "async")
        pending.result()
        out[f"saved {ckpt_name}"] = _full(strategy, model, optimizer)
        out[f"bytes {ckpt_name}"] = pending.report.bytes
    for ckpt_name, name in loads:
        strategy, model, optimizer = _build(name)
        ckpt = ShardedCheckpointer(Path(directory) / ckpt_name, rank, world_size)
        strategy.load_checkpoint_state(model, optimizer, lambda state: ckpt.load(ckpt.latest(), state))
        out[f"loaded {ckpt_name} into {name}"] = _full(strategy, model, optimizer)
    return out


def _same(saved: dict[str, np.ndarray], loaded: dict[str, np.ndarray], what: str) -> None:
    assert set(saved) == set(loaded), f"{what}: keys differ: {set(saved) ^ set(loaded)}"
    differ = [k for k in saved if not np.array_equal(saved[k], loaded[k])]
    assert not differ, f"{what}: differ from the saved state: {differ}"


def test_zero_checkpoints_reshard_across_world_sizes_and_strategies(tmp_path):
    d = str(tmp_path)
    # zero3 at 3 ranks, saved in the background; zero2 at 2, synchronously; ddp at 1.
    at3 = run_distributed(phase, 3, d, {"z3": "zero3:async"}, [], timeout_s=120)
    at2 = run_distributed(phase, 2, d, {"z2": "zero2"}, [("z3", "zero1"), ("z3", "fsdp")], timeout_s=120)
    saved3, saved2 = at3[0]["saved z3"], at2[0]["saved z2"]
    assert any(k.endswith(".exp_avg") for k in saved3) and any(k.endswith(".step") for k in saved3)
    # Each rank wrote its own stretch: every rank's files hold bytes, and together about the state's size.
    assert all(r["bytes z3"] > 0 for r in at3) and all(r["bytes z2"] > 0 for r in at2)
    for rank in range(2):
        _same(saved3, at2[rank]["loaded z3 into zero1"], f"zero3@3 -> zero1@2, rank {rank}")
        _same(saved3, at2[rank]["loaded z3 into fsdp"], f"zero3@3 -> fsdp@2, rank {rank}")
    at1 = run_distributed(phase, 1, d, {"ddp1": "ddp"}, [("z3", "ddp"), ("z2", "zero3")], timeout_s=120)
    _same(saved3, at1[0]["loaded z3 into ddp"], "zero3@3 -> ddp@1")
    _same(saved2, at1[0]["loaded z2 into zero3"], "zero2@2 -> zero3@1")
    again3 = run_distributed(phase, 3, d, {}, [("z2", "zero3"), ("ddp1", "zero2")], timeout_s=120)
    for rank in range(3):
        _same(saved2, again3[rank]["loaded z2 into zero3"], f"zero2@2 -> zero3@3, rank {rank}")
        _same(at1[0]["saved ddp1"], again3[rank]["loaded ddp1 into zero2"], f"ddp@1 -> zero2@3, rank {rank}")
    print("zero3@3 -> zero1@2, fsdp@2, ddp@1; zero2@2 -> zero3@1, zero3@3; ddp@1 -> zero2@3: every tensor bit-identical")


def test_a_truncated_zero_shard_is_refused(tmp_path):
    run_distributed(phase, 2, str(tmp_path), {"z": "zero3"}, [], timeout_s=120)
    [path] = ShardedCheckpointer(tmp_path / "z", 0, 1).checkpoints()
    verify(path)
    shard = path / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp is .* bytes but the manifest says"):
        verify(path)
