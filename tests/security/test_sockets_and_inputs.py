"""Chaos 10 and the explicit-checkpoint half of 4, as a user meets them on the command line.

10. A forged checkpoint whose unpickling would create a file: refused by the workers, the file never
    appears, the job exits non-zero naming the checkpoint.
4.  Asking explicitly for a broken checkpoint (--resume-from) fails before any worker starts, in one line.

Chaos 11 (loopback-only sockets) rides along the default job (tests/launch/test_cli_train.py) and the elastic chaos run (tests/launch/test_elastic.py).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import Digest, write_manifest
from tests.conftest import run_cli, run_main


class _CreatesAFile:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.job
def test_a_malicious_checkpoint_is_refused_and_its_payload_never_runs(tmp_path):
    target = tmp_path / "pwned"
    evil = tmp_path / "evil" / "step_00000010.pt"
    evil.parent.mkdir()
    torch.save({"model": _CreatesAFile(target), "train_state": {"step": 10}}, evil)
    payload = evil.read_bytes()
    write_manifest(evil, Digest(hashlib.sha256(payload).hexdigest(), len(payload)), step=10)  # a valid manifest
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                     "--resume-from", str(evil))
    last = result.stderr.strip().splitlines()[-1]
    print(f"malicious checkpoint: exit {result.returncode}, file created: {target.exists()}: {last[:160]}")
    assert result.returncode != 0
    assert not target.exists(), "the pickle payload ran"
    assert str(evil) in last and "refusing to unpickle" in last and "io.open" in last, result.stderr


@pytest.mark.unit
def test_an_explicitly_requested_broken_checkpoint_fails_in_one_line_before_any_worker(tmp_path):
    broken = CheckpointManager(tmp_path / "source").save(10, {"model": {"w": torch.ones(1000)}})
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    result = run_main("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir),
                      "--resume-from", str(broken))  # refused before any worker: ringtrain.cli.main in this process
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == f"ringtrain: error: checkpoint {broken} does not match the sha256 in its manifest (altered on disk)"
    assert not run_dir.exists(), "a worker started"


@pytest.mark.unit
def test_join_without_a_running_job_fails_in_one_line(tmp_path, capsys):
    from ringtrain.cli import main
    from ringtrain.elastic import JOB_FILE, JobSpec
    from ringtrain.group.auth import load_job_secret
    from ringtrain.launch import Program

    assert main(["join", str(tmp_path)]) == 2
    assert f"{tmp_path / JOB_FILE} not found" in capsys.readouterr().err
    # The job's own (sealed) description, as its launcher left it: its store is gone.
    spec = JobSpec("127.0.0.1:1", "gone", 1, 2, 0, "", Program(()), "")
    (tmp_path / JOB_FILE).write_text(spec.to_json(load_job_secret(os.environ)))
    assert main(["join", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no job is running at 127.0.0.1:1" in lines[0], lines
