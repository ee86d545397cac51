"""All-reduce bandwidth sweep in the style of nccl-tests: torch (Gloo), ringtrain and DeepSpeed side by side.

    ringtrain bench collectives --nproc 2,4 --algorithms torch,ring,ring_chunked,shm --sizes 4K:64M --out DIR
    ringtrain bench collectives --nproc 2,4 --algorithms torch,shm,shm_inplace,deepspeed_shm --out DIR
    ringtrain bench collectives --nproc 2,4 --algorithms shm,openmpi --sizes 4K,64K,1M,16M,64M --out DIR
    ringtrain bench collectives --nproc 2,4 --algorithms torch,shm,openmpi --out DIR \
        --ops all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,sendrecv

For every world size, N worker processes are started (pinned one per core, round robin, as ``ringtrain
train`` pins them; sockets on loopback) and time ``all_reduce(sum)`` of every size with every algorithm,
all in the same run. Per size: a check of each algorithm's result, warm-up calls, then at least
``--iters`` rounds (more for small sizes, up to ``min_time_s``) in which the algorithms take turns (an
untimed call, then a block of ``BLOCK`` back-to-back timed calls), so that load from other processes falls on
all of them alike. A block's time per call is the maximum over ranks; the row reports the median (p50).

    algbw = bytes / p50          busbw = algbw * 2 (n - 1) / n

busbw is what each rank's links carry for a bandwidth-optimal all-reduce, comparable across world sizes.
``shm_inplace`` is shm on a tensor that already lives in shared memory (``shm.shared_empty``), as the
manual strategy's gradient buckets do. ``deepspeed_shm`` is DeepSpeed's CPU shared-memory all-reduce
(``torch.ops.deepspeed.inference_all_reduce_``, see ``deepspeed_shm.py``), called directly. ``openmpi`` is Open
MPI's ``MPI_Allreduce`` (mpi4py, ranks started by ``mpirun``), which takes its turns between ringtrain's blocks
(``openmpi.py``). Writes ``DIR/collectives.json`` (a list of rows), ``.csv`` and ``.png`` (busbw against size).

``--ops`` times other collectives the same way, each for the algorithms that have it (``options.OP_ALGORITHMS``):
``torch`` is Gloo through ``torch.distributed``, ``shm`` is ringtrain's ``ringtrain_shm`` c10d backend (a group
of that backend made with ``dist.new_group``, called through ``torch.distributed`` as DTensor, FSDP2 and the
pipeline schedules call it) and ``openmpi`` is Open MPI's matching call (``MPI_Allgather``,
``MPI_Reduce_scatter_block``, ``MPI_Alltoall``, ``MPI_Bcast``, ``MPI_Sendrecv``). ``bytes`` is always the whole
buffer, nccl-tests' convention: all_gather's output, reduce_scatter's input, all_to_all's input (each rank's),
broadcast's tensor and the message each rank sends in sendrecv (to rank + 1, receiving from rank - 1, at once).
busbw's factor is the op's: 2 (n - 1) / n for all_reduce, (n - 1) / n for all_gather, reduce_scatter and
all_to_all, 1 for broadcast and sendrecv. Every row names its ``op``; ``collectives.png`` plots all_reduce and
``collectives_OP.png`` each other op.

Across hosts (``--nnodes H --node-rank R --rdzv-endpoint ADDR:PORT --local-addr ADDR``, the flags of
``ringtrain train``), each host runs the command with ``--nproc`` workers; node 0 hosts the store, prints
and writes. There ``shm`` is the hierarchical all-reduce (shm inside each host, a ring between the host
leaders) and its rows say ``hierarchical``. ``bench/hosts_collectives.py`` runs it on test hosts (network
namespaces, links capped with tc tbf).
"""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.bench import openmpi
from ringtrain.bench.options import OP_ALGORITHMS, BenchOptions
from ringtrain.bench.plot import plot_busbw
from ringtrain.comm import shm
from ringtrain.comm.shm_group import get_shm_group
from ringtrain.config import DistConfig
from ringtrain.group.addresses import RENDEZVOUS_WAIT_S, bind_address
from ringtrain.group.auth import load_job_secret
from ringtrain.group.env import DistEnv
from ringtrain.group.init import init_distributed
from ringtrain.errors import RingtrainError
from ringtrain.launch import LaunchOptions, job_secret_for, split_endpoint

