"""The launch flags a cluster scheduler already knows: SLURM under ``srun``, and Kubeflow's PyTorchJob.

``ringtrain train`` and ``ringtrain run`` call ``fill_launch_flags`` once, before launching. It only fills in
flags the user left out (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--nproc``): a flag given
always wins, and a flag that contradicts the allocation is one line (``LaunchError``, exit 2). Nothing here
reads the environment itself: ``group/env.py`` hands over the variables (``cluster_environ``).

Detection order: SLURM (``SLURM_JOB_ID``), then PyTorchJob (the elastic ``PET_*`` variables, else
``MASTER_ADDR`` with ``RANK`` and ``WORLD_SIZE``, one launcher per pod), then none. ``RINGTRAIN_CLUSTER=none``
turns detection off.

    >>> filled = fill_launch_flags(LaunchFlags(), {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0",
    ...     "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[01-02]"})
    >>> filled.flags.nnodes, filled.flags.node_rank, filled.flags.rdzv_endpoint
    ('2', 0, 'node01:16234')
    >>> filled.line
    'ringtrain: SLURM job 1234: 2 nodes, node rank 0, 1 worker per node, rendezvous node01:16234'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ringtrain.errors import LaunchError

__all__ = ["LaunchFlags", "ClusterJob", "FilledFlags", "NodelistError", "expand_nodelist", "nodelist_size", "detect_cluster",
           "fill_launch_flags", "slurm_port", "CLUSTER_VAR", "MAX_NODES"]

CLUSTER_VAR = "RINGTRAIN_CLUSTER"
"""'none': ignore the scheduler's variables (e.g. a one-node job inside a larger allocation)."""
SLURM_BASE_PORT = 15000
SLURM_PORT_SPAN = 20000
"""The rendezvous port of a SLURM job: 15000 + job id % 20000, the same on every node of the job, and
different for jobs that share a node (as Lightning's SLURMEnvironment derives its MASTER_PORT)."""
MAX_NODES = 100_000
"""The most nodes a node list or a tasks-per-node count may name (the largest machines have some 10,000): a
list is counted before it is expanded, so ``node[1-100000000]`` is one line at once, not gigabytes of names."""


class NodelistError(LaunchError):
    """A SLURM node list that is not in SLURM's compressed form."""


@dataclass(frozen=True)
class LaunchFlags:
    """The launch flags a cluster may know; None: not given on the command line."""

    nproc: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None


@dataclass(frozen=True)
class FilledFlags:
    """``fill_launch_flags``'s answer."""

    flags: LaunchFlags
    """Every field set: the user's flags, else the scheduler's values, else the defaults."""
    line: str | None
    """The info line naming the scheduler and what it gave (None: nothing came from a scheduler)."""
    slurm: bool = False
    """A SLURM job: SIGUSR1 (``#SBATCH --signal=USR1@90``) to the launcher saves and stops (launch.py)."""


@dataclass(frozen=True)
class ClusterJob:
    """What the scheduler says about this launcher's job."""

    source: str
    """How the info line names it: 'SLURM job 1234', 'PyTorchJob'."""
    nnodes: str
    """N, or MIN:MAX (an elastic PyTorchJob)."""
    node_rank: int
    rdzv_host: str
    rdzv_port: int
    nproc: int | None = None
    """Workers per node, when the scheduler says (PET_NPROC_PER_NODE)."""
    @property
    def rdzv_endpoint(self) -> str:
        host = f"[{self.rdzv_host}]" if ":" in self.rdzv_host else self.rdzv_host
        return f"{host}:{self.rdzv_port}"


# --- SLURM's node lists -----------------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d{1,18})(?:-(\d{1,18}))?$")


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> the host names, in order, zero padding kept.

        >>> expand_nodelist("node[01-03,07],gpu-[8-10]-ib,login")
        ['node01', 'node02', 'node03', 'node07', 'gpu-8-ib', 'gpu-9-ib', 'gpu-10-ib', 'login']

    A name may hold several bracket groups (``r[1-2]n[1-2]``: every combination, the last group fastest).
    Raises NodelistError naming the list and what is wrong with it, or how many hosts it names when that is
    more than ``MAX_NODES`` (counted first: nothing is expanded then).
    """
    size = nodelist_size(text)
    if size > MAX_NODES:
        raise NodelistError(f"node list {_shown(text)} names {size} hosts, more than {MAX_NODES}: not a SLURM allocation")
    hosts: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise NodelistError(f"node list {_shown(text)} has an empty host name (a stray comma)")
        names = [""]
        for literal, bracket, group in re.findall(r"([^\[\]]*)(\[([^\[\]]*)\])?", item):
            names = [name + literal for name in names]
            if bracket:
                names = [name + number for name in names for number in _expand_group(group, text)]
        hosts.extend(names)
    if not hosts:
        raise NodelistError(f"node list {_shown(text)} names no host")
    return hosts


def nodelist_size(text: str) -> int:
    """How many hosts ``expand_nodelist(text)`` names, counted without expanding (NodelistError as it raises)."""
    total = 0
    for item in _split_top_level(text):
        if not item:
            raise NodelistError(f"node list {_shown(text)} has an empty host name (a stray comma)")
        names = 1
        for _, bracket, group in re.findall(r"([^\[\]]*)(\[([^\[\]]*)\])?", item):
            if bracket:
                names *= sum(high - low + 1 for low, high, _ in _ranges(group, text))
        total += names
    if not total:
        raise NodelistError(f"node list {_shown(text)} names no host")
    return total


def _shown(text: str) -> str:
    """A list as an error line quotes it: at most 80 characters of it."""
    return repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters)"


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets; refuse unbalanced or nested brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise NodelistError(f"node list {_shown(text)}: nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"node list {_shown(text)}: ']' at position {i} closes nothing")
        elif char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise NodelistError(f"node list {_shown(text)}: a '[' is never closed")
    items.append(text[start:].strip())
    return items


def _expand_group(group: str, text: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: a range keeps the width of its first number."""
    return [str(n).zfill(width) for low, high, width in _ranges(group, text) for n in range(low, high + 1)]


