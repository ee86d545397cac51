"""The issue's exploit, end to end: `ringtrain train --resume` over a sharded checkpoint whose .metadata turns
a tensor into a pickled-object entry (manifest rewritten to match) stops before any worker starts: exit 2,
one line naming the entry, and the pickle never runs. Before the fix the job resumed, exited 0, and the
payload had run."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.security.test_hostile_files import _bytes_entry

pytestmark = pytest.mark.job

FLAGS = ["--nproc", "2", "--set", "checkpoint.sharded=true", "--set", "comm.strategy='zero1'",
         "--set", "checkpoint.every_steps=4"]


def test_resume_refuses_a_planted_bytes_entry_in_one_line_and_runs_nothing(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli("train", "configs/debug_mlp.toml", "--run-dir", str(run_dir), *FLAGS, "--set", "train.max_steps=4")
    assert first.returncode == 0, first.stderr
    checkpoint = run_dir / "checkpoints" / "step_00000004.dcp"
    marker = tmp_path / "payload-ran"
    _bytes_entry(checkpoint, marker, fqn="model.layers.0.weight")
    resumed = run_cli("train", "configs/debug_mlp.toml", "--run-dir", str(run_dir), *FLAGS,
                      "--set", "train.max_steps=8", "--resume")
    assert not marker.exists(), "the planted pickle ran"
    lines = [line for line in resumed.stderr.splitlines() if line.strip()]
    assert resumed.returncode == 2, resumed.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "ringtrain: error: checkpoint metadata step_00000004.dcp/.metadata: entry 'model.layers.0.weight' is a "
        "BytesStorageMetadata (a pickled object), not tensor storage"), resumed.stderr
