"""``ringtrain train CONFIG --hostfile FILE`` across test hosts, over real ssh: an sshd inside each host's
network namespace (tests/multihost/sshd.py), keys made for the test. The launcher runs inside host 0, so its
ssh connections go to 198.18.0.x only. A 2-host job trains to the bits of the same job on loopback; a host
whose ssh fails is one line naming it, fast, and nothing is left running on any host; SIGTERM to the
launcher stops every host."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.jobs import Job, last_step
from tests.distributed import run_distributed
from tests.multihost.sshd import SshHosts, missing, processes_in
from tests.multihost.test_launch import CONFIG, SHORT
from tests.trainers import train_run

pytestmark = pytest.mark.hosts

PORT = "29400"


@pytest.fixture(autouse=True)
def _needs_sshd():
    reason = missing()
    if reason:
        pytest.skip(reason)


def _hostfile(tmp_path, hosts, slots: int = 1):
    path = tmp_path / "hostfile"
    path.write_text("# the test hosts\n" + "".join(f"{hosts.addr(i)} slots={slots}\n" for i in range(hosts.count)))
    return str(path)


def _left_over(hosts, ssh) -> dict:
    """Processes still in any host's namespace, besides the test's sshd listeners."""
    return {i: {pid: cmd for pid, cmd in processes_in(hosts, i).items() if pid not in ssh.server_pids()}
            for i in range(hosts.count)}


def _until_none_left(hosts, ssh, timeout_s: float = 15) -> dict:
    deadline = time.monotonic() + timeout_s
    while any(_left_over(hosts, ssh).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _left_over(hosts, ssh)


def test_two_hosts_over_ssh_train_as_on_loopback(make_hosts, tmp_path):
    hosts = make_hosts(2)
    run_dir = tmp_path / "hosts"
    with SshHosts(hosts, tmp_path) as ssh:
        with Job("train", CONFIG, "--hostfile", _hostfile(tmp_path, hosts), "--rdzv-port", PORT, "--run-dir",
                 str(run_dir), *SHORT, *ssh.ssh_flags(), prefix=hosts.exec_prefix(0)) as job:
            assert job.finish(timeout=180) == 0, job.stderr
        assert (f"ringtrain: hostfile {tmp_path / 'hostfile'}: 2 hosts ({hosts.addr(0)}, {hosts.addr(1)}), 1 worker "
                f"per host, rendezvous {hosts.addr(0)}:{PORT}") in job.stderr, job.stderr
        # Each host's lines come back with its name; rank 0 (on host 0) saw both hosts.
        assert f"[{hosts.addr(0)}] ringtrain: 2 workers on 2 hosts: {hosts.addr(0)} " in job.stderr, job.stderr
        assert _until_none_left(hosts, ssh) == {0: {}, 1: {}}
    across = json.loads((run_dir / "summary.json").read_text())
    assert across["world_size"] == 2
    run_distributed(train_run, 2, CONFIG, SHORT[1::2], str(tmp_path / "local"), False)
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert across["param_sha256"] == local["param_sha256"]


@pytest.mark.parametrize("fault", ["no sshd", "wrong key"])
def test_a_host_whose_ssh_fails_is_one_line_and_nothing_is_left(make_hosts, tmp_path, fault):
    hosts = make_hosts(2)
    setup = {"on": [0]} if fault == "no sshd" else {"authorized": {1: "other"}}
    with SshHosts(hosts, tmp_path, **setup) as ssh:
        started = time.monotonic()
        with Job("train", CONFIG, "--hostfile", _hostfile(tmp_path, hosts), "--rdzv-port", PORT, "--run-dir",
                 str(tmp_path / "run"), *SHORT, *ssh.ssh_flags(), prefix=hosts.exec_prefix(0)) as job:
            code = job.finish(timeout=90)
        took_s = time.monotonic() - started
        errors = [line for _, line in job.lines if line.startswith("ringtrain: error:")]
        print(f"{fault}: exit {code} after {took_s:.1f} s: {errors}")
        assert code == 255, job.stderr
        assert len(errors) == 1 and f"host {hosts.addr(1)} (node 1): ssh failed: " in errors[0], job.stderr
        why = "Connection refused" if fault == "no sshd" else "Permission denied"
        assert why in errors[0], errors
        assert took_s < 45, job.stderr
        assert _until_none_left(hosts, ssh) == {0: {}, 1: {}}


def test_sigterm_to_the_launcher_stops_every_host(make_hosts, tmp_path):
    hosts = make_hosts(2)
    run_dir = tmp_path / "run"
    with SshHosts(hosts, tmp_path) as ssh:
        with Job("train", CONFIG, "--hostfile", _hostfile(tmp_path, hosts), "--rdzv-port", PORT, "--run-dir",
                 str(run_dir), "--set", "train.epochs=200", "--set", "monitor.log_every_steps=1", *ssh.ssh_flags(),
                 prefix=hosts.exec_prefix(0)) as job:
            job.wait_for(lambda: last_step(run_dir) >= 3, timeout=120, what="step 3")
            job.process.send_signal(signal.SIGTERM)  # the launcher (ip netns exec execs it)
            code = job.finish(timeout=90)
        print(job.stderr[-3000:])
        assert code == 128 + signal.SIGTERM, job.stderr
        # The stop reached the workers as a SIGTERM does on one host: rank 0 saved the step it reached.
        assert f"[{hosts.addr(0)}] ringtrain: [rank 0] stopped at step" in job.stderr, job.stderr
        assert list((run_dir / "checkpoints").glob("step_*")), job.stderr
        assert _until_none_left(hosts, ssh) == {0: {}, 1: {}}


def test_ringtrain_run_a_script_over_ssh_with_its_own_arguments(make_hosts, tmp_path):
    """`ringtrain run SCRIPT --hostfile FILE -- ARGS`: every host runs the script with ARGS after `--`."""
    hosts = make_hosts(2)
    run_dir = tmp_path / "run"
    with SshHosts(hosts, tmp_path) as ssh:
        with Job("run", "examples/tabular_regression.py", "--hostfile", _hostfile(tmp_path, hosts), "--rdzv-port", PORT,
                 "--run-dir", str(run_dir), "--set", "monitor.progress=false", *ssh.ssh_flags(), "--", "--epochs", "1",
                 prefix=hosts.exec_prefix(0)) as job:
            assert job.finish(timeout=180) == 0, job.stderr
        assert _until_none_left(hosts, ssh) == {0: {}, 1: {}}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 1, summary  # --epochs 1 reached the script