def _ranges(group: str, text: str) -> list[tuple[int, int, int]]:
    """'01-03,7' -> [(1, 3, 2), (7, 7, 1)]: each range's first and last number and its width."""
    ranges = []
    for part in group.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise NodelistError(f"node list {_shown(text)}: [{group[:40]}] holds {part[:40]!r}, not a number or a range "
                                "like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise NodelistError(f"node list {_shown(text)}: range {part!r} runs backwards")
        ranges.append((int(low), int(high), len(low)))
    return ranges


def _tasks_per_node(text: str) -> dict[int, int]:
    """SLURM_TASKS_PER_NODE's form '2(x3),1' -> {2: 3, 1: 1} (tasks: how many nodes), never expanded; at most
    MAX_NODES nodes in all."""
    counts: dict[int, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d{1,18})(?:\(x(\d{1,18})\))?\s*", part)
        if not match:
            raise LaunchError(f"SLURM tasks per node {_shown(text)} is not in SLURM's form (e.g. 1(x2))")
        tasks, nodes = int(match.group(1)), int(match.group(2) or 1)
        counts[tasks] = counts.get(tasks, 0) + nodes
        if sum(counts.values()) > MAX_NODES:
            raise LaunchError(f"SLURM tasks per node {_shown(text)} counts more than {MAX_NODES} nodes: not a SLURM "
                              "allocation")
    return counts


def slurm_port(job_id: str) -> int:
    """The job's rendezvous port, the same on every node: 15000 + job id % 20000."""
    digits = re.match(r"\d{1,18}(?!\d)", job_id)
    if not digits:
        raise LaunchError(f"SLURM_JOB_ID {job_id!r} is not a number; pass --rdzv-endpoint HOST:PORT")
    return SLURM_BASE_PORT + int(digits.group()) % SLURM_PORT_SPAN


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[name] for name in names if env.get(name)), None)


