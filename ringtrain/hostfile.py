"""``--hostfile FILE``: one ``ringtrain`` launcher per host, each started over ssh from the machine you type on.

    ringtrain train configs/digits_mlp.toml --hostfile hosts      # hosts: "node01 slots=4" per line

The hostfile is DeepSpeed's (and MPI's) format: one ``HOST slots=N`` per line, ``#`` comments, blank lines.
It is one more source of the launch flags, beside ``cluster.py``'s schedulers: ``--nnodes`` is the number of
hosts, ``--nproc`` their slots (every host the same: ringtrain's nodes have equal ``--nproc``), node i is the
file's i-th host, and the rendezvous is the first host at ``--rdzv-port`` (default 15000 + this launcher's
pid % 20000: as a SLURM job id gives its port, launches from one machine at the same time get different ones).

For each host this process runs, with the same Python and working directory as here (``--remote-python``,
``--remote-cwd`` say otherwise)::

    ssh -T -o BatchMode=yes -- HOST 'cd CWD && exec [env VAR=...] PYTHON -m ringtrain.hostfile train CONFIG
        --nproc N --nnodes H --node-rank i --rdzv-endpoint FIRST:PORT --local-addr HOST ...your flags'

A host is ``[USER@]NAME``, NAME a hostname (RFC 1123) or an IP address; anything else (a host starting with
``-``, which ssh would read as an option such as ``-oProxyCommand=...``; spaces, shell characters) is refused in
one line naming the file and the line, and ``--`` stands before the host in ssh's argv all the same.

The job's secret (``RINGTRAIN_JOB_SECRET``, hex) never rides on a command line, which every user of both
machines can read: the first line this process writes on each ssh's stdin is ``secret HEX`` (or ``nosecret``),
and the host's end reads that line before anything else and puts the secret in its launcher's environment.

relays each host's stdout and stderr line by line as ``[HOST] line``, waits for every host and returns the
first failure's exit code with one line naming the host (ssh's own failure, 255, with ssh's last line; the
other hosts are stopped then). ``-o BatchMode=yes``: a host without a usable key fails at once instead of
asking for a password.

Stopping: ssh forwards no signal without a terminal (and ``-tt`` would mix the output streams and echo). So
the remote end is ``python -m ringtrain.hostfile``, a small wrapper that runs ``python -m ringtrain ...`` and
watches its own stdin, the ssh channel: when stdin closes, it sends the launcher SIGTERM (the workers save
the step they reached and exit, as on Ctrl-C), and SIGKILL after ``STOP_GRACE_S``. This process stops a host
by closing that ssh's stdin: ssh sends EOF and stays connected, so the host's last lines and its exit code
still come back. Ctrl-C or SIGTERM here stops every host that way (a second one kills the ssh clients);
a lost connection, or this process killed outright, closes the channel too, so no host is left running. The
ssh clients run in their own session, so a terminal's Ctrl-C reaches this process only and not them.

How it compares with DeepSpeed (``deepspeed/launcher/runner.py`` ``fetch_hostfile`` / ``_parse_hostfile``,
``multinode_runner.py`` ``PDSHRunner``): the same file format, duplicates refused alike; DeepSpeed lets hosts
differ in slots, ringtrain refuses (every node runs ``--nproc`` workers) and says so in one line. DeepSpeed
fans out with pdsh and ``cd CWD; python -m deepspeed.launcher.launch --node_rank=%n``, exporting the
``NCCL*``/``PYTHON*``/... variables and ``.deepspeed_env``; here plain ssh per host (no pdsh needed), the
same Python, ``PYTHONPATH``, ``OMP_NUM_THREADS`` and ``RINGTRAIN_*`` variables (``group/env.remote_environ``;
the secret excepted: stdin carries it).
DeepSpeed stops on Ctrl-C with SIGINT/SIGTERM to pdsh plus a second pdsh running ``pkill -f`` on every host
(which may hit other jobs' processes); here stdin's end stops exactly the processes this launch started.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringtrain.cluster import SLURM_BASE_PORT, SLURM_PORT_SPAN, FilledFlags, LaunchFlags
from ringtrain.errors import LaunchError
from ringtrain.group.auth import SECRET_VAR

__all__ = ["Hostfile", "parse_hostfile", "read_hostfile", "check_host", "host_address", "hostfile_flags",
           "add_hostfile_arguments", "node_argv", "remote_command", "ssh_command", "first_line", "launch_hosts",
           "read_first_line", "serve_node", "STOP_GRACE_S", "machine_of", "ssh_hint", "THIS_MACHINE"]

STOP_GRACE_S = 60.0
"""After stdin closes, how long the remote launcher has to save and exit after SIGTERM before SIGKILL."""
SSH_EXIT = 255
"""ssh's own failure (no connection, no key accepted): anything else is the remote command's code."""
FIRST_LINE_TIMEOUT_S = 60.0
"""How long a host's end waits for the launching machine's first line (the job secret) before it gives up."""
_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
"""One label of a hostname (RFC 1123): letters, digits, inner hyphens, 63 at most."""
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_SCOPE = re.compile(r"^[A-Za-z0-9_.-]+$")
"""An IPv6 zone (fe80::1%eth0): an interface's name or number."""
_HEX = re.compile(r"^[0-9a-fA-F]+$")


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: tuple[str, ...]
    """In the file's order: node i is hosts[i], hosts[0] holds the rendezvous."""
    slots: int
    """Workers per host (the same on every host)."""


