"""Issue 41's Ctrl-C row: Ctrl-C on `ringtrain train` (the terminal's SIGINT reaches the launcher and every
worker, its process group) ends with ringtrain's own "stopped at step N" line and the stop's exit code; torch's
agent's `Received 2 death signal` warning, C++ store stacks (`TCPStore recvVector failed`) and tracebacks do not
reach the console."""

from __future__ import annotations

import signal

import pytest

from tests.jobs import Job, last_step

pytestmark = pytest.mark.job

NOISE = ("death signal", "Traceback", "recvVector", "TCPStore", "SignalException")


COMMANDS = {
    "train": ("train", "configs/debug_mlp.toml", "--set", "train.max_steps=100000", "--set", "checkpoint.every_steps=5"),
    "run": ("run", "examples/digits_cnn_session.py"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_ends_with_ringtrains_line_only(tmp_path, command):
    run_dir = tmp_path / "run"
    name, target, *settings = COMMANDS[command]
    extra = ["--", "--epochs", "1000"] if name == "run" else []
    with Job(name, target, "--nproc", "2", "--run-dir", str(run_dir), *settings, *extra) as job:
        job.wait_for(lambda: last_step(run_dir) >= 3, what="step 3")
        for process in [job.process, *job.workers().values()]:  # a terminal's Ctrl-C: the whole process group
            process.send_signal(signal.SIGINT)
        code = job.finish()
    output = job.stderr + "".join(job.stdout)
    assert code == 128 + signal.SIGINT, output
    assert "stopped at step" in output, output
    leaked = [line for line in output.splitlines() if any(noise in line for noise in NOISE)]
    assert not leaked, output
