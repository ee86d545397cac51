"""The one-line ends of healing a sharded strategy (train/heal_reload.py), in-process: with no sharded
checkpoint to reload, or too few workers left, the lost shards cannot be saved and the line says what to do.
The reload itself is tests/chaos/test_heal_sharded.py's (real processes, a real kill)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ringtrain.dist.heal import HealFailed
from ringtrain.train.heal_reload import ShardsLost, reload_shards, shards_lost

RECORD = {"type": "heal", "step": 14, "generation": 1, "lost_ranks": [2], "remaining_ranks": [0, 1], "world_size": 2}


def trainer_in(directory) -> SimpleNamespace:
    """What the two functions read of a trainer: its checkpoint folder, strategy name and step."""
    return SimpleNamespace(checkpoints=SimpleNamespace(directory=directory),
                           parts=SimpleNamespace(strategy=SimpleNamespace(name="zero2")),
                           state=SimpleNamespace(step=13), healing=SimpleNamespace(membership=None))


def test_no_sharded_checkpoint_yet_ends_the_job_in_one_line_naming_resume_and_the_interval(tmp_path):
    lost = ShardsLost(RECORD, applied_step=13, last_commit_s=0.0)
    with pytest.raises(HealFailed) as failed:
        reload_shards(trainer_in(tmp_path), lost, rebuild=lambda ctx, membership: None)
    line = str(failed.value)
    assert "\n" not in line
    assert "rank 2 lost" in line and "comm.strategy = 'zero2'" in line and "no sharded checkpoint was saved yet" in line
    assert "--resume" in line and "checkpoint.every_steps" in line


def test_below_min_nproc_the_step_cannot_be_saved_and_the_line_says_so(tmp_path):
    with pytest.raises(HealFailed) as failed:
        shards_lost(trainer_in(tmp_path), RECORD, min_workers=3, last_commit_s=0.0)
    line = str(failed.value)
    assert "only 2 workers remain, below --min-nproc 3" in line and "cannot be saved" in line
    assert "no sharded checkpoint was saved yet" in line
    with pytest.raises(ShardsLost) as going_on:  # enough workers: the trainer is rebuilt and reloaded
        shards_lost(trainer_in(tmp_path), RECORD, min_workers=2, last_commit_s=5.0)
    assert going_on.value.applied_step == 13 and going_on.value.last_commit_s == 5.0
