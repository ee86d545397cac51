"""Training through the command line with ringtrain's collectives: the same weights as plain DDP."""

from __future__ import annotations

import os

import pytest
import torch

from ringtrain.comm.shm_segment import PREFIX, SHM_DIR
from tests.conftest import run_cli
from tests.distributed import run_distributed
from tests.trainers import train_run

pytestmark = pytest.mark.job

STEPS = 20
COMMON = ["configs/debug_mlp.toml", "--nproc", "2", "--set", f"train.max_steps={STEPS}"]


def final_model(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """The reference: the same job with plain DDP, the trainer `ringtrain train` builds, run in the harness."""
    run_dir = tmp_path_factory.mktemp("plain")
    run_distributed(train_run, 2, COMMON[0], [f"train.max_steps={STEPS}"], str(run_dir), False)
    return final_model(run_dir)


@pytest.mark.exclusive  # it checks that /dev/shm holds nothing new: a test beside it may hold a workspace then
@pytest.mark.parametrize(
    "overrides",
    [["comm.algorithm=shm"], ["comm.strategy=manual", "comm.algorithm=shm", "comm.bucket_mb=0.01"]],
    ids=["ddp-shm-hook", "manual-shm"],
)
def test_training_with_ringtrain_collectives_gives_the_weights_of_plain_ddp(tmp_path, plain_ddp, overrides):
    # Two workers, two micro-batches per step (one inside no_sync): (a / 2) + (b / 2) is the same float
    # whoever adds it, so ringtrain's all-reduce must give plain DDP's weights to the bit.
    before = {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}
    sets = [arg for override in overrides for arg in ("--set", override)]
    ours = run_cli("train", *COMMON, *sets, "--run-dir", str(tmp_path / "ours"))
    assert ours.returncode == 0, ours.stderr
    got = final_model(tmp_path / "ours")
    for name, tensor in plain_ddp.items():
        assert torch.equal(got[name], tensor), f"{name} differs with {overrides}"
    assert {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)} <= before, "shared memory left behind"