__all__ = ["run_collectives_bench", "bus_bandwidth_factor", "op_bus_factor"]

_MAX_ITERS = 2000
BLOCK = 5
"""Timed calls per turn, back to back: a collective called in a loop overlaps one call's exit with the next
call's entry, which one call alone, timed between two others, does not show."""
REMOTE_TURN_S = 0.005
"""With Open MPI among the algorithms, each turn runs this long at least (up to ``_MAX_TURN_CALLS`` calls)."""
_MAX_TURN_CALLS = 200
_LOOPBACK = "127.0.0.1"
_REFERENCES = ("torch", "deepspeed_shm", "openmpi")


def bus_bandwidth_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: the share of the data each rank must send, 2 (n - 1) / n."""
    return 2 * (world_size - 1) / world_size if world_size > 1 else 1.0


def op_bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` (nccl-tests' factors): the share of the buffer each rank's links carry."""
    if op == "all_reduce":
        return bus_bandwidth_factor(world_size)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world_size - 1) / world_size if world_size > 1 else 1.0
    return 1.0


def run_collectives_bench(options: BenchOptions, echo: Callable[[str], None] = print) -> list[dict]:
    """Run the sweep for every world size, print the table as it goes, write the files; return the rows."""
    options.validate()
    options.out.mkdir(parents=True, exist_ok=True)
    # The references first: torch (Gloo), DeepSpeed and Open MPI, so every other row can give its ratio to them.
    order = sorted(options.algorithms, key=lambda a: (a not in _REFERENCES, _REFERENCES.index(a) if a in _REFERENCES else 0))
    options = BenchOptions(**{**asdict(options), "algorithms": tuple(order)})
    if "deepspeed_shm" in options.algorithms:
        from ringtrain.bench import deepspeed_shm

        deepspeed_shm.build()  # once, here: workers find it cached; a missing DeepSpeed is one line
    if "openmpi" in options.algorithms:
        openmpi.check()  # a missing Open MPI or mpi4py is one line
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    world_sizes = options.nprocs if options.nnodes == 1 else (options.nnodes * options.nprocs[0],)
    if options.node_rank > 0:  # node 0 reports; this host only runs its workers
        for world_size in world_sizes:
            for _ in _run_world(world_size, options):
                pass
        echo(f"# node {options.node_rank}: done")
        return []
    links = "loopback" if options.nnodes == 1 else f"{options.nnodes} hosts x {options.nprocs[0]} workers"
    what = "all_reduce(sum)" if options.ops == ("all_reduce",) else ", ".join(options.ops)
    echo(f"# ringtrain bench collectives: {what} of {options.dtype}, Gloo over {links} + ringtrain, "
         f"p50 per call of blocks of {BLOCK}, max over ranks; {os.cpu_count()} cores, load average {load}")
    rows: list[dict] = []
    for world_size in world_sizes:
        echo(f"#\n# world_size {world_size}\n# {'op':<15}{'size':>10}  {'algorithm':<13}{'iters':>6}{'p50(us)':>12}"
             f"{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}{'vs torch':>10}{'vs deepspeed':>14}{'vs openmpi':>12}")
        for row in _run_world(world_size, options):
            ratios = []
            for reference_name, key in zip(_REFERENCES, ("vs_torch", "vs_deepspeed", "vs_openmpi")):
                reference = next((r for r in rows if r["algorithm"] == reference_name and r["bytes"] == row["bytes"]
                                  and r["world_size"] == world_size and r["op"] == row["op"]), None)
                # Speed relative to the reference (same bytes, so the ratio of the times): above 1 is faster. From
                # the times, not the rounded bandwidths (a call slowed to 2.8 ms on a loaded machine had 0.0015 GB/s,
                # rounded to 0.002), and to three significant figures.
                row[key] = float(f"{reference['p50_s'] / row['p50_s']:.3g}") if reference else None
                ratios.append(f"{row[key]:.2f}" if row[key] is not None else "-")
            rows.append(row)
            echo(f"  {row['op']:<15}{_format_size(row['bytes']):>10}  {row['algorithm']:<13}{row['iters']:>6}{row['p50_s'] * 1e6:>12.1f}"
                 f"{row['algbw_gbps']:>13.3f}{row['busbw_gbps']:>13.3f}{ratios[0]:>10}{ratios[1]:>14}{ratios[2]:>12}")
    _write(rows, options.out)
    echo(f"# wrote {options.out / 'collectives.json'}, .csv and .png")
    return rows