def check_host(host: str) -> str | None:
    """None for a host ssh may be given: ``[USER@]NAME``, NAME a hostname (RFC 1123 labels: ``node01``,
    ``gpu-3.cluster.local``) or an IPv4 / IPv6 address; else what is wrong with it. Nothing that starts with
    ``-`` (ssh would read it as an option: ``-oProxyCommand=...`` runs a command) and nothing a shell reads."""
    if host.startswith("-"):
        return "starts with '-' (ssh would take it for an option)"
    user, at, name = host.rpartition("@")
    if at and not _USER.match(user):
        return f"has the user name {user!r} (letters, digits, '_', '.', '-'; not first '-')"
    address, percent, scope = name.partition("%")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        if percent and (":" not in address or not _SCOPE.match(scope)):
            return f"has the zone {scope!r} (an IPv6 address's interface: letters, digits, '_', '.', '-')"
        return None
    if percent or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        return "is neither a hostname (letters, digits and inner '-' between dots) nor an IP address"
    return None


def host_address(host: str) -> str:
    """The address part of a hostfile host (``alice@node01`` -> ``node01``): what the other hosts reach."""
    return host.rpartition("@")[2]


THIS_MACHINE = "this machine"
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _this_machines_names() -> frozenset[str]:
    """The names and addresses this machine answers to: its hostname (short and full) and what that hostname
    resolves to here (``/etc/hosts`` or DNS); loopback addresses are recognised by themselves (machine_of)."""
    names = {socket.gethostname()}
    try:
        full, aliases, addresses = socket.gethostbyname_ex(socket.gethostname())
        names.update([full, *aliases, *addresses])
    except OSError:
        pass
    return frozenset(name.lower() for name in names if name)


def machine_of(host: str, own: frozenset[str] | None = None) -> str:
    """Which machine a hostfile host is, for counting each once: THIS_MACHINE for ``localhost``, a loopback
    address (127.0.0.1, ::1) and this machine's own hostname or addresses; else the host's address, lowercased
    (``alice@node01`` and ``node01`` are one machine). ``own``: this machine's names (default: looked up)."""
    address = host_address(host).lower()
    try:
        if ipaddress.ip_address(address.partition("%")[0]).is_loopback:
            return THIS_MACHINE
    except ValueError:
        pass
    if address.rstrip(".") in _LOCAL_NAMES:
        return THIS_MACHINE
    own = _this_machines_names() if own is None else own
    return THIS_MACHINE if address.rstrip(".") in own else address


