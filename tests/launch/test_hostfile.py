"""--hostfile's parts without ssh: the file's format and every refusal (one line each), the flags it fills
in, the command each host runs, the ssh argv, the environment sent. Over real ssh: tests/multihost/
test_hostfile_hosts.py."""

from __future__ import annotations

import shlex

import pytest

from ringtrain.cli import build_parser, main
from ringtrain.cluster import LaunchFlags
from ringtrain.errors import LaunchError
from ringtrain.group.env import remote_environ
from ringtrain.hostfile import (FORWARDED, Hostfile, hostfile_flags, launch_hosts, node_argv, parse_hostfile,
                                read_hostfile, remote_command, ssh_command, ssh_hint)
from tests.conftest import run_cli

GOOD = """\
# the job's hosts
node01 slots=2   # node 0: the rendezvous

node02\tslots=2
"""


@pytest.mark.unit
def test_a_good_hostfile_lists_hosts_in_order_with_their_slots():
    assert parse_hostfile(GOOD, "hosts") == Hostfile("hosts", ("node01", "node02"), 2)
    assert parse_hostfile("198.18.0.1 slots=1").hosts == ("198.18.0.1",)


@pytest.mark.unit
@pytest.mark.parametrize("text, message", [
    ("node01 slots=2\nnode01 slots=2\n", "hosts:2: node01 is listed twice (first on line 1); list each host once, "
                                         "with its workers as slots=N"),
    ("node01 slots=2\nnode02 slots=4\n", "hosts: hosts have different slots (node01 slots=2, node02 slots=4); ringtrain "
                                         "runs the same number of workers on every host: give every host the same slots=N"),
    ("node01\n", "hosts:1: 'node01' is not 'HOST slots=N' (e.g. 'node01 slots=4')"),
    ("node01 slots=two\n", "hosts:1: 'node01 slots=two' is not 'HOST slots=N' (e.g. 'node01 slots=4')"),
    ("node01 slots=2 gpus=1\n", "hosts:1: 'node01 slots=2 gpus=1' is not 'HOST slots=N' (e.g. 'node01 slots=4')"),
    ("node01 slots=0\n", "hosts:1: node01 has slots=0; every host needs slots=1 or more"),
    ("# nothing\n\n", "hosts lists no host; write one 'HOST slots=N' per line"),
])
def test_a_bad_hostfile_is_one_line_naming_the_line_and_the_fix(text, message):
    with pytest.raises(LaunchError) as err:
        parse_hostfile(text, "hosts")
    assert str(err.value) == message


@pytest.mark.unit
def test_a_missing_hostfile_is_one_line(tmp_path):
    with pytest.raises(LaunchError, match=r"^--hostfile .*nope: No such file or directory; pass a file of"):
        read_hostfile(str(tmp_path / "nope"))


HOSTS = Hostfile("hosts", ("node01", "node02", "node03"), 4)


@pytest.mark.unit
def test_the_hostfile_fills_in_the_launch_flags_as_node_0_sees_them():
    filled = hostfile_flags(HOSTS, LaunchFlags(), None, None, pid=123)
    assert filled.flags == LaunchFlags(nproc=4, nnodes="3", node_rank=0, rdzv_endpoint="node01:15123")
    assert filled.line == ("ringtrain: hostfile hosts: 3 hosts (node01, node02, node03), 4 workers per host, "
                           "rendezvous node01:15123")
    assert hostfile_flags(HOSTS, LaunchFlags(nproc=4), None, 29500, pid=123).flags.rdzv_endpoint == "node01:29500"
    assert hostfile_flags(Hostfile("h", ("fe80::1",), 1), LaunchFlags(), None, 1, 0).flags.rdzv_endpoint == "[fe80::1]:1"


