"""Open MPI's all-reduce, for ``ringtrain bench collectives --algorithms ...,openmpi``: measured in the same run
as ringtrain's, taking turns with it block by block.

Open MPI's ranks are started by ``mpirun`` (``-np N --bind-to core``: rank r on core r mod cores, as the bench
pins ringtrain's workers; oversubscribed past the cores, as they are) and call ``MPI_Allreduce`` in place
through ``mpi4py`` on numpy buffers: Open MPI's own choice of algorithm and of segment size per message size
(its ``coll/tuned`` decisions) over its shared-memory transport (``btl/vader``). Neither side may poll while
the other is timed, so both wait for their turn asleep in a socket read: this process (the bench's parent)
is the referee. When every ringtrain worker has asked for Open MPI's turn (``Turns.block``), the referee
sends every MPI rank the block to run (one untimed call, then ``calls`` back to back, as ringtrain's blocks),
collects their times and answers the ringtrain workers with the slowest rank's time per call, so a row of
``openmpi`` is measured exactly as a row of ``shm`` is, interleaved with it.

Optional: Debian's ``openmpi-bin`` and ``libopenmpi-dev`` (``make install`` adds them where it runs as root
with apt) and ``pip install -e '.[mpi]'`` (mpi4py, built against that Open MPI); without them the bench says
so in one line (``INSTALL_HINT``).

    >>> referee = Referee.start(world_size)          # in the parent: mpirun starts the MPI ranks
    >>> turns = Turns.connect(port, rank)            # in every ringtrain worker
    >>> turns.block(nbytes, "float32", calls=5)      # Open MPI's time per call, max over its ranks
    >>> referee.stop()
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from ringtrain.errors import RingtrainError

__all__ = ["Referee", "Turns", "check", "DTYPES", "INSTALL_HINT", "mpirun_command"]

DTYPES = ("float32", "float64", "int32", "int64")
"""What MPI sums natively (MPI_FLOAT, MPI_DOUBLE, MPI_INT, MPI_LONG); it has no bfloat16."""
INSTALL_HINT = ("apt-get install openmpi-bin libopenmpi-dev, then pip install 'mpi4py==4.1.2' "
                "(or: pip install -e '.[mpi]')")
_LOOPBACK = "127.0.0.1"
_START_S = 120.0
"""How long the MPI ranks may take to start and report in."""


def check() -> None:
    """Raise RingtrainError with the fix if this machine cannot run Open MPI's side of the bench."""
    missing = [tool for tool in ("mpirun",) if shutil.which(tool) is None]
    try:
        importlib.import_module("mpi4py")
    except ImportError:
        missing.append("mpi4py")
    if missing:
        raise RingtrainError(f"--algorithms openmpi needs Open MPI and mpi4py ({' and '.join(missing)} not found): "
                             f"{INSTALL_HINT}")


def mpirun_command(world_size: int, port: int) -> list[str]:
    """mpirun for ``world_size`` MPI ranks that report to the referee at ``port``, pinned as the bench pins."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    over = world_size > cores
    command = ["mpirun", "-np", str(world_size), "--map-by", "core",
               "--bind-to", "core:overload-allowed" if over else "core",
               # One host: the shared-memory transport (and self); no probing of network interfaces.
               "--mca", "btl", "self,vader"]
    if over:
        command.append("--oversubscribe")
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command + [sys.executable, "-m", "ringtrain.bench.openmpi", _LOOPBACK, str(port)]


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


class _Lines:
    """JSON messages, one a line, from a socket (a blocking read: the reader sleeps until one comes)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def read(self) -> dict:
        while b"\n" not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the peer closed the connection")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