def parse_hostfile(text: str, path: str = "hostfile", own: frozenset[str] | None = None) -> Hostfile:
    """``HOST slots=N`` lines -> Hostfile; LaunchError naming the file, the line and the fix.

        >>> parse_hostfile("# two nodes\\nnode01 slots=4\\n\\nnode02 slots=4\\n").hosts
        ('node01', 'node02')
    """
    hosts: dict[str, tuple[int, int]] = {}
    machines: dict[str, tuple[str, int]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            raise LaunchError(f"{path}:{number}: {raw.strip()!r} is not 'HOST slots=N' (e.g. 'node01 slots=4')")
        host, slots = match.group(1), int(match.group(2))
        wrong = check_host(host)
        if wrong:
            raise LaunchError(f"{path}:{number}: host {host!r} {wrong}; write a hostname or an IP address, "
                              "optionally USER@ before it (e.g. 'node01 slots=4', 'alice@10.0.0.2 slots=4')")
        if slots < 1:
            raise LaunchError(f"{path}:{number}: {host} has slots={slots}; every host needs slots=1 or more")
        if host in hosts:
            raise LaunchError(f"{path}:{number}: {host} is listed twice (first on line {hosts[host][0]}); list each "
                              "host once, with its workers as slots=N")
        # Refused, not merged: two lines for one machine would start two launchers there, each one node of the
        # job, and torch's rendezvous ranks nodes by address, so the second line's launcher could hold rank 0;
        # merged, its slots would add up against "the same slots on every host". Either way the file is not what
        # the user meant: one line saying which lines name the same machine, and the fix.
        machine = machine_of(host, own)
        if machine in machines:
            other, line_number = machines[machine]
            what = "this machine (the one you launch from)" if machine == THIS_MACHINE else f"the machine {machine}"
            raise LaunchError(f"{path}:{number}: {host} is listed twice: it is {what}, as {other} on line "
                              f"{line_number} is; list each machine once, with its workers as slots=N")
        machines[machine] = (host, number)
        hosts[host] = (number, slots)
    if not hosts:
        raise LaunchError(f"{path} lists no host; write one 'HOST slots=N' per line")
    counts = {slots for _, slots in hosts.values()}
    if len(counts) > 1:
        listed = ", ".join(f"{host} slots={slots}" for host, (_, slots) in hosts.items())
        raise LaunchError(f"{path}: hosts have different slots ({listed}); ringtrain runs the same number of workers "
                          "on every host: give every host the same slots=N")
    return Hostfile(path, tuple(hosts), counts.pop())


def read_hostfile(path: str) -> Hostfile:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as err:
        raise LaunchError(f"--hostfile {path}: {err.strerror}; pass a file of 'HOST slots=N' lines") from None
    return parse_hostfile(text, path)


def default_rdzv_port(pid: int) -> int:
    return SLURM_BASE_PORT + pid % SLURM_PORT_SPAN


def hostfile_flags(hostfile: Hostfile, given: LaunchFlags, local_addr: str | None, rdzv_port: int | None,
                   pid: int) -> FilledFlags:
    """The launch flags the hostfile gives (node 0's view: this process checks the job as node 0 would).
    Flags the hostfile decides are refused in one line; ``--nproc`` only when it differs from the slots."""
    for flag, value in (("--nnodes", given.nnodes), ("--node-rank", given.node_rank),
                        ("--rdzv-endpoint", given.rdzv_endpoint), ("--local-addr", local_addr)):
        if value is not None:
            raise LaunchError(f"{flag} with --hostfile: the hostfile decides it (nodes = its hosts, node 0 = its first "
                              f"host, the rendezvous there at --rdzv-port); drop {flag}")
    if given.nproc is not None and given.nproc != hostfile.slots:
        raise LaunchError(f"--nproc {given.nproc} but {hostfile.path} gives every host slots={hostfile.slots}: drop "
                          "--nproc, or change the slots")
    port = default_rdzv_port(pid) if rdzv_port is None else rdzv_port
    if not 0 < port < 65536:
        raise LaunchError(f"--rdzv-port {port} is not a port (1-65535)")
    address = host_address(hostfile.hosts[0])
    first = f"[{address}]" if ":" in address else address
    flags = LaunchFlags(nproc=hostfile.slots, nnodes=str(len(hostfile.hosts)), node_rank=0,
                        rdzv_endpoint=f"{first}:{port}")
    workers = f"{hostfile.slots} worker{'s' * (hostfile.slots != 1)}"
    count = len(hostfile.hosts)
    line = (f"ringtrain: hostfile {hostfile.path}: {count} host{'s' * (count != 1)} ({', '.join(hostfile.hosts)}), "
            f"{workers} per host, rendezvous {flags.rdzv_endpoint}")
    return FilledFlags(flags, line)


# --- the command line ------------------------------------------------------------------------------------
_OWN = ("hostfile", "rdzv_port", "ssh_port", "ssh_options", "remote_python", "remote_cwd")
"""This module's flags: they stay here, never sent to a host."""
_DECIDED = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "local_addr")
"""Launch flags the hostfile decides: node_argv writes them per host."""


