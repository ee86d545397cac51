"""Sharded checkpoints (checkpoint/sharded.py) on real ranks: FSDP2-sharded model and AdamW state saved by
each rank, committed by the sha256 manifest, loaded back resharded (2 -> 1, 2 -> 3, 1 -> 2) bit for bit,
saved in the background, and refused when truncated, uncommitted or carrying a malicious metadata pickle."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.checkpoint.sharded import ShardedCheckpointer, manifest_of, verify
from ringtrain.errors import CorruptCheckpoint, UnsafeCheckpoint
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 7x5 and 5 and 3x5: sizes that do not divide by 2 or 3 (uneven shards).
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _parts(world_size: int):
    """The model and AdamW after one step, sharded with FSDP2 when there are several ranks."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, get_state_dict


def _train_one_step(model, optimizer) -> None:
    torch.manual_seed(1 + dist.get_rank() if dist.is_initialized() else 1)
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model, optimizer) -> dict[str, np.ndarray]:
    """Every parameter and optimizer moment, gathered to full tensors (every rank gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{name}.{key}"] = state[key].detach().numpy().copy()
    return out


def save_after_a_step(rank: int, world_size: int, folder: str, async_save: bool) -> dict:
    model, optimizer, get_state_dict = _parts(world_size)
    _train_one_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    ckpt = ShardedCheckpointer(folder, rank, world_size)
    pending = ckpt.save(3, {"model": model_sd, "optim": optim_sd}, async_save=async_save)
    committed_at_return = manifest_of(ckpt.path_for(3)).exists()
    report = pending.result(timeout=120)
    return {"full": _full(model, optimizer), "report": vars(report), "committed_at_return": committed_at_return}


def load_fresh(rank: int, world_size: int, folder: str) -> dict:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optimizer, get_state_dict = _parts(world_size)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout to load into (this world size's shards)
    ckpt = ShardedCheckpointer(folder, rank, world_size)
    state = {"model": model_sd, "optim": optim_sd}
    manifest = ckpt.load(ckpt.latest(), state)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"full": _full(model, optimizer), "saved_by": manifest["world_size"]}


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in a if not np.array_equal(a[k], b[k])] + sorted(set(a) ^ set(b))


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded") / "checkpoints"
    results = run_distributed(save_after_a_step, 2, str(folder), False)
    return folder, results


@pytest.mark.parametrize("world_size", [1, 3])
def test_saved_by_two_ranks_loads_at_another_size_bit_for_bit(saved_by_two, world_size):
    folder, saved = saved_by_two
    assert not _same(saved[0]["full"], saved[1]["full"])
    files = json.loads(manifest_of(folder / "step_00000003.dcp").read_text())["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
    loaded = run_distributed(load_fresh, world_size, str(folder))
    for result in loaded:
        assert result["saved_by"] == 2
        assert not _same(result["full"], saved[0]["full"]), _same(result["full"], saved[0]["full"])
    print(f"2 -> {world_size} ranks: {len(saved[0]['full'])} tensors (parameters, AdamW moments) bit-identical")


def test_saved_by_one_rank_loads_into_two_shards(tmp_path):
    folder = tmp_path / "checkpoints"
    [saved] = run_distributed(save_after_a_step, 1, str(folder), False)
    loaded = run_distributed(load_fresh, 2, str(folder))
    assert all(not _same(r["full"], saved["full"]) for r in loaded)


def test_a_background_save_returns_before_its_commit_and_reports_it(tmp_path):
    folder = tmp_path / "checkpoints"
    results = run_distributed(save_after_a_step, 2, str(folder), True)
    for r in results:
        report = r["report"]
        assert report["blocked_s"] > 0 and report["background_s"] > 0 and report["bytes"] > 0, report
    print("background save:", [(round(r["report"]["blocked_s"], 4), round(r["report"]["background_s"], 4)) for r in results])
    verify(folder / "step_00000003.dcp")
    loaded = run_distributed(load_fresh, 1, str(folder))
    assert not _same(loaded[0]["full"], results[0]["full"])


def _copy(saved_by_two, tmp_path) -> Path:
    import shutil

    folder, _ = saved_by_two
    target = tmp_path / "checkpoints"
    shutil.copytree(folder, target)
    return target / "step_00000003.dcp"


def test_a_truncated_shard_or_a_missing_manifest_is_refused(saved_by_two, tmp_path):
    path = _copy(saved_by_two, tmp_path)
    shard = path / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpoint, match=r"__1_0.distcp is \d+ bytes but the manifest says \d+ \(truncated\?\)"):
        verify(path)
    manifest_of(path).unlink()
    with pytest.raises(CorruptCheckpoint, match="has no manifest"):
        verify(path)
    assert ShardedCheckpointer(path.parent, 0, 1).latest() is None


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['RINGTRAIN_TEST_MARKER']}",))


def test_a_malicious_metadata_pickle_is_refused_even_with_a_matching_manifest(saved_by_two, tmp_path, monkeypatch):
    path = _copy(saved_by_two, tmp_path)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RINGTRAIN_TEST_MARKER", str(marker))
    evil = pickle.dumps(_Payload())
    (path / ".metadata").write_bytes(evil)
    # The attacker rewrites the manifest too: integrity passes, the unpickler must still refuse.
    manifest = json.loads(manifest_of(path).read_text())
    manifest["files"][".metadata"] = {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    manifest_of(path).write_text(json.dumps(manifest))
    with pytest.raises(Exception) as err:
        run_distributed(load_fresh, 1, str(path.parent))
    last = str(err.value).strip().splitlines()[-1]
    assert last.startswith(f"{UnsafeCheckpoint.__module__}.UnsafeCheckpoint: checkpoint metadata step_00000003.dcp/.metadata refers to posix.system"), last
    assert not marker.exists(), "the pickle ran"