@pytest.mark.unit
@pytest.mark.parametrize("given, local_addr, message", [
    (LaunchFlags(nnodes="3"), None, "--nnodes with --hostfile: the hostfile decides it"),
    (LaunchFlags(node_rank=1), None, "--node-rank with --hostfile: the hostfile decides it"),
    (LaunchFlags(rdzv_endpoint="a:1"), None, "--rdzv-endpoint with --hostfile: the hostfile decides it"),
    (LaunchFlags(), "10.0.0.1", "--local-addr with --hostfile: the hostfile decides it"),
    (LaunchFlags(nproc=2), None, "--nproc 2 but hosts gives every host slots=4: drop --nproc, or change the slots"),
])
def test_flags_the_hostfile_decides_are_refused(given, local_addr, message):
    with pytest.raises(LaunchError) as err:
        hostfile_flags(HOSTS, given, local_addr, None, pid=1)
    assert str(err.value).startswith(message)


@pytest.mark.unit
@pytest.mark.parametrize("flags, line", [
    (["--nnodes", "2"], "ringtrain: error: --nnodes with --hostfile: the hostfile decides it (nodes = its hosts, node 0 = "
                        "its first host, the rendezvous there at --rdzv-port); drop --nnodes"),
    (["--nproc", "3"], "ringtrain: error: --nproc 3 but {hostfile} gives every host slots=2: drop --nproc, or change "
                       "the slots"),
    (["--rdzv-port", "0"], "ringtrain: error: --rdzv-port 0 is not a port (1-65535)"),
])
def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path, capsys, flags, line):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    code = main(["train", "configs/debug_mlp.toml", "--hostfile", str(hostfile), *flags])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [line.format(hostfile=hostfile)]


@pytest.mark.job
def test_ssh_flags_without_a_hostfile_are_refused_by_the_command(tmp_path):
    result = run_cli("run", "train.py", "--ssh-option", "Port=2222", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "ringtrain: error: --ssh-option is for --hostfile jobs; add --hostfile FILE or drop --ssh-option"]


@pytest.mark.unit
def test_each_host_runs_the_users_flags_with_its_own_node_flags():
    # Three hosts of two slots: --nproc (the slots) and --nnodes (the hosts) differ, so neither stands for the other.
    hosts = Hostfile("h", ("a", "b", "c"), 2)
    args = build_parser().parse_args(["train", "c.toml", "--hostfile", "h", "--set", "train.lr=0.1", "--run-dir", "r x",
                                      "--resume", "--max-restarts", "2", "--ssh-option", "Port=2"])
    assert node_argv(args, hosts, 1, "a:15000") == [
        "train", "c.toml", "--set", "train.lr=0.1", "--run-dir", "r x", "--max-restarts", "2", "--resume",
        "--nproc", "2", "--nnodes", "3", "--node-rank", "1", "--rdzv-endpoint", "a:15000", "--local-addr", "b"]
    args = build_parser().parse_args(["run", "t.py", "--hostfile", "h", "--min-nproc", "1", "--heal"])
    args.script_args = ["--epochs", "3"]
    assert node_argv(args, hosts, 0, "a:1") == [
        "run", "t.py", "--min-nproc", "1", "--heal", "--nproc", "2", "--nnodes", "3", "--node-rank", "0",
        "--rdzv-endpoint", "a:1", "--local-addr", "a", "--", "--epochs", "3"]


@pytest.mark.unit
def test_every_train_and_run_argument_is_forwarded_or_the_hostfiles_own():
    """A new flag of `train` or `run` must be handled by node_argv (or the hosts would silently run without it)."""
    for argv in (["train", "c.toml"], ["run", "t.py"]):
        names = set(vars(build_parser().parse_args(argv))) | {"script_args"}
        assert names <= FORWARDED, names - FORWARDED