def add_hostfile_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hosts over ssh (--hostfile)")
    group.add_argument("--hostfile", metavar="FILE", help="start one launcher per host over ssh: lines 'HOST slots=N' "
                       "(N workers per host, the same on every host); node 0 is the first host")
    group.add_argument("--rdzv-port", type=int, help="with --hostfile: the rendezvous port on the first host "
                       "(default 15000 + this launcher's pid %% 20000)")
    group.add_argument("--ssh-port", type=int, help="with --hostfile: ssh's port on the hosts (default: ssh's own)")
    group.add_argument("--ssh-option", dest="ssh_options", action="append", default=[], metavar="OPTION=VALUE",
                       help="with --hostfile: an ssh -o option, e.g. --ssh-option IdentityFile=~/.ssh/job (repeatable)")
    group.add_argument("--remote-python", help="with --hostfile: the Python on the hosts (default: this one, "
                       f"{sys.executable})")
    group.add_argument("--remote-cwd", help="with --hostfile: the folder the hosts run in (default: this one)")


def check_hostfile_arguments(args: argparse.Namespace) -> None:
    """The ssh flags only mean something with --hostfile."""
    if getattr(args, "hostfile", None):
        return
    for name in _OWN[1:]:
        if getattr(args, name, None):
            flag = "--" + ("ssh-option" if name == "ssh_options" else name.replace("_", "-"))
            raise LaunchError(f"{flag} is for --hostfile jobs; add --hostfile FILE or drop {flag}")


def node_argv(args: argparse.Namespace, hostfile: Hostfile, node_rank: int, rdzv_endpoint: str) -> list[str]:
    """``ringtrain train|run ...`` as host ``node_rank`` runs it: the user's flags as parsed (cli.py's
    ``train`` / ``run`` arguments), the hostfile's flags for this host, never this module's own."""
    positional = args.config if args.command == "train" else args.script
    argv = [args.command, positional]
    for override in args.overrides:
        argv += ["--set", override]
    for name, flag in (("run_dir", "--run-dir"), ("resume_from", "--resume-from"), ("min_nproc", "--min-nproc"),
                       ("rdzv_conf", "--rdzv-conf")):
        if getattr(args, name, None):
            argv += [flag, str(getattr(args, name))]
    if args.max_restarts:
        argv += ["--max-restarts", str(args.max_restarts)]
    argv += ["--resume"] * bool(args.resume) + ["--heal"] * bool(args.heal)
    argv += ["--nproc", str(hostfile.slots), "--nnodes", str(len(hostfile.hosts)), "--node-rank", str(node_rank),
             "--rdzv-endpoint", rdzv_endpoint, "--local-addr", host_address(hostfile.hosts[node_rank])]
    if args.command == "run" and args.script_args:
        argv += ["--", *args.script_args]
    return argv


FORWARDED = {"command", "config", "script", "overrides", "run_dir", "resume", "resume_from", "min_nproc", "rdzv_conf",
             "max_restarts", "heal", "script_args", "handler", *_OWN, *_DECIDED}
"""Every argument of ``train`` and ``run`` that node_argv handles (a test checks the parsers against it)."""


def remote_command(argv: Sequence[str], python: str, cwd: str, env: Mapping[str, str]) -> str:
    """The shell line a host runs: ``cd CWD && exec [env VAR=VALUE ...] PYTHON -m ringtrain.hostfile ARGV``."""
    assignments = [f"{name}={value}" for name, value in sorted(env.items())]
    words = [*(["env", *assignments] if assignments else []), python, "-m", "ringtrain.hostfile", *argv]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def ssh_command(host: str, command: str, port: int | None = None, options: Sequence[str] = ()) -> list[str]:
    """ssh's argv. The user's -o options come first: ssh keeps the first value it is given for an option.
    ConnectTimeout: a host that does not answer at all fails in 15 s, not after the system's TCP timeout.
    ``--`` before the host: whatever the host is, ssh never reads it as an option (parse_hostfile refuses
    such hosts too; this is the second lock)."""
    argv = ["ssh", "-T"]
    for option in options:
        argv += ["-o", option]
    argv += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=15"]
    if port is not None:
        argv += ["-p", str(port)]
    return [*argv, "--", host, command]


