"""The one-line ends of healing a sharded strategy (heal/reload.py, heal/supervisor.py), in-process: with no
sharded checkpoint to reload, or too few workers left, the lost shards cannot be saved and the line says what
to do. The reload itself is tests/heal/test_heal_sharded.py's (real processes, a real kill)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ringtrain.heal.membership import Generation, HealFailed
from ringtrain.heal.reload import reload_shards
from ringtrain.heal.supervisor import Supervisor

pytestmark = pytest.mark.unit

RECORD = {"type": "heal", "step": 14, "generation": 1, "lost_ranks": [2], "remaining_ranks": [0, 1], "world_size": 2}


def trainer_in(directory) -> SimpleNamespace:
    """What the two functions read of a trainer: its checkpoint folder, strategy name and step."""
    return SimpleNamespace(checkpoints=SimpleNamespace(directory=directory),
                           parts=SimpleNamespace(strategy=SimpleNamespace(name="zero2")),
                           state=SimpleNamespace(step=13), finished=False)


def test_no_sharded_checkpoint_yet_ends_the_job_in_one_line_naming_resume_and_the_interval(tmp_path):
    with pytest.raises(HealFailed) as failed:
        reload_shards(trainer_in(tmp_path), Generation(1, (0, 1), 0), rebuild=lambda ctx: None, applied_step=13,
                      record=RECORD)
    line = str(failed.value)
    assert "\n" not in line
    assert "rank 2 lost" in line and "comm.strategy = 'zero2'" in line and "no sharded checkpoint was saved yet" in line
    assert "--resume" in line and "checkpoint.every_steps" in line


def test_below_min_nproc_the_step_cannot_be_saved_and_the_line_says_so(tmp_path):
    supervisor = Supervisor(membership=None, min_workers=3, max_workers=None, rebuild=None, reloads=True)
    supervisor.trainer = trainer_in(tmp_path)
    with pytest.raises(HealFailed) as failed:
        supervisor._below_minimum(Generation(1, (0, 1), 0), RECORD, finished=False)
    line = str(failed.value)
    assert "only 2 workers remain, below --min-nproc 3" in line and "cannot be saved" in line
    assert "no sharded checkpoint was saved yet" in line
    supervisor.min_workers = 2  # enough workers: the trainer goes on (rebuilt and reloaded by then)
    supervisor._below_minimum(Generation(1, (0, 1), 0), RECORD, finished=False)
    supervisor.min_workers = 3  # too few, but training is done (a member finished): the last summary goes on
    supervisor._below_minimum(Generation(1, (0, 1), 0), RECORD, finished=True)