@pytest.mark.unit
def test_the_remote_command_is_one_shell_line_that_quotes_every_word():
    line = remote_command(["train", "my config.toml", "--set", "a=$(x)"], "/opt/py 3/python", "/work/it's",
                          {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/a b"})
    assert line.startswith("cd '/work/it'\"'\"'s' && exec ")
    assert shlex.split(line.split(" && exec ", 1)[1]) == [
        "env", "OMP_NUM_THREADS=1", "PYTHONPATH=/a b", "/opt/py 3/python", "-m", "ringtrain.hostfile", "train",
        "my config.toml", "--set", "a=$(x)"]
    assert remote_command(["train"], "py", "/w", {}) == "cd /w && exec py -m ringtrain.hostfile train"


@pytest.mark.unit
def test_ssh_runs_in_batch_mode_with_the_users_options_first():
    assert ssh_command("node01", "cmd", 2222, ["IdentityFile=/k", "BatchMode=no"]) == [
        "ssh", "-T", "-o", "IdentityFile=/k", "-o", "BatchMode=no", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15",
        "-p", "2222", "--", "node01", "cmd"]


@pytest.mark.unit
def test_the_hosts_get_the_users_variables_not_the_launchers_own():
    env = remote_environ({"PYTHONPATH": "/p", "OMP_NUM_THREADS": "1", "RINGTRAIN_CACHE_DIR": "/c", "HOME": "/root",
                          "RINGTRAIN_FAULT_PLAN": "/plan", "RINGTRAIN_BIND_ADDR": "1.2.3.4", "SLURM_JOB_ID": "1",
                          "RINGTRAIN_JOB_SECRET": "ab" * 16, "RINGTRAIN_JOB_SECRET_FILE": "/home/me/.secret"})
    assert env == {"PYTHONPATH": "/p", "OMP_NUM_THREADS": "1", "RINGTRAIN_CACHE_DIR": "/c"}


# --- issue 41's --hostfile row: one machine counted once, "1 host", a hint on ssh's own failure -------------------
OWN = frozenset({"trainbox", "trainbox.lab", "192.0.2.7"})
"""This machine's names, as _this_machines_names would find them (given: no lookup in a unit test)."""


@pytest.mark.unit
@pytest.mark.parametrize("first, second", [("localhost", "127.0.0.1"), ("127.0.0.1", "alice@localhost"),
                                           ("localhost", "::1"), ("trainbox", "localhost"), ("192.0.2.7", "127.0.0.2"),
                                           ("node01", "alice@NODE01")])
def test_two_lines_for_one_machine_are_refused_in_one_line(first, second):
    with pytest.raises(LaunchError) as err:
        parse_hostfile(f"{first} slots=1\n{second} slots=1\n", "hosts", own=OWN)
    message = str(err.value)
    assert message.startswith(f"hosts:2: {second} is listed twice: it is ") and f"as {first} on line 1" in message
    assert "list each machine once" in message and "\n" not in message


@pytest.mark.unit
def test_distinct_machines_and_this_machine_once_are_accepted():
    assert parse_hostfile("localhost slots=2\nnode02 slots=2\n10.0.0.3 slots=2\n", own=OWN).hosts == (
        "localhost", "node02", "10.0.0.3")


@pytest.mark.unit
def test_one_host_is_one_host():
    filled = hostfile_flags(Hostfile("hosts", ("node01",), 1), LaunchFlags(), None, None, pid=123)
    assert filled.line == "ringtrain: hostfile hosts: 1 host (node01), 1 worker per host, rendezvous node01:15123"


FAKE_SSH = """#!/bin/sh
echo "Host key verification failed." >&2
exit 255
"""


@pytest.mark.job
def test_an_ssh_failure_names_the_fix(tmp_path, monkeypatch, capsys):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    code = launch_hosts(Hostfile("hosts", ("node01",), 1), [["train", "x.toml"]], "python3", "/tmp", {})
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 255
    assert last.startswith("ringtrain: error: host node01 (node 0): ssh failed: Host key verification failed; "), last
    assert "`ssh node01 true`" in last and "StrictHostKeyChecking=accept-new" in last and "known_hosts" in last, last


@pytest.mark.unit
@pytest.mark.parametrize("line, fix", [("Permission denied (publickey).", "ssh-copy-id node01"),
                                       ("ssh: Could not resolve hostname node01: Name or service not known",
                                        "not a name this machine resolves"),
                                       ("ssh: connect to host node01 port 22: Connection refused", "sshd runs there")])
def test_other_ssh_failures_name_their_fix(line, fix):
    hint = ssh_hint(line, "node01")
    assert fix in hint and hint.endswith("check with `ssh -o BatchMode=yes node01 true` first"), hint