class Referee:
    """The parent's side: starts the MPI ranks and hands the turn between them and the ringtrain workers."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.listener = socket.create_server((_LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.process = subprocess.Popen(mpirun_command(world_size, self.port), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.error: str | None = None
        self.peers: dict = {}  # (role, rank) -> (socket, lines)
        self.thread = threading.Thread(target=self._serve, name="openmpi-referee", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, world_size: int) -> Referee:
        return cls(world_size)

    def _accept(self, role: str, count: int, peers: dict, deadline: float) -> None:
        while sum(1 for r, _ in peers if r == role) < count:
            if self.process.poll() is not None:
                raise RingtrainError(f"mpirun exited with code {self.process.returncode}: {self._output()}")
            self.listener.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RingtrainError(f"Open MPI's ranks did not report in within {_START_S:.0f} s") from None
                continue
            sock.settimeout(None)
            lines = _Lines(sock)
            hello = lines.read()
            peers[(hello["role"], int(hello["rank"]))] = (sock, lines)

    def _serve(self) -> None:
        peers = self.peers
        try:
            deadline = time.monotonic() + _START_S
            self._accept("mpi", self.world_size, peers, deadline)
            self._accept("ringtrain", self.world_size, peers, deadline)
            ours = [peers[("ringtrain", r)] for r in range(self.world_size)]
            theirs = [peers[("mpi", r)] for r in range(self.world_size)]
            while True:
                requests = [lines.read() for _, lines in ours]  # every worker asks: all of them now wait
                if any(request != requests[0] for request in requests):
                    raise RingtrainError(f"ringtrain's workers asked for different turns: {requests}")
                if requests[0].get("stop"):
                    break
                for sock, _ in theirs:
                    _send(sock, requests[0])
                replies = [lines.read() for _, lines in theirs]
                failed = next((r["error"] for r in replies if "error" in r), None)
                answer = {"error": failed} if failed else {"per_call_s": max(r["per_call_s"] for r in replies)}
                for sock, _ in ours:
                    _send(sock, answer)
        except (RingtrainError, ConnectionError, OSError, ValueError) as err:
            self.error = self.error or str(err)
        finally:
            self.listener.close()  # a worker still to connect is refused, one waiting in the backlog reset
            for sock, _ in peers.values():
                try:
                    _send(sock, {"stop": True})
                except OSError:
                    pass
                sock.close()

    def _output(self) -> str:
        text = self.process.stdout.read() if self.process.stdout else ""
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """End the turns and mpirun: at once when the workers said stop; else (a worker failed) by closing
        every connection, so that nobody waits for a turn that will not come."""
        self.thread.join(timeout=5)
        if self.thread.is_alive():
            self.error = self.error or "stopped: ringtrain's workers ended first"
            self.listener.close()
            for sock, _ in list(self.peers.values()):
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's blocked read (close alone does not)
                except OSError:
                    pass
            self.thread.join(timeout=5)
        try:
            self.process.wait(timeout=10)  # its ranks exit when the referee says stop or goes
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.listener.close()


class Turns:
    """A ringtrain worker's side: ask for Open MPI's block, asleep until it is done."""

    def __init__(self, sock: socket.socket, rank: int):
        self.sock, self.lines = sock, _Lines(sock)
        _send(sock, {"role": "ringtrain", "rank": rank})

    @classmethod
    def connect(cls, port: int, rank: int) -> Turns:
        return cls(socket.create_connection((_LOOPBACK, port), timeout=_START_S), rank)

    def block(self, nbytes: int, dtype: str, calls: int, op: str = "all_reduce") -> float:
        """Open MPI's ``op`` (all-reduce unless said) of ``nbytes``: one untimed call, then ``calls`` timed; the
        time per call of the slowest MPI rank (0 calls: warm-up only)."""
        _send(self.sock, {"bytes": nbytes, "dtype": dtype, "calls": calls, "op": op})
        self.sock.settimeout(None)
        try:
            answer = self.lines.read()
        except ConnectionError:
            raise RingtrainError("Open MPI's side of the bench stopped (see the lines above)") from None
        if "error" in answer or "stop" in answer:
            raise RingtrainError(f"Open MPI's {op} failed: {answer.get('error', 'the referee stopped')}")
        return float(answer["per_call_s"])

    def close(self) -> None:
        try:
            _send(self.sock, {"stop": True})
        except OSError:
            pass
        self.sock.close()


def _mpi_rank(host: str, port: int) -> None:
    """One MPI rank: run the blocks the referee sends, each on a buffer of the asked size (checked once)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sock = socket.create_connection((host, port), timeout=_START_S)
    sock.settimeout(None)
    lines = _Lines(sock)
    _send(sock, {"role": "mpi", "rank": rank})
    buffers: dict = {}
    while True:
        try:
            request = lines.read()
        except ConnectionError:
            break
        if request.get("stop"):
            break
        key = (request.get("op", "all_reduce"), request["bytes"], request["dtype"])
        try:
            if key not in buffers:
                call = _mpi_call(comm, MPI, np, *key)
                buffers = {key: call}  # one size at a time: memory stays that of one buffer
            call = buffers[key]
            call()
            start = time.perf_counter()
            for _ in range(request["calls"]):
                call()
            reply = {"per_call_s": (time.perf_counter() - start) / max(1, request["calls"])}
        except Exception as err:  # noqa: BLE001 - the referee reports it to the ringtrain workers
            reply = {"error": f"{type(err).__name__}: {err}"}
        _send(sock, reply)
    sock.close()


