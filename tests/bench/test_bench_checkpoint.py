"""`ringtrain bench checkpoint`, short form: it saves synchronously and in the background on 2 real workers,
reports both, and leaves no checkpoint behind (the timing targets live in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.job


def test_bench_checkpoint_reports_blocked_time_of_both_kinds_of_save(tmp_path):
    out = tmp_path / "bench"
    done = run_cli("bench", "checkpoint", "configs/debug_lm.toml", "--nproc", "2", "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "checkpoint_bench.json").read_text())
    print(done.stdout.strip())
    assert result["world_size"] == 2 and result["bytes_rank0"] > 0
    assert result["sync_save_s"] > 0 and result["async_blocked_s"] > 0 and result["async_background_s"] > 0
    assert result["blocked_ratio"] == result["async_blocked_s"] / result["sync_save_s"]
    assert not (out / "checkpoints").exists(), "the bench left its checkpoints behind"


def test_bench_checkpoint_refuses_a_bad_config_in_one_line(tmp_path):
    done = run_cli("bench", "checkpoint", str(tmp_path / "missing.toml"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("ringtrain: error:"), done.stderr