def _run_world(world_size: int, options: BenchOptions):
    """Start this host's workers of one world size; yield rank 0's rows as they are measured."""
    context = mp.get_context("spawn")
    if options.nnodes > 1:
        host, port = split_endpoint(options.rdzv_endpoint)
        bind = bind_address(options.local_addr, host, port, options.node_rank == 0, RENDEZVOUS_WAIT_S)
    else:
        host, port, bind = _LOOPBACK, 0, _LOOPBACK
    # The workers' store is sealed with the job's secret, as a training job's is (group/auth.py): made here on one
    # host (the spawned workers inherit it through the environment), the user's on several.
    job_secret_for(LaunchOptions(nnodes=str(options.nnodes), rdzv_endpoint=options.rdzv_endpoint))
    store = None
    if options.node_rank == 0:
        # This process hosts the workers' store on a socket bound to one address; workers join as clients.
        listener = socket.create_server((host, port))
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=options.timeout_s), master_listen_fd=listener.detach())
    results = context.Queue()
    local_world_size = world_size // options.nnodes
    first = options.node_rank * local_world_size
    # Open MPI's ranks (one host only: options.validate) start first and wait asleep for their turns.
    referee = openmpi.Referee.start(world_size) if "openmpi" in options.algorithms else None
    placement = (world_size, local_world_size, host, port, bind, referee.port if referee else None)
    workers = [context.Process(target=_worker, args=(first + local, local, placement, options, results), daemon=True)
               for local in range(local_world_size)]
    for worker in workers:
        worker.start()
    try:
        done = 0
        while done < local_world_size:
            try:
                message = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RingtrainError(f"bench worker {workers.index(dead[0])} exited with code {dead[0].exitcode}") from None
                continue
            if message[0] == "row":
                yield message[1]
            elif message[0] == "done":
                done += 1
            else:
                if referee is not None and referee.error:  # the cause, where the worker saw only its effect
                    raise RingtrainError(f"Open MPI's side of the bench failed: {referee.error}")
                raise RingtrainError(f"bench worker {message[1]} failed: {message[2].strip().splitlines()[-1]}")
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
        if referee is not None:
            referee.stop()
        del store


def _worker(rank: int, local_rank: int, placement: tuple, options: BenchOptions, results) -> None:
    world_size, local_world_size, host, port, bind, referee_port = placement
    try:
        env = DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
                      master_addr=host, master_port=port, use_agent_store=True, bind_addr=bind,
                      job_secret=load_job_secret(os.environ))
        config = DistConfig(backend="gloo", timeout_s=options.timeout_s, pin_cpu=True, threads_per_worker=1)
        with init_distributed(env, config):
            turns = openmpi.Turns.connect(referee_port, rank) if referee_port else None
            try:
                for row in _sweep(rank, world_size, port, options, turns):
                    if rank == 0:
                        results.put(("row", row))
            finally:
                if turns is not None:
                    turns.close()
        results.put(("done", rank))
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, traceback.format_exc()))


