"""The issue's critical row, as the attacker did it: while a job runs, another local user (uid 12345, no
secret) speaks to the job's rendezvous port and sets torch's rendezvous state to a pickle that would run a
command as the job's user. Before the job had a secret, torch's keep-alive unpickled it within a second (the
command ran, the launcher died). Now the state is sealed: the planted value is refused in one line naming the
store and the key, the agent writes its last good state back, and the job finishes.

The run id is no longer predictable from the port; the test reads it from a worker's environment (as root), as
an attacker who somehow knew it would have it: the seal is what protects the state, not the name.

The workers hold themselves (a ``stop`` fault at step 2) until the attack has landed and the agent has read the
state back: the job cannot end before the attacker's process (seconds importing torch on a busy machine) gets
its write in. Before, the test raced the job's length and lost under load (a connection refused at the end)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.jobs import Job
from tests.faults import Fault, fault_plan

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

pytestmark = [pytest.mark.job,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                 reason="needs root and setpriv to act as another local user")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_another_local_user_cannot_run_code_through_the_rendezvous_state(tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"
    port = _free_port()
    plan = fault_plan(tmp_path, *(Fault("step.micro_batch", member=m, step=2, action="stop") for m in (0, 1)))
    monkeypatch.delenv("RINGTRAIN_JOB_SECRET")  # a job of one node makes its own (tests/conftest.py sets one)
    with Job("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
             "--rdzv-endpoint", f"127.0.0.1:{port}",
             # Workers in interpreters of their own: the test reads the run id from a worker's environment,
             # which a worker forked from the forkserver does not show (/proc/PID/environ is the forkserver's).
             env={**plan.env, "RINGTRAIN_WORKER_START": "spawn"}) as job:
        job.wait_for(lambda: len(job.held_workers()) == 2, what="both workers to hold at step 2")
        run_id = next(iter(job.held_workers().values())).environ()["TORCHELASTIC_RUN_ID"]
        assert str(port) not in run_id  # the id the attacker derived from the port
        attack = subprocess.run(
            ["setpriv", "--reuid", str(STRANGER), "--regid", str(STRANGER), "--clear-groups",
             sys.executable, "-c", ATTACK, str(port), run_id, str(marker)],
            cwd="/", capture_output=True, text=True, timeout=120)
        assert attack.stdout.strip() == "planted", attack.stderr
        job.wait_for(lambda: "not sealed with this job's secret" in job.stderr, what="the agent to read the state")
        for process in job.held_workers().values():
            process.resume()
        code = job.finish()
    assert not marker.exists(), "the planted pickle ran"
    assert code == 0, job.stderr
    refusals = [line for line in job.stderr.splitlines() if "not sealed with this job's secret" in line]
    assert len(refusals) == 1, job.stderr
    assert f"the rendezvous store at 127.0.0.1:{port}" in refusals[0]
    assert f"'torch.rendezvous.{run_id}'" in refusals[0]
    assert sorted(f["member"] for f in plan.fired()) == [0, 1]
