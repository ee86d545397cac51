"""A ``ringtrain`` command running in the background, as a user's terminal would hold it, plus the means to
hurt it: its worker and agent processes (found by their environment), its stderr line by line with the
time each line arrived, and the run directory's records as they are written.

    with Job("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir)) as job:
        job.wait_for(lambda: last_step(run_dir) >= 10)
        job.worker(rank=1).kill()
        assert job.finish() == 0
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from ringtrain.testing.runs import last_step, ledger_steps, records

_FORKSERVER = "multiprocessing.forkserver"
_TITLE = re.compile(r"ringtrain\.worker rank (\d+)/")
"""A forked worker's title (ringtrain.worker.forked)."""

REPO = Path(__file__).resolve().parents[2]
"""The checkout ringtrain runs from: jobs start there, with it on PYTHONPATH (as tests/conftest.py's REPO)."""

__all__ = ["Job", "records", "last_step", "ledger_steps", "assert_loopback_only"]


class Job:
    def __init__(self, *args: str, env: dict | None = None, watch_sockets: bool = False,
                 worker_command: str = "ringtrain.worker", prefix: Sequence[str] = ()):
        self.worker_command = worker_command
        """What a worker's command line holds: ringtrain.worker, or the script of `ringtrain run`."""
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        if args[:1] == ("join",) and not (env or {}).get("RINGTRAIN_JOB_SECRET"):
            full_env.pop("RINGTRAIN_JOB_SECRET", None)  # as a user joins: the secret the job's launcher kept
        self.started = time.monotonic()
        # prefix: e.g. `ip netns exec NS` (tests/hosts.py), which runs the command on a test host.
        self.process = subprocess.Popen([*prefix, sys.executable, "-m", "ringtrain", *args], cwd=REPO, env=full_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self.stdout: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.process.stderr, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.process.stdout, None), daemon=True)]
        self.listening: dict[tuple, str] = {}
        """(pid, ip, port) -> 'worker' | 'launcher/agent' of every listening socket seen (watch_sockets)."""
        if watch_sockets:
            self._readers.append(threading.Thread(target=self._watch_sockets, daemon=True))
        for reader in self._readers:
            reader.start()

    def _watch_sockets(self) -> None:
        # Every 20 ms the socket inodes the job's processes hold (their fd tables: cheap); the machine's
        # listening sockets (/proc/net/tcp and tcp6, ~7 ms of kernel time to read) only while one of those is
        # new (under a second old: bind and listen may follow the socket's creation); the process tree
        # (a read of every process on the machine, ~2 ms) every 0.2 s. psutil's scan of every process's
        # connections every 20 ms took 11-20% of a core in this test process for as long as the job ran.
        kinds: dict[int, str] = {}
        procs: list[psutil.Process] = []
        first_seen: dict[int, float] = {}
        done: set[int] = set()  # inodes found listening (recorded) or older than a second and not listening
        tree_at = 0.0
        while self.process.poll() is None:
            now = time.monotonic()
            if now - tree_at >= 0.2:
                procs, tree_at = self.tree(), now
                for proc in procs:
                    # Named once, while the command line is readable (an exiting process shows an empty one).
                    with contextlib.suppress(psutil.Error):
                        command = " ".join(proc.cmdline())
                        # A worker forked from the launcher's forkserver shows the forkserver's command line
                        # until it sets its title (ringtrain.worker.forked): named once it has.
                        if command and proc.pid not in kinds and _FORKSERVER not in command:
                            kinds[proc.pid] = "worker" if "ringtrain.worker" in command else "launcher/agent"
            held: dict[int, int] = {}
            for proc in procs:
                with contextlib.suppress(OSError):
                    held.update(dict.fromkeys(_socket_inodes(proc.pid) - done, proc.pid))
            if held:
                listening = _listening_tcp()
                for inode, pid in held.items():
                    first_seen.setdefault(inode, now)
                    if inode in listening:
                        ip, port = listening[inode]
                        self.listening[(pid, ip, port)] = kinds.get(pid, "unknown")
                        done.add(inode)
                    elif now - first_seen[inode] > 1.0:
                        done.add(inode)
            time.sleep(0.02)

    def _read(self, stream, sink) -> None:
        for line in stream:
            if sink is None:
                self.stdout.append(line)
            else:
                sink.append((time.monotonic(), line.rstrip("\n")))

    # --- processes ------------------------------------------------------------------------------
    def tree(self) -> list[psutil.Process]:
        try:
            return [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def workers(self) -> dict[int, psutil.Process]:
        """The training workers, by rank: the processes with RANK in their environment, or, forked from the
        launcher's forkserver (whose environment is the forkserver's), titled ``ringtrain.worker rank R/W: ...``."""
        found = {}
        for proc in self.tree():
            try:
                command = " ".join(proc.cmdline())
                if self.worker_command not in command:
                    continue
                titled = _TITLE.match(command)
                if titled:
                    found[int(titled.group(1))] = proc
                elif "RANK" in proc.environ():
                    found[int(proc.environ()["RANK"])] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def worker(self, rank: int, timeout: float = 60) -> psutil.Process:
        self.wait_for(lambda: rank in self.workers(), timeout, f"worker rank {rank} to start")
        return self.workers()[rank]

    def held(self) -> int:
        """How many of the job's workers are stopped (held by a ``stop`` fault, or SIGSTOP)."""
        return len(self.held_workers())

    def held_workers(self) -> dict[int, psutil.Process]:
        """The job's stopped workers (held by a ``stop`` fault, or SIGSTOP), by rank."""
        held = {}
        for rank, process in self.workers().items():
            try:
                if process.status() == psutil.STATUS_STOPPED:
                    held[rank] = process
            except psutil.Error:
                continue
        return held

    def resume_workers(self) -> None:
        """SIGCONT to every worker (those gone meanwhile skipped)."""
        for process in self.workers().values():
            try:
                process.resume()
            except psutil.Error:
                continue

    def agent_of(self, rank: int) -> psutil.Process:
        """The elastic agent (a `ringtrain join` process) whose worker has this rank."""
        return self.worker(rank).parent()

    # --- waiting --------------------------------------------------------------------------------
    # The default waits are for events, not bounds: beside other tests and busy processes (load 25-50 on two
    # cores) a job of a launcher, three agents and three workers, each importing torch, took over 300 s to
    # start its workers (a test that waits this long needs pytest's timeout raised: the chaos tests' 900 s).
    def wait_for(self, predicate: Callable[[], object], timeout: float = 600, what: str = "the condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.process.poll() is not None and not predicate():
                raise AssertionError(f"the job exited ({self.process.returncode}) before {what}:\n{self.stderr}")
            time.sleep(0.01)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.stderr}")

    def wait_for_line(self, text: str, timeout: float = 600) -> tuple[float, str]:
        def found():
            return next(((t, line) for t, line in self.lines if text in line), None)
        return self.wait_for(found, timeout, f"a line containing {text!r}")

    def describe(self) -> str:
        """Every process of the job's tree: pid, state, the end of its command line, and its Python stacks when
        py-spy is installed (for a test that found a process still running when it should have ended)."""
        lines = []
        for proc in self.tree():
            try:
                status, command = proc.status(), " ".join(proc.cmdline()[-3:])
            except psutil.ZombieProcess:
                status, command = "zombie (exited, not reaped by its parent)", ""
            except psutil.Error as err:
                status, command = type(err).__name__, ""
            lines.append(f"pid {proc.pid} ({status}): {command}")
            spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
            if spy and status != psutil.STATUS_ZOMBIE and command:
                dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
                lines.append(dump.stdout[-3000:] or dump.stderr[-500:])
        return "\n".join(lines) or "no process left"

    def finish(self, timeout: float = 300) -> int:
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    # --- cleanup: no process of the job outlives the test -----------------------------------------
    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.tree()):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)


_TCP_LISTEN = "0A"


def _listening_tcp() -> dict[int, tuple[str, int]]:
    """inode -> (ip, port) of every listening TCP socket of this network namespace (``/proc/net/tcp``, ``tcp6``)."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _TCP_LISTEN:
                ip_hex, port_hex = fields[1].split(":")
                # The kernel prints the address as 32-bit words in host (little-endian) order.
                packed = b"".join(int(ip_hex[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(ip_hex), 8))
                found[int(fields[9])] = (socket.inet_ntop(family, packed), int(port_hex, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def assert_loopback_only(listening: dict[tuple, str], what: str) -> None:
    """Chaos 11: every socket a job listened on (``Job(watch_sockets=True)``) was bound to loopback."""
    exposed = [key for key in listening if not ipaddress.ip_address(key[1]).is_loopback]
    kinds = sorted(set(listening.values()))
    print(f"listening sockets ({what}): {len(listening)} seen ({', '.join(kinds)}), {len(exposed)} off loopback")
    assert not exposed, f"sockets listening beyond loopback: {exposed}"
    assert "worker" in kinds and "launcher/agent" in kinds, f"sampling missed the job's listeners: {listening}"
