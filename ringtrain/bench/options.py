"""The flags of ``ringtrain bench collectives``, checked without importing torch (errors come fast)::

    >>> parse_sizes("4K:64M:4")
    (4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ringtrain.errors import ConfigError

__all__ = ["BenchOptions", "BENCH_ALGORITHMS", "BENCH_OPS", "OP_ALGORITHMS", "parse_ops", "parse_sizes",
           "parse_world_sizes"]

BENCH_ALGORITHMS = ("torch", "ring", "ring_chunked", "shm", "shm_inplace", "deepspeed_shm", "openmpi")
"""ringtrain.comm.ALGORITHMS, plus shm on a tensor that lives in shared memory, plus DeepSpeed's CPU shm
all-reduce (``pip install -e '.[bench]'``), plus Open MPI's MPI_Allreduce (Debian's Open MPI and
``pip install -e '.[mpi]'``)."""
BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
"""The collectives ``--ops`` times. all_reduce is every algorithm's; the others are torch.distributed's calls."""
OP_ALGORITHMS = ("torch", "shm", "openmpi")
"""The algorithms that have the ops other than all_reduce: Gloo (``torch``), ringtrain's ``ringtrain_shm`` c10d
backend (``shm``, through torch.distributed on a group of that backend) and Open MPI. The others (ring,
ring_chunked, shm_inplace, deepspeed_shm) are all-reduces only: they give rows for all_reduce alone."""
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class BenchOptions:
    """What to measure; the command line's flags."""

    nprocs: tuple[int, ...] = (2,)
    algorithms: tuple[str, ...] = ("torch", "ring", "ring_chunked", "shm")
    ops: tuple[str, ...] = ("all_reduce",)
    """The collectives timed (BENCH_OPS); each with every algorithm that has it (OP_ALGORITHMS)."""
    sizes: tuple[int, ...] = field(default_factory=lambda: parse_sizes("4K:64M"))
    out: Path = Path("bench-out")
    iters: int = 20
    """Timed calls per (size, algorithm), at least."""
    warmup: int = 5
    min_time_s: float = 0.5
    """Small sizes get more rounds of timed calls, up to about this much time (and 2000 rounds)."""
    dtype: str = "float32"
    chunk_kb: int | None = None
    """ring_chunked's chunk (default: its measured default)."""
    timeout_s: float = 300.0
    nnodes: int = 1
    """Hosts of the measured group; above 1, ``nprocs`` is one count of workers per host and each host runs
    this command with its own ``node_rank`` (as ``ringtrain train --nnodes``)."""
    node_rank: int = 0
    """This host's index; node 0 hosts the store at ``rdzv_endpoint`` and prints and writes the results."""
    rdzv_endpoint: str | None = None
    """HOST:PORT where node 0 hosts the workers' store (needed with nnodes > 1)."""
    local_addr: str | None = None
    """This host's address for the workers' sockets (default: loopback on one host, the endpoint's host on node 0)."""

    def validate(self) -> None:
        if not self.nprocs or min(self.nprocs) < 1:
            raise ConfigError(f"--nproc needs world sizes of at least 1, got {list(self.nprocs)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and (len(self.nprocs) != 1 or not self.rdzv_endpoint):
            raise ConfigError("a benchmark across hosts (--nnodes above 1) needs one --nproc (workers per host) and "
                              "--rdzv-endpoint HOST:PORT, the same on every host, e.g. --nproc 2 --rdzv-endpoint 198.18.0.1:29500")
        unknown = [a for a in self.algorithms if a not in BENCH_ALGORITHMS]
        if unknown:
            raise ConfigError(f"--algorithms: unknown {unknown[0]!r}; choose from {','.join(BENCH_ALGORITHMS)}")
        bad_ops = [op for op in self.ops if op not in BENCH_OPS]
        if bad_ops or not self.ops:
            raise ConfigError(f"--ops: unknown {bad_ops[0] if bad_ops else ''!r}; choose from {','.join(BENCH_OPS)}")
        others = [op for op in self.ops if op != "all_reduce"]
        if others and not any(a in OP_ALGORITHMS for a in self.algorithms):
            raise ConfigError(f"--ops {others[0]} is timed for --algorithms {','.join(OP_ALGORITHMS)}; "
                              f"none of them is in --algorithms {','.join(self.algorithms)}")
        if others and self.nnodes > 1:
            raise ConfigError(f"--ops {others[0]} is measured on one host; across hosts (--nnodes above 1) "
                              "use --ops all_reduce")
        # Across hosts the large sizes take seconds a call, limited by the link (steady): fewer blocks do.
        least = 20 if self.nnodes == 1 else 5
        if self.iters < least:
            raise ConfigError(f"--iters must be at least {least} for a meaningful median, got {self.iters}")
        if self.dtype not in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
            raise ConfigError(f"--dtype {self.dtype!r} is not one of float32, float64, float16, bfloat16, int32, int64")
        if "deepspeed_shm" in self.algorithms and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--algorithms deepspeed_shm reduces float32, bfloat16 and float16 only, not --dtype {self.dtype}")
        if "openmpi" in self.algorithms and self.dtype not in ("float32", "float64", "int32", "int64"):
            raise ConfigError(f"--algorithms openmpi reduces float32, float64, int32 and int64 (MPI has no {self.dtype}), "
                              f"not --dtype {self.dtype}")
        if "openmpi" in self.algorithms and self.nnodes > 1:
            raise ConfigError("--algorithms openmpi measures one host (Open MPI's ranks start here with mpirun); "
                              "drop it with --nnodes above 1")


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K:64M`` (powers of two), ``4K:64M:4`` (every 4x), or a list ``4K,1M,64M``; K/M/G are binary."""
    text = text.strip().upper()
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--sizes {text!r}: write MIN:MAX or MIN:MAX:FACTOR, e.g. 4K:64M")
        low, high = _parse_size(parts[0]), _parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 2
        if len(parts) == 3 and (not parts[2].isdigit() or factor < 2):
            raise ConfigError(f"--sizes {text!r}: the factor must be an integer of at least 2")
        if low > high:
            raise ConfigError(f"--sizes {text!r}: MIN is larger than MAX")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= factor
        return tuple(sizes)
    return tuple(_parse_size(part) for part in text.split(","))


def parse_ops(text: str) -> tuple[str, ...]:
    """``all_reduce,all_gather`` -> ('all_reduce', 'all_gather'); ``all``: every op. A bad name is one line."""
    ops = BENCH_OPS if text.strip() == "all" else tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [op for op in ops if op not in BENCH_OPS]
    if unknown or not ops:
        raise ConfigError(f"--ops {text!r}: unknown {unknown[0] if unknown else 'empty'!r}; "
                          f"choose from {','.join(BENCH_OPS)} (or all)")
    return tuple(dict.fromkeys(ops))


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``2,4`` -> (2, 4)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--nproc {text!r}: write world sizes separated by commas, e.g. 2,4") from None


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", text.strip().upper())
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"--sizes: {text!r} is not a size like 4K, 1M or 4096")
    return int(match.group(1)) * _UNITS[match.group(2)]