def _sweep(rank: int, world_size: int, port: int, options: BenchOptions, turns: openmpi.Turns | None = None):
    dtype = getattr(torch, options.dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    largest = max(options.sizes) // itemsize + 1
    # One shared-memory arena for every size: slices at offset 0 are at the same offset on every rank.
    arena = shm.shared_empty(largest, dtype) if "shm_inplace" in options.algorithms else None
    deepspeed_call = None
    if "deepspeed_shm" in options.algorithms and "all_reduce" in options.ops:
        from ringtrain.bench import deepspeed_shm

        deepspeed_call = deepspeed_shm.init(rank, world_size, port)
    groups = {"torch": None}  # the default group: Gloo
    if "shm" in options.algorithms and any(op != "all_reduce" for op in options.ops):
        import ringtrain.comm.c10d_backend as c10d_backend  # registers "ringtrain_shm"

        groups["shm"] = dist.new_group(backend=c10d_backend.BACKEND)  # collective: every rank, in order
    for op in options.ops:
        if op == "sendrecv" and world_size < 2:
            continue  # nobody to send to
        algorithms = [a for a in options.algorithms if op == "all_reduce" or a in OP_ALGORITHMS]
        for nbytes in options.sizes:
            numel = max(1, nbytes // itemsize)
            if op in ("all_gather", "reduce_scatter", "all_to_all"):  # a whole share per rank
                numel = max(world_size, numel // world_size * world_size)
            calls = {}
            for algorithm in algorithms:
                if algorithm == "openmpi":  # Open MPI's ranks check their own first call
                    calls[algorithm] = _Remote(turns, numel * itemsize, options.dtype, op)
                elif op == "all_reduce":
                    tensor = arena[:numel] if algorithm == "shm_inplace" else torch.empty(numel, dtype=dtype)
                    calls[algorithm] = _caller(tensor, algorithm, options.chunk_kb, deepspeed_call)
                    _verify(tensor, calls[algorithm], rank, world_size)
                    tensor.zero_()  # sums of zeros stay zeros: every call does the same work
                else:
                    calls[algorithm] = _op_caller(op, numel, dtype, groups[algorithm], rank, world_size)
            for algorithm, times in _time(calls, options).items():
                p50_s = float(times.median())
                algbw = numel * itemsize / p50_s / 1e9
                yield {
                    "op": op,
                    "algorithm": _label(algorithm),
                    "world_size": world_size,
                    "bytes": numel * itemsize,
                    "p50_s": p50_s,
                    "algbw_gbps": round(algbw, 4),
                    "busbw_gbps": round(algbw * op_bus_factor(op, world_size), 4),
                    "iters": len(times),
                }


def _label(algorithm: str) -> str:
    """shm across hosts is the hierarchical all-reduce: say so (the group has decided by the first call)."""
    if algorithm == "shm" and get_shm_group(dist.group.WORLD).hierarchical:
        return "hierarchical"
    return algorithm


def _caller(tensor: torch.Tensor, algorithm: str, chunk_kb: int | None, deepspeed_call=None) -> Callable[[], None]:
    if algorithm == "torch":
        return lambda: dist.all_reduce(tensor)  # the backend itself, not through ringtrain's checks
    if algorithm == "deepspeed_shm":
        return lambda: deepspeed_call(tensor)  # DeepSpeed's op itself, as deepspeed.comm calls it
    name = "shm" if algorithm == "shm_inplace" else algorithm
    options = {"chunk_kb": chunk_kb} if algorithm == "ring_chunked" and chunk_kb else {}
    return lambda: comm.all_reduce(tensor, algorithm=name, **options)


def _op_caller(op: str, numel: int, dtype: torch.dtype, group, rank: int, world_size: int) -> Callable[[], None]:
    """``op`` on ``group`` (None: the default group, Gloo) through torch.distributed, its result checked once.

    Every rank's input is filled with rank + 1, so each op's right answer is known: the checked call must give
    it on every rank, then the buffers are zeroed (every later call moves zeros: the same work)."""
    share = numel // world_size
    if op == "all_gather":
        inp, out = torch.empty(share, dtype=dtype), torch.empty(numel, dtype=dtype)
        call = lambda: dist.all_gather_single(out, inp, group=group)  # noqa: E731
        expected = torch.arange(1, world_size + 1).repeat_interleave(share)
    elif op == "reduce_scatter":
        inp, out = torch.empty(numel, dtype=dtype), torch.empty(share, dtype=dtype)
        call = lambda: dist.reduce_scatter_single(out, inp, group=group)  # noqa: E731
        expected = torch.full((share,), world_size * (world_size + 1) // 2)
    elif op == "all_to_all":
        inp, out = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        call = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
        expected = torch.arange(1, world_size + 1).repeat_interleave(share)
    elif op == "broadcast":
        inp = out = torch.empty(numel, dtype=dtype)
        call = lambda: dist.broadcast(out, src=0, group=group)  # noqa: E731
        expected = torch.ones(numel)
    elif op == "sendrecv":  # a ring: send to rank + 1 while receiving from rank - 1
        inp, out = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        after, before = (rank + 1) % world_size, (rank - 1) % world_size

        def call() -> None:
            sent = dist.isend(inp, after, group=group)
            dist.recv(out, before, group=group)
            sent.wait()

        expected = torch.full((numel,), before + 1)
    else:
        raise ValueError(f"unknown op {op!r}")
    inp.fill_(rank + 1)
    out.zero_() if out is not inp else None
    call()
    if not torch.equal(out.to(torch.float64), expected.to(torch.float64)):
        raise RuntimeError(f"{op} of {numel} elements on rank {rank} gave {out[:4].tolist()}..., "
                           f"not {expected[:4].tolist()}...")
    inp.zero_()
    out.zero_()
    return call


class _Remote:
    """An algorithm that runs in other processes (Open MPI's ranks): a block is a turn handed to them."""

    def __init__(self, turns: openmpi.Turns, nbytes: int, dtype: str, op: str = "all_reduce"):
        self.turns, self.nbytes, self.dtype, self.op = turns, nbytes, dtype, op

    def block(self, calls: int) -> float:
        """One untimed call, then ``calls`` back to back: the time per call (max over the other side's ranks)."""
        return self.turns.block(self.nbytes, self.dtype, calls, self.op)


def _block(call, calls: int) -> float:
    """A turn of one algorithm: an untimed call, then ``calls`` timed back to back; the time per call."""
    if isinstance(call, _Remote):
        return call.block(calls)
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / max(1, calls)


def _verify(tensor: torch.Tensor, call: Callable[[], None], rank: int, world_size: int) -> None:
    """A fast algorithm that computes the wrong thing is not fast: check one call before timing."""
    tensor.fill_(rank + 1)
    call()
    expected = world_size * (world_size + 1) // 2
    if not bool((tensor == expected).all()):
        raise RuntimeError(f"all_reduce of {tensor.numel()} elements gave {tensor[0].item()}, not {expected}")


def _time(calls: dict[str, Callable[[], None] | _Remote], options: BenchOptions) -> dict[str, torch.Tensor]:
    """Per algorithm, the time of every timed call (max over ranks).

    The algorithms take turns, so that a burst of load from another process on the machine slows all of
    them alike and the ratios stay fair. Each turn is an untimed call, then ``BLOCK`` timed ones back to
    back: ranks leave the previous algorithm at different moments, and the first call of a turn absorbs that
    skew (as in a back-to-back loop of one algorithm). When other processes take turns too (Open MPI's ranks),
    a turn lasts at least ``REMOTE_TURN_S``: every turn then starts with processes woken from a socket read,
    which the scheduler settles over several calls; a loop of all-reduces in a training job does not see that.
    """
    estimates = []
    for call in calls.values():
        _block(call, options.warmup - 1)
        estimates.append(_block(call, BLOCK))  # per call over a block: one call alone may be a slow first one
    estimate = torch.tensor(estimates, dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)  # every rank must run the same number of calls
    blocks = [BLOCK] * len(calls)
    if any(isinstance(call, _Remote) for call in calls.values()):
        blocks = [max(BLOCK, min(_MAX_TURN_CALLS, int(REMOTE_TURN_S / max(float(e), 1e-9)))) for e in estimate]
    round_s = sum((block + 1) * float(e) for block, e in zip(blocks, estimate))
    iters = int(min(_MAX_ITERS, max(options.iters, options.min_time_s / max(round_s, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    dist.barrier()
    for _ in range(iters):
        for (name, call), block in zip(calls.items(), blocks):
            times[name].append(_block(call, block))
    result = {}
    for name, values in times.items():
        per_call = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # a call is as slow as its slowest rank
        result[name] = per_call
    return result


def _write(rows: list[dict], out: Path) -> None:
    (out / "collectives.json").write_text(json.dumps(rows, indent=1) + "\n")
    with (out / "collectives.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for op in dict.fromkeys(row["op"] for row in rows):
        path = out / ("collectives.png" if op == "all_reduce" else f"collectives_{op}.png")
        plot_busbw([row for row in rows if row["op"] == op], path, title=f"{op} bus bandwidth")


def _format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}iB"
    return f"{nbytes} B"
