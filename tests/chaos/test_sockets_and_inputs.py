"""Chaos 10 and 11 and the explicit-checkpoint half of 4, as a user meets them on the command line.

10. A forged checkpoint whose unpickling would create a file: refused by the workers, the file never
    appears, the job exits non-zero naming the checkpoint.
11. Every listening socket of a default run (and of an elastic one) is bound to loopback.
4.  Asking explicitly for a broken checkpoint (--resume-from) fails before any worker starts, in one line.
"""

from __future__ import annotations

import hashlib
import ipaddress
import time

import psutil
import pytest
import torch

from ringtrain.checkpoint.manifest import Digest, write_manifest
from tests.chaos.jobs import Job
from tests.conftest import run_cli


@pytest.mark.parametrize("extra", [[], ["--min-nproc", "1"]], ids=["default", "elastic"])
def test_every_listening_socket_of_a_run_is_on_loopback(tmp_path, extra):
    run_dir = tmp_path / "run"
    listening: dict[tuple, str] = {}
    with Job("train", "configs/debug_mlp.toml", "--nproc", "2", *extra, "--run-dir", str(run_dir),
             "--set", "train.epochs=4") as job:
        while job.process.poll() is None:
            for proc in job.tree():
                try:
                    name = "worker" if "ringtrain.worker" in " ".join(proc.cmdline()) else "launcher/agent"
                    sockets = proc.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                for sock in sockets:
                    if sock.status == psutil.CONN_LISTEN:
                        listening[(proc.pid, sock.laddr.ip, sock.laddr.port)] = name
            time.sleep(0.02)
        code = job.finish()
    assert code == 0, job.stderr
    exposed = [key for key in listening if not ipaddress.ip_address(key[1]).is_loopback]
    kinds = sorted({name for name in listening.values()})
    print(f"listening sockets ({'elastic' if extra else 'default'} run): {len(listening)} seen "
          f"({', '.join(kinds)}), {len(exposed)} off loopback")
    assert not exposed, f"sockets listening beyond loopback: {exposed}"
    assert "worker" in kinds and "launcher/agent" in kinds, f"sampling missed the job's listeners: {listening}"


class _CreatesAFile:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_malicious_checkpoint_is_refused_and_its_payload_never_runs(tmp_path):
    target = tmp_path / "pwned"
    evil = tmp_path / "evil" / "step_00000010.pt"
    evil.parent.mkdir()
    torch.save({"model": _CreatesAFile(target), "train_state": {"step": 10}}, evil)
    payload = evil.read_bytes()
    write_manifest(evil, Digest(hashlib.sha256(payload).hexdigest(), len(payload)), step=10)  # a valid manifest
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                     "--resume-from", str(evil))
    last = result.stderr.strip().splitlines()[-1]
    print(f"malicious checkpoint: exit {result.returncode}, file created: {target.exists()}: {last[:160]}")
    assert result.returncode != 0
    assert not target.exists(), "the pickle payload ran"
    assert str(evil) in last and "refusing to unpickle" in last and "io.open" in last, result.stderr


def test_an_explicitly_requested_broken_checkpoint_fails_in_one_line_before_any_worker(tmp_path):
    source = tmp_path / "source"
    assert run_cli("train", "configs/debug_mlp.toml", "--nproc", "1", "--run-dir", str(source),
                   "--set", "train.max_steps=10").returncode == 0
    broken = source / "checkpoints" / "step_00000010.pt"
    data = bytearray(broken.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir),
                     "--resume-from", str(broken))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == f"ringtrain: error: checkpoint {broken} does not match the sha256 in its manifest (altered on disk)"
    assert not run_dir.exists(), "a worker started"
