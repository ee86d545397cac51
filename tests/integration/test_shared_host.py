"""The issue's critical row, as the attacker did it: while a job runs, another local user (uid 12345, no
secret) speaks to the job's rendezvous port and sets torch's rendezvous state to a pickle that would run a
command as the job's user. Before the job had a secret, torch's keep-alive unpickled it within a second (the
command ran, the launcher died). Now the state is sealed: the planted value is refused in one line naming the
store and the key, the agent writes its last good state back, and the job finishes.

The run id is no longer predictable from the port; the test reads it from a worker's environment (as root), as
an attacker who somehow knew it would have it: the seal is what protects the state, not the name."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

STRANGER = 12345
ATTACK = r"""
import base64, os, pickle, sys
from datetime import timedelta
import torch.distributed as dist

class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[3],))

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
store.set("torch.rendezvous." + sys.argv[2], base64.b64encode(pickle.dumps(Payload())))
print("planted", flush=True)
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to act as another local user")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_id_of_a_worker(launcher: psutil.Process, deadline: float) -> str:
    while time.monotonic() < deadline:
        for child in launcher.children(recursive=True):
            try:
                run_id = child.environ().get("TORCHELASTIC_RUN_ID")
            except psutil.Error:
                continue
            if run_id and "RANK" in child.environ():
                return run_id
        time.sleep(0.1)
    raise AssertionError("no worker started")


def test_another_local_user_cannot_run_code_through_the_rendezvous_state(tmp_path):
    marker = tmp_path / "payload-ran"
    port = _free_port()
    job = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir",
         str(tmp_path / "run"), "--rdzv-endpoint", f"127.0.0.1:{port}", "--set", "train.epochs=3"],
        cwd=REPO, env={**{k: v for k, v in os.environ.items() if k != "RINGTRAIN_JOB_SECRET"},  # its own secret
                       "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
    try:
        run_id = _run_id_of_a_worker(psutil.Process(job.pid), time.monotonic() + 120)
        assert str(port) not in run_id  # the id the attacker derived from the port
        attack = subprocess.run(
            ["setpriv", "--reuid", str(STRANGER), "--regid", str(STRANGER), "--clear-groups",
             sys.executable, "-c", ATTACK, str(port), run_id, str(marker)],
            cwd="/", capture_output=True, text=True, timeout=60)
        assert attack.stdout.strip() == "planted", attack.stderr
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert not marker.exists(), "the planted pickle ran"
    assert job.returncode == 0, err
    refusals = [line for line in err.splitlines() if "not sealed with this job's secret" in line]
    assert len(refusals) == 1, err
    assert f"the rendezvous store at 127.0.0.1:{port}" in refusals[0]
    assert f"'torch.rendezvous.{run_id}'" in refusals[0]
    assert "run directory:" in out