def _mpi_call(comm, MPI, np, op: str, nbytes: int, dtype_name: str):
    """Open MPI's ``op`` on buffers of ``nbytes`` (the bench's sizes: the whole buffer), checked once; the call.

    Every rank's input holds rank + 1, so the right answer is known; then the buffers are zeroed (every later
    call moves zeros: the same work)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(dtype_name)
    numel = max(1, nbytes // dtype.itemsize)
    share = numel // size
    if op == "all_reduce":
        inp = out = np.full(numel, rank + 1, dtype=dtype)
        call = lambda: comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)  # noqa: E731
        expected = np.full(numel, size * (size + 1) // 2)
    elif op == "all_gather":
        inp, out = np.full(share, rank + 1, dtype=dtype), np.zeros(share * size, dtype=dtype)
        call = lambda: comm.Allgather(inp, out)  # noqa: E731
        expected = np.repeat(np.arange(1, size + 1), share)
    elif op == "reduce_scatter":
        inp, out = np.full(share * size, rank + 1, dtype=dtype), np.zeros(share, dtype=dtype)
        call = lambda: comm.Reduce_scatter_block(inp, out, op=MPI.SUM)  # noqa: E731
        expected = np.full(share, size * (size + 1) // 2)
    elif op == "all_to_all":
        inp, out = np.full(share * size, rank + 1, dtype=dtype), np.zeros(share * size, dtype=dtype)
        call = lambda: comm.Alltoall(inp, out)  # noqa: E731
        expected = np.repeat(np.arange(1, size + 1), share)
    elif op == "broadcast":
        inp = out = np.full(numel, rank + 1, dtype=dtype)
        call = lambda: comm.Bcast(out, root=0)  # noqa: E731
        expected = np.ones(numel)
    elif op == "sendrecv":
        inp, out = np.full(numel, rank + 1, dtype=dtype), np.zeros(numel, dtype=dtype)
        after, before = (rank + 1) % size, (rank - 1) % size
        call = lambda: comm.Sendrecv(inp, dest=after, recvbuf=out, source=before)  # noqa: E731
        expected = np.full(numel, before + 1)
    else:
        raise ValueError(f"unknown op {op!r}")
    call()  # a fast wrong answer is not fast: check
    if not bool((out == expected).all()):
        raise RuntimeError(f"Open MPI's {op} of {out.size} elements gave {out[:4].tolist()}, not {expected[:4].tolist()}")
    inp[:] = 0
    out[:] = 0
    return call


if __name__ == "__main__":
    _mpi_rank(sys.argv[1], int(sys.argv[2]))