def first_line(environ: Mapping[str, str] | None = None) -> bytes:
    """What the launching machine writes first on each host's ssh stdin: ``secret HEX`` when its environment
    has the job's secret (SECRET_VAR), else ``nosecret``. Through stdin, not the command: a command line is
    seen by every user of both machines (ps, /proc), and ssh may log it."""
    secret = (os.environ if environ is None else environ).get(SECRET_VAR)
    if not secret:
        return b"nosecret\n"
    if not _HEX.match(secret):
        raise LaunchError(f"{SECRET_VAR} is not a hex string; unset it (the launcher makes one) or set it to hex "
                          "digits, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return f"secret {secret}\n".encode()


def ssh_hint(last_line: str, host: str) -> str:
    """The fix for ssh's own failure (exit 255), from its last line. ssh runs with BatchMode=yes: it never asks
    (a password, a new host key), so what it would have asked must be set up first (docs/many-hosts.md)."""
    text = last_line.lower()
    if "host key verification failed" in text or "remote host identification has changed" in text:
        fix = (f"{host}'s host key is not in ~/.ssh/known_hosts: run `ssh {host} true` once and accept it (or "
               "ssh-keyscan it into known_hosts), or pass --ssh-option StrictHostKeyChecking=accept-new")
    elif "permission denied" in text:
        fix = (f"no key of yours is accepted there and passwords cannot be asked: `ssh-copy-id {host}` (or "
               "--ssh-option IdentityFile=KEY)")
    elif "could not resolve" in text or "name or service not known" in text:
        fix = f"{host} is not a name this machine resolves: write its address or fix the name"
    elif "connection refused" in text or "timed out" in text or "no route" in text:
        fix = f"no ssh server answers on {host}: check that sshd runs there (and --ssh-port)"
    else:
        fix = "set up key login without prompts"
    return f"{fix}; check with `ssh -o BatchMode=yes {host} true` first"


# --- this machine: one ssh per host ----------------------------------------------------------------------
class _Host:
    """One host's ssh client: its output relayed with the host's name, its last line kept for the report."""

    def __init__(self, host: str, argv: list[str], first: bytes):
        self.host, self.last_line = host, ""
        # Its own session: a terminal's Ctrl-C goes to the launcher, which stops the host through stdin.
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
        try:  # a few bytes into an empty pipe: never blocks; ssh hands them to serve_node once connected
            self.process.stdin.write(first)
            self.process.stdin.flush()
        except OSError:
            pass  # ssh already gone: its exit code and last line say why
        self.relays = [threading.Thread(target=self._relay, args=(self.process.stdout, sys.stdout), daemon=True),
                       threading.Thread(target=self._relay, args=(self.process.stderr, sys.stderr), daemon=True)]
        for relay in self.relays:
            relay.start()

    def _relay(self, stream, sink) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            if sink is sys.stderr and line.strip():
                self.last_line = line.strip()
            print(f"[{self.host}] {line}", file=sink, flush=True)

    def stop(self) -> None:
        """EOF on the ssh channel: the remote wrapper SIGTERMs its launcher; the connection stays for the rest."""
        try:
            self.process.stdin.close()
        except OSError:
            pass


def launch_hosts(hostfile: Hostfile, argvs: Sequence[list[str]], python: str, cwd: str, env: Mapping[str, str],
                 ssh_port: int | None = None, ssh_options: Sequence[str] = ()) -> int:
    """Run ``argvs[i]`` on ``hostfile.hosts[i]`` over ssh; wait for all. 0, or the first failure's exit code
    (one line naming the host; the other hosts are stopped), or 128 + the signal that stopped this process.
    Each ssh's stdin gets ``first_line()`` (the job's secret, if this process has one), then stays open until
    the host is to stop."""
    env = {name: value for name, value in env.items() if not name.startswith(SECRET_VAR)}  # never in a command
    if shutil.which("ssh") is None:
        raise LaunchError("--hostfile starts each host's launcher with ssh, which is not installed here: install "
                          "the OpenSSH client (Debian: apt-get install openssh-client)")
    first = first_line()
    hosts: list[_Host] = []
    stopped_by: list[int] = []

    def on_signal(signum, frame):
        if stopped_by:  # the second Ctrl-C: do not wait for the hosts to save
            for host in hosts:
                host.process.kill()
        stopped_by.append(signum)
        for host in hosts:
            host.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed: _Host | None = None
    try:
        for host, argv in zip(hostfile.hosts, argvs):
            command = remote_command(argv, python, cwd, env)
            hosts.append(_Host(host, ssh_command(host, command, ssh_port, ssh_options), first))
            if stopped_by:
                hosts[-1].stop()
        running = list(hosts)
        while running:
            for host in list(running):
                code = host.process.poll()
                if code is None:
                    continue
                running.remove(host)
                for relay in host.relays:
                    relay.join(timeout=5)
                if code != 0 and failed is None and not stopped_by:
                    failed = host
                    for other in running:
                        other.stop()  # the job cannot go on without this host
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for host in hosts:
            if host.process.poll() is None:
                host.process.kill()
    if failed is not None:
        code = failed.process.returncode
        why = (f"ssh failed: {failed.last_line.rstrip('.')}; {ssh_hint(failed.last_line, failed.host)}"
               if code == SSH_EXIT else f"its launcher exited {code}")
        print(f"ringtrain: error: host {failed.host} (node {hosts.index(failed)}): {why}; the other hosts were stopped",
              file=sys.stderr, flush=True)
        return code if code > 0 else 1
    if stopped_by:
        return 128 + stopped_by[0]
    return 0


# --- the host's end: python -m ringtrain.hostfile ARGS ----------------------------------------------------
def read_first_line(stdin_fd: int, timeout_s: float = FIRST_LINE_TIMEOUT_S) -> dict[str, str]:
    """The launching machine's first line on ``stdin_fd`` (first_line()), read byte by byte so that nothing
    after it is taken: the variables it gives the launcher (``{SECRET_VAR: HEX}``, or none). LaunchError when
    the line is missing, late or not one of the two forms (a launching machine of another ringtrain version)."""
    line = b""
    deadline = time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([stdin_fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(stdin_fd, 1) if ready else None
        if not byte or len(line) > 4096:
            why = ("no first line in {:g} s".format(timeout_s) if byte is None else
                   "stdin closed before the first line" if not byte else "a first line over 4096 bytes")
            raise LaunchError(f"ringtrain.hostfile: {why}: this is the host's end of `ringtrain ... --hostfile`, "
                              "started over ssh by the same ringtrain version on the launching machine")
        line += byte
    text = line.decode("ascii", errors="replace").rstrip("\n")
    if text == "nosecret":
        return {}
    word, _, secret = text.partition(" ")
    if word != "secret" or not _HEX.match(secret):
        raise LaunchError("ringtrain.hostfile: the first line on stdin is neither 'secret HEX' nor 'nosecret': "
                          "start hosts with the same ringtrain version as the launching machine")
    return {SECRET_VAR: secret}


def serve_node(argv: Sequence[str], stdin_fd: int = 0, program: Sequence[str] | None = None) -> int:
    """Run ``python -m ringtrain ARGV`` (``program``: another command, for tests) until it ends, or until
    ``stdin_fd`` reaches its end (the ssh channel closed: the launching machine stopped the job, or its
    connection is gone); then SIGTERM, and SIGKILL after STOP_GRACE_S. Signals this wrapper gets are passed on.
    The first line on stdin is the launching machine's (read_first_line): the job's secret goes into the
    launcher's environment, never its argv. Returns the launcher's exit code (2 with one line when the first
    line is wrong: nothing is started)."""
    try:
        secret = read_first_line(stdin_fd)
    except LaunchError as err:
        print(f"ringtrain: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    command = [sys.executable, "-m", "ringtrain"] if program is None else list(program)
    child = subprocess.Popen([*command, *argv], stdin=subprocess.DEVNULL, env={**os.environ, **secret})

    def stop() -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()

    def watch_stdin() -> None:
        try:
            while os.read(stdin_fd, 4096):
                pass
        except OSError:
            pass
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.poll() is None and child.send_signal(signum))
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(serve_node(sys.argv[1:]))