def _int(env: Mapping[str, str], name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={_shown(value)} is not a whole number") from None


def _slurm_job(env: Mapping[str, str]) -> ClusterJob | None:
    job_id = env["SLURM_JOB_ID"]
    under_srun = bool(_first(env, "SLURM_STEP_ID", "SLURM_STEPID"))
    # A job step's own view first (srun sets it), then the allocation's.
    nnodes_text = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nnodes_text is None or nodelist is None:
        return None
    nnodes = _int(env, "SLURM_NNODES", nnodes_text)
    if not 1 <= nnodes <= MAX_NODES:
        raise LaunchError(f"SLURM_NNODES={nnodes_text[:20]!r} is not between 1 and {MAX_NODES}")
    if not under_srun:
        if nnodes > 1:
            raise LaunchError(
                f"SLURM job {job_id} has {nnodes} nodes but ringtrain was not started by srun: run `srun "
                "--ntasks-per-node=1 ringtrain ...` (one launcher per node), or pass --nnodes 1 to train on this "
                "node alone")
        # The batch script or an salloc shell on one node: nothing to fill in, but SIGUSR1 still means "save".
        return ClusterJob(f"SLURM job {job_id}", "1", 0, "", 0)
    tasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node_counts = _tasks_per_node(per_node) if per_node else {}
    if env.get("SLURM_NTASKS_PER_NODE", "1") != "1" or any(count != 1 for count in per_node_counts) or (
            tasks is not None and _int(env, "SLURM_NTASKS", tasks) != nnodes):
        started = f"{tasks} tasks" if tasks else f"tasks per node {per_node or env.get('SLURM_NTASKS_PER_NODE')}"
        raise LaunchError(
            f"SLURM job {job_id}: srun started {started} on {nnodes} node{'s' * (nnodes != 1)}, but ringtrain's "
            "launcher starts the workers itself: one task per node (srun --ntasks-per-node=1, workers per node "
            "with --nproc)")
    named = nodelist_size(nodelist)  # counted before it is expanded: a list of 10^8 hosts is one line at once
    if named != nnodes:
        raise LaunchError(f"SLURM job {job_id}: node list {_shown(nodelist)} names {named} hosts, SLURM_NNODES says "
                          f"{nnodes}")
    hosts = expand_nodelist(nodelist)
    node_rank = _int(env, "SLURM_NODEID", env.get("SLURM_NODEID", "0"))
    return ClusterJob(f"SLURM job {job_id}", str(nnodes), node_rank, hosts[0], slurm_port(job_id))


def _pytorchjob(env: Mapping[str, str]) -> ClusterJob | None:
    """Kubeflow's PyTorchJob: the elastic PET_* variables (torchrun's own), else the Master/Worker ones
    (WORLD_SIZE is the number of pods, RANK the pod's index: one launcher per pod)."""
    if env.get("PET_NNODES") or env.get("PET_MASTER_ADDR"):
        nnodes = env.get("PET_NNODES", "1")
        node_rank = _int(env, "PET_NODE_RANK", env.get("PET_NODE_RANK", "0"))
        host, port = env.get("PET_MASTER_ADDR"), env.get("PET_MASTER_PORT")
        host, port = host or env.get("MASTER_ADDR"), port or env.get("MASTER_PORT")
        nproc_text = env.get("PET_NPROC_PER_NODE")
        nproc = _int(env, "PET_NPROC_PER_NODE", nproc_text) if nproc_text and nproc_text.isdigit() else None
    elif env.get("MASTER_ADDR") and env.get("RANK") and env.get("WORLD_SIZE"):
        nnodes, node_rank = env["WORLD_SIZE"], _int(env, "RANK", env["RANK"])
        host, port, nproc = env["MASTER_ADDR"], env.get("MASTER_PORT"), None
    else:
        return None
    if not host or not port:
        raise LaunchError("PyTorchJob: the master's address and port (PET_MASTER_ADDR / MASTER_ADDR, PET_MASTER_PORT / "
                          "MASTER_PORT) are not both set; pass --rdzv-endpoint HOST:PORT")
    return ClusterJob("PyTorchJob", nnodes, node_rank, host, _int(env, "MASTER_PORT", port), nproc)


def detect_cluster(env: Mapping[str, str]) -> ClusterJob | None:
    """The scheduler's view of this launcher's job, or None (not under a scheduler, or RINGTRAIN_CLUSTER=none)."""
    if env.get(CLUSTER_VAR, "").lower() == "none":
        return None
    if env.get("SLURM_JOB_ID"):
        return _slurm_job(env)
    return _pytorchjob(env)


def fill_launch_flags(flags: LaunchFlags, env: Mapping[str, str]) -> FilledFlags:
    """The flags with what the user left out filled in from the scheduler (``detect_cluster``), then the
    built-in defaults (1 worker, 1 node, node rank 0), with the info line saying where they came from. Raises LaunchError when a flag given contradicts the allocation:
    the job would wait for nodes that never come, or two nodes would both be node 0. ``--nnodes 1`` turns
    detection off (this node alone)."""
    alone = flags.nnodes is not None and flags.nnodes.strip() == "1"
    job = None if alone else detect_cluster(env)
    line = None
    if job is not None and job.nnodes != "1":
        if flags.nnodes is not None and _max_nodes(flags.nnodes) != _max_nodes(job.nnodes):
            raise LaunchError(f"--nnodes {flags.nnodes} but the {job.source} has {job.nnodes} nodes: drop --nnodes "
                              "(it is read from the allocation) or ask the scheduler for that many nodes")
        if flags.node_rank is not None and flags.node_rank != job.node_rank:
            raise LaunchError(f"--node-rank {flags.node_rank} but the {job.source} says this is node {job.node_rank}: "
                              "drop --node-rank (it is read from the allocation)")
        flags = replace(flags, nnodes=flags.nnodes or job.nnodes, node_rank=job.node_rank,
                        rdzv_endpoint=flags.rdzv_endpoint or job.rdzv_endpoint)
    if job is not None and flags.nproc is None and job.nproc is not None:
        flags = replace(flags, nproc=job.nproc)
    flags = replace(flags, nproc=1 if flags.nproc is None else flags.nproc, nnodes=flags.nnodes or "1",
                    node_rank=flags.node_rank or 0)
    if job is not None and (job.nnodes != "1" or job.nproc is not None):
        nodes = f"{flags.nnodes} node{'s' * (flags.nnodes != '1')}"
        rendezvous = f", rendezvous {flags.rdzv_endpoint}" if flags.rdzv_endpoint else ""
        line = (f"ringtrain: {job.source}: {nodes}, node rank {flags.node_rank}, {flags.nproc} "
                f"worker{'s' * (flags.nproc != 1)} per node{rendezvous}")
    # Any SLURM job (one node, --nnodes 1 too): its time-limit warning is SIGUSR1.
    slurm = bool(env.get("SLURM_JOB_ID")) and env.get(CLUSTER_VAR, "").lower() != "none"
    return FilledFlags(flags, line, slurm)


def _max_nodes(nnodes: str) -> str:
    return nnodes.strip().rpartition(":")[2]
