"""--hostfile against hostile input (issue 39, row 4) and the job's secret over ssh: a host ssh would read as an
option (``-oProxyCommand=...``, ``-F/path``, ``-E/path``) or a shell would split is refused in one line, exit 2;
``--`` stands right before the host in ssh's argv all the same; the job's secret goes to each host on ssh's
stdin (its first line), never on a command line, and the host's end hands it to its launcher's environment.
Without ssh: a stand-in ``ssh`` on PATH records what it was given; serve_node runs a stand-in launcher."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from ringtrain.cli import build_parser, main
from ringtrain.cluster import LaunchFlags
from ringtrain.errors import LaunchError
from ringtrain.group.env import remote_environ
from ringtrain.hostfile import (Hostfile, hostfile_flags, launch_hosts, node_argv, parse_hostfile, remote_command,
                                ssh_command)
from tests.conftest import REPO

SECRET = "0123456789abcdef" * 4
FIX = "; write a hostname or an IP address, optionally USER@ before it (e.g. 'node01 slots=4', 'alice@10.0.0.2 slots=4')"


@pytest.mark.unit
@pytest.mark.parametrize("host, wrong", [
    ("-oProxyCommand=touch${IFS}/tmp/x", "starts with '-' (ssh would take it for an option)"),
    ("-F/path", "starts with '-' (ssh would take it for an option)"),
    ("-E/path", "starts with '-' (ssh would take it for an option)"),
    ("-x@node01", "starts with '-' (ssh would take it for an option)"),
    ("a;b@node01", "has the user name 'a;b' (letters, digits, '_', '.', '-'; not first '-')"),
    ("a@-F/path", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("node01;id", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("$(id)", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("node`id`", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("node_01", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("node01-", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("a..b", "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"),
    ("fe80::1%eth0;id", "has the zone 'eth0;id' (an IPv6 address's interface: letters, digits, '_', '.', '-')"),
    ("10.0.0.1%eth0", "has the zone 'eth0' (an IPv6 address's interface: letters, digits, '_', '.', '-')"),
])
def test_a_host_ssh_would_read_as_an_option_or_a_shell_would_split_is_refused(host, wrong):
    with pytest.raises(LaunchError) as err:
        parse_hostfile(f"node00 slots=1\n{host} slots=1\n", "hosts")
    assert str(err.value) == f"hosts:2: host {host!r} {wrong}{FIX}"


@pytest.mark.unit
def test_the_cli_refuses_the_proxycommand_host_in_one_line_with_exit_2(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# planted\n-oProxyCommand=touch${IFS}/tmp/x slots=1\n")
    assert main(["train", "configs/debug_mlp.toml", "--hostfile", str(hostfile)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ringtrain: error: {hostfile}:2: host '-oProxyCommand=touch${{IFS}}/tmp/x' starts with '-' (ssh would take "
        f"it for an option){FIX}"]


@pytest.mark.unit
def test_hostnames_addresses_and_user_at_host_are_taken():
    hosts = ("node01", "gpu-3.cluster.local", "10.0.0.2", "fe80::1", "fe80::1%eth0", "alice@node02", "bob_x@10.0.0.3",
             "c.d-e@2001:db8::7", "N1")
    assert parse_hostfile("".join(f"{host} slots=2\n" for host in hosts)).hosts == hosts


@pytest.mark.unit
def test_user_at_host_reaches_the_other_hosts_at_the_address_only():
    hosts = Hostfile("h", ("alice@node01", "bob@fe80::2"), 1)
    assert hostfile_flags(hosts, LaunchFlags(), None, 29500, pid=1).flags.rdzv_endpoint == "node01:29500"
    args = build_parser().parse_args(["train", "c.toml", "--hostfile", "h"])
    assert node_argv(args, hosts, 1, "node01:29500")[-2:] == ["--local-addr", "fe80::2"]


@pytest.mark.unit
@pytest.mark.parametrize("host", ["node01", "-oProxyCommand=touch${IFS}/tmp/x", "-F/path", "-E/path"])
def test_ssh_has_double_dash_right_before_the_host(host):
    argv = ssh_command(host, "cmd", 22, ["IdentityFile=/k"])
    assert argv[-3:] == ["--", host, "cmd"]
    assert argv.index("--") == len(argv) - 3 and argv.count(host) == 1


@pytest.mark.job
@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_openssh_takes_what_follows_the_double_dash_as_the_host(tmp_path):
    """The real client, ``ssh -G`` (prints its settings, connects nowhere): the argv ssh_command makes for the
    host ``-E{tmp}/log`` does not make ssh open that log file (as the option -E would), and says the host is not
    a hostname."""
    log = tmp_path / "log"
    argv = ssh_command(f"-E{log}", "true", 2222)
    done = subprocess.run([argv[0], "-G", *argv[1:]], capture_output=True, text=True, timeout=30)
    assert done.returncode == 255 and "hostname contains invalid characters" in done.stderr, done.stderr
    assert not log.exists()
    plain = subprocess.run([argv[0], "-G", *ssh_command("node01", "true", 2222)[1:]], capture_output=True, text=True,
                           timeout=30)
    assert plain.returncode == 0 and "hostname node01" in plain.stdout.splitlines(), plain.stderr


def _fake_ssh(tmp_path) -> tuple[str, str]:
    """A stand-in ssh on PATH: records its argv and the first line on its stdin, per host, and exits 0."""
    bin_dir, out = tmp_path / "bin", tmp_path / "seen"
    bin_dir.mkdir()
    out.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!{sys.executable}\n"
                   "import json, os, select, sys\n"
                   "ready = select.select([0], [], [], 10)[0]  # a launcher that writes nothing: '' after 10 s\n"
                   "first = sys.stdin.buffer.readline().decode() if ready else ''\n"
                   f"with open(os.path.join({str(out)!r}, sys.argv[-2]), 'w') as f:\n"
                   "    json.dump({'argv': sys.argv[1:], 'first': first}, f)\n")
    ssh.chmod(0o755)
    return str(bin_dir), str(out)


@pytest.mark.job
def test_the_secret_goes_to_each_host_on_ssh_stdin_never_in_its_argv(tmp_path, monkeypatch, capsys):
    bin_dir, out = _fake_ssh(tmp_path)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("RINGTRAIN_JOB_SECRET", SECRET)
    monkeypatch.setenv("RINGTRAIN_JOB_SECRET_FILE", str(tmp_path / "secret"))
    monkeypatch.setenv("RINGTRAIN_CACHE_DIR", "/c")
    hosts = Hostfile("h", ("node01", "alice@node02"), 1)
    argvs = [["train", "c.toml", "--node-rank", str(i)] for i in range(2)]
    # As cli.py calls it: the environment remote_environ picks; and a caller that passes the secret anyway.
    for env in (remote_environ(), {**remote_environ(), "RINGTRAIN_JOB_SECRET": SECRET}):
        assert launch_hosts(hosts, argvs, sys.executable, "/w", env) == 0
        for host in hosts.hosts:
            seen = json.loads(open(os.path.join(out, host)).read())
            assert seen["first"] == f"secret {SECRET}\n"
            assert SECRET not in " ".join(seen["argv"]) and "JOB_SECRET" not in " ".join(seen["argv"])
            assert seen["argv"][-3:-1] == ["--", host] and "RINGTRAIN_CACHE_DIR=/c" in seen["argv"][-1]
    monkeypatch.delenv("RINGTRAIN_JOB_SECRET")
    assert launch_hosts(hosts, argvs, sys.executable, "/w", remote_environ()) == 0
    assert json.loads(open(os.path.join(out, "node01")).read())["first"] == "nosecret\n"
    assert SECRET not in capsys.readouterr().err


@pytest.mark.job
def test_a_secret_that_is_not_hex_is_refused_before_any_host_starts(tmp_path, monkeypatch):
    bin_dir, out = _fake_ssh(tmp_path)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("RINGTRAIN_JOB_SECRET", "not hex\nsecret 00")
    with pytest.raises(LaunchError, match="^RINGTRAIN_JOB_SECRET is not a hex string; unset it"):
        launch_hosts(Hostfile("h", ("node01",), 1), [["train"]], sys.executable, "/w", {})
    assert os.listdir(out) == []


# --- the host's end: serve_node, with a stand-in launcher ------------------------------------------------
CHILD = ("import json, os, sys, time\n"
         "json.dump({'argv': sys.argv, 'secret': os.environ.get('RINGTRAIN_JOB_SECRET'),\n"
         "           'cmdline': open('/proc/self/cmdline', 'rb').read().decode(errors='replace')},\n"
         "          open(os.environ['SEEN'], 'w'))\n"
         "time.sleep(float(os.environ.get('SLEEP', '0')))\n")


def _serve(tmp_path, sleep: float = 0.0) -> subprocess.Popen:
    """``python -c 'serve_node(...)'`` with a stand-in launcher that records its argv and environment."""
    code = (f"import sys; from ringtrain.hostfile import serve_node; "
            f"sys.exit(serve_node(['train', 'c.toml'], program=[sys.executable, '-c', {CHILD!r}]))")
    env = {**os.environ, "SEEN": str(tmp_path / "seen.json"), "SLEEP": str(sleep), "PYTHONPATH": str(REPO)}
    env.pop("RINGTRAIN_JOB_SECRET", None)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=REPO)


@pytest.mark.job
def test_the_hosts_end_reads_the_first_line_and_hands_the_secret_to_its_launcher(tmp_path):
    serving = _serve(tmp_path)
    serving.stdin.write(f"secret {SECRET}\n".encode())
    serving.stdin.flush()
    assert serving.wait(timeout=60) == 0, serving.stderr.read()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["secret"] == SECRET
    assert seen["argv"][1:] == ["train", "c.toml"] and SECRET not in seen["cmdline"]
    serving.stdin.close()

    serving = _serve(tmp_path)
    serving.stdin.write(b"nosecret\n")
    serving.stdin.flush()
    assert serving.wait(timeout=60) == 0
    assert json.loads((tmp_path / "seen.json").read_text())["secret"] is None
    serving.stdin.close()


@pytest.mark.job
def test_the_hosts_end_still_stops_its_launcher_when_stdin_closes(tmp_path):
    serving = _serve(tmp_path, sleep=120)
    serving.stdin.write(f"secret {SECRET}\n".encode())
    serving.stdin.flush()
    deadline = time.monotonic() + 30
    while not (tmp_path / "seen.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    serving.stdin.close()  # the launching machine stops the job: EOF on the ssh channel
    assert serving.wait(timeout=30) == 128 + 15  # the launcher got SIGTERM
    assert time.monotonic() - started < 10


@pytest.mark.job
@pytest.mark.parametrize("sent, why", [
    (b"", "stdin closed before the first line"),
    (b"secret zz\n", "the first line on stdin is neither 'secret HEX' nor 'nosecret'"),
    (b"train c.toml\n", "the first line on stdin is neither 'secret HEX' nor 'nosecret'"),
])
def test_a_wrong_first_line_is_one_line_exit_2_and_nothing_starts(tmp_path, sent, why):
    serving = _serve(tmp_path)
    serving.stdin.write(sent)
    serving.stdin.close()
    assert serving.wait(timeout=60) == 2
    lines = serving.stderr.read().decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ringtrain: error: ringtrain.hostfile: {why}"), lines
    assert not (tmp_path / "seen.json").exists()


@pytest.mark.unit
def test_the_remote_command_never_holds_the_secret():
    line = remote_command(["train", "c.toml"], "py", "/w", remote_environ({"RINGTRAIN_JOB_SECRET": SECRET,
                                                                          "RINGTRAIN_X": "1"}))
    assert SECRET not in line and line.endswith("exec env RINGTRAIN_X=1 py -m ringtrain.hostfile train c.toml")
