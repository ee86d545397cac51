"""An sshd inside each test host (Debian's openssh-server), with keys made for the test, for ``--hostfile`` jobs.

Each host's sshd listens on that host's 198.18.0.x only (inside its namespace: nothing outside the test hosts
can reach it, and it reaches nothing else), with its own host key and an authorized key made for the test,
everything in the test's tmp_path. The client's options (``client_options``) name that key and a known-hosts
file in tmp_path, so the machine's own ~/.ssh is neither read for keys nor written.

    with SshHosts(hosts, tmp_path) as ssh:       # sshd on every host
        ... --hostfile FILE *ssh.ssh_flags() ...   # --ssh-option IdentityFile=... per option
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.hosts import Hosts

SSHD = "/usr/sbin/sshd"


def missing() -> str | None:
    """None when sshd and the ssh client are installed, else one line naming the Debian package."""
    if not os.path.exists(SSHD):
        return f"--hostfile tests need sshd ({SSHD}): apt-get install openssh-server"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "--hostfile tests need ssh and ssh-keygen: apt-get install openssh-client"
    return None


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ringtrain-test", "-f", str(path)], check=True)


class SshHosts:
    """sshd on hosts ``on`` (default all) of ``hosts``; ``authorized`` per host: which key it accepts
    ('job': the client's key, 'other': a key the client does not hold)."""

    def __init__(self, hosts: Hosts, tmp_path: Path, on: list[int] | None = None, authorized: dict | None = None):
        self.hosts, self.dir = hosts, tmp_path / "ssh"
        self.dir.mkdir()
        self.on = list(range(hosts.count)) if on is None else on
        self.authorized = authorized or {}
        self.servers: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> SshHosts:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation folder (empty)
        _keygen(self.dir / "host_key")
        _keygen(self.dir / "id_job")
        _keygen(self.dir / "id_other")
        for key in ("job", "other"):
            (self.dir / f"authorized_{key}").write_text((self.dir / f"id_{key}.pub").read_text())
        try:
            for i in self.on:
                self.servers[i] = self._start(i)
            for i in self.on:
                self._wait_ready(i)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, i: int) -> subprocess.Popen:
        config = self.dir / f"sshd_{i}.conf"
        config.write_text("\n".join([
            "Port 22", f"ListenAddress {self.hosts.addr(i)}", f"HostKey {self.dir / 'host_key'}",
            f"AuthorizedKeysFile {self.dir / ('authorized_' + self.authorized.get(i, 'job'))}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", f"PidFile {self.dir / f'sshd_{i}.pid'}", "LogLevel ERROR", ""]))
        log = open(self.dir / f"sshd_{i}.log", "w")
        return self.hosts.popen(i, [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self, i: int, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.servers[i].poll() is not None:
                raise RuntimeError(f"sshd on host {i} exited: {(self.dir / f'sshd_{i}.log').read_text()}")
            if (self.dir / f"sshd_{i}.pid").exists():
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd on host {i} did not start within {timeout_s} s")

    def __exit__(self, *exc) -> None:
        for server in self.servers.values():
            server.terminate()
        for server in self.servers.values():
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self.servers.clear()

    def client_options(self) -> list[str]:
        return [f"IdentityFile={self.dir / 'id_job'}", "IdentitiesOnly=yes", f"UserKnownHostsFile={self.dir / 'known_hosts'}",
                "StrictHostKeyChecking=no", "LogLevel=ERROR"]

    def ssh_flags(self) -> list[str]:
        return [word for option in self.client_options() for word in ("--ssh-option", option)]

    def server_pids(self) -> set[int]:
        return {server.pid for server in self.servers.values()}


def processes_in(hosts: Hosts, i: int) -> dict[int, str]:
    """pid -> command line of every process in host i's network namespace."""
    try:
        target = os.stat(f"/run/netns/{hosts.ns(i)}").st_ino
    except OSError:
        return {}
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/net") == f"net:[{target}]":
                found[int(entry.name)] = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found
