"""Shared memory for a process group: who shares a host, one workspace per host, shared tensors.

``ShmGroup.build(group)`` is collective over ``group`` (it is called on the first shm collective, or
explicitly through ``shm.init_shm``). Ranks are put on hosts by ``groups.host_id()``, or by an explicit ``hosts``
list, which is how one machine can pretend to be two. The first rank of each host creates one segment;
its layout::

    header        one 64-byte line of flags per local rank + the abort line (shm_board.py)
    rank 0        small[0] small[1]   staging[0] staging[1]
    rank 1        small[0] small[1]   staging[0] staging[1]
    ...

``small`` holds whole small messages, ``staging`` one piece of a large one; both are double-buffered, so a
rank may write buffer b while slower peers still read buffer 1 - b (see shm.py for why that is enough).

``native``: the C++ hot path over the same workspace (``shm_native.py``), used when every rank of the host
could load it; None otherwise (the Python path).

A ShmGroup holds its process group weakly and is cached by the group weakly: ``destroy_process_group()``
frees the group (its Gloo threads are joined there) and with it the workspace. Holding the group strongly
kept it, and its Gloo threads, alive into interpreter shutdown, where a thread freeing a finished work's
tensor needs the GIL of an interpreter that is gone: ``terminate called without an active exception``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain.comm import flight
from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.groups import global_rank, group_rank, group_size, group_timeout_s, host_id
from ringtrain.comm.objects import all_gather_json
from ringtrain.comm.shm_board import FlagBoard, encode_call, header_bytes, require_tso
from ringtrain.comm.shm_segment import Segment, peer_segment_name, sweep_dead, sweep_stale, unlink
from ringtrain.testing import faults

__all__ = [
    "ShmGroup", "Arena", "get_shm_group", "set_up", "set_up_group", "fast_path", "cgroup_cpu_limit", "SMALL_BYTES", "PIECE_BYTES", "MIN_PIECE_BYTES",
    "destroy", "set_name_scope",
]

SMALL_BYTES = 256 << 10
"""Messages up to this size are reduced directly: every rank sums all copies (one barrier). Measured with
2 ranks: direct is faster up to 256 KB (56 us against 62 us staged), staged from 512 KB (99 against 105)."""
PIECE_BYTES = 4 << 20
"""Larger messages go through staging buffers of this size per rank (reduce-scatter + all-gather), in
pieces of a sixteenth of the message, at least ``MIN_PIECE_BYTES``. Measured at 2 ranks on the (busy)
2-core machine: a 16 MB all-reduce is fastest in 1 MB pieces (best of 20: 1.3 ms; 2.2 ms in 4 MB ones),
while 64 MB spent 26 ms computing in 1 MB pieces and 14 ms in 8 MB ones."""
MIN_PIECE_BYTES = 1 << 20
NATIVE_DIRECT_BYTES = 16 << 10
"""The native path sums messages up to this size on every rank (one barrier); larger ones are
reduce-scattered and all-gathered (each rank sums 1/n). Measured at 2 ranks (us): 16 KB 4.5 either way;
32 KB 6.9 staged against 15.6 direct, 64 KB 11.4 against 13.2, 256 KB 33 against 57."""
NATIVE_PIECE_BYTES = 1 << 20
"""The native path's pieces (per rank, all shards). Measured at 2 ranks: 512 KB in one 1 MB piece 36 us,
in 256 KB pieces 54 us (each barrier adds the ranks' skew); 4-64 MB within noise from 512 KB to 2 MB
pieces, 4 MB pieces 1.3-1.6x slower (they fall out of the 2 MB L2)."""
NATIVE_IN_PLACE_BYTES = 4 << 20
"""Tensors in a ``shared_empty`` arena are reduced where they lie from this size up (three barriers, no
copy in); below it staging is faster (2 MB: 143 us in place, 111-131 staged; 4 MB: 209 against 234-247)."""

_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_shm_group(group: dist.ProcessGroup) -> ShmGroup:
    """The ShmGroup of ``group``, built (collectively) on first use."""
    shm_group = _groups.get(group)
    if shm_group is None:
        shm_group = _groups[group] = ShmGroup.build(group)
    return shm_group


_name_scope = ""
"""Put into the names of the segments set up from now on (``set_name_scope``)."""


def set_name_scope(scope: str) -> None:
    """Name the segments of groups set up from now on with ``scope`` (healing: the generation, ``g1``), so
    that a worker cut off from an older generation can never take a newer one's segment for its own."""
    global _name_scope
    _name_scope = f"{scope}-" if scope else ""


def destroy(group: dist.ProcessGroup | None) -> ShmGroup | None:
    """Forget ``group``'s shared memory, set up or not (nothing collective): its workspace is unmapped as soon
    as no tensor points into it, and segments that dead peers of this host left named in ``/dev/shm`` (a
    set-up they died in) are unlinked. For a group that failed and is abandoned (healing): nothing of it
    may be used again; the next group sets up its own."""
    shm_group = set_up_group(group)
    if shm_group is None:
        return None
    del _groups[group]
    _last_fast[:] = [None, None]
    pids = shm_group.board.pids if shm_group.board is not None else []
    shm_group.close()
    sweep_dead(pids)
    return shm_group


def fast_path(group: dist.ProcessGroup | None):
    """``comm.all_reduce``'s shortcut: the native workspace's ``run`` of ``group``'s ShmGroup (None: the default
    group's) if shm is set up for it already (nothing collective), on one host, with the native path running:
    ``run(tensor, average, timeout_s)`` reduces a tensor it takes or says it did not (``Workspace.fast_run``).
    None: the general path."""
    if group is None:
        group = dist.group.WORLD
        if group is None:
            return None
    # The last group asked about, by identity: a WeakKeyDictionary lookup took a third of this call's Python.
    ref, shm_group = _last_fast
    if ref is None or ref() is not group:
        shm_group = _groups.get(group)
        if shm_group is None:
            return None
        _last_fast[:] = [weakref.ref(group), shm_group]
    return shm_group.fast


_last_fast: list = [None, None]
"""``fast_path``'s cache: a weak reference to the last group it found, and that group's ShmGroup (``destroy``
empties it; a closed ShmGroup's ``fast`` is None)."""


def _count_arenas(arenas: dict, native) -> None:
    """Tell the native path whether large tensors may live in an arena (``Workspace.run`` leaves them to Python)."""
    if native is not None:
        native.arenas = len(arenas)


def _forget_arena(arenas: dict, key: int, native) -> None:
    arenas.pop(key, None)
    _count_arenas(arenas, native)


def set_up_group(group: dist.ProcessGroup | None) -> ShmGroup | None:
    """The ShmGroup of ``group`` if it is set up already (nothing collective), else None."""
    try:
        return _groups.get(group)
    except TypeError:  # None: no default group
        return None


def set_up(group: dist.ProcessGroup, hosts: Sequence[str] | None, small_bytes: int, piece_bytes: int) -> ShmGroup:
    """Build ``group``'s ShmGroup with explicit options (collective); refused once it exists."""
    if group in _groups:
        raise RuntimeError("shm is already set up for this group; call init_shm before its first shm collective")
    shm_group = _groups[group] = ShmGroup.build(group, hosts, small_bytes, piece_bytes)
    return shm_group


def _affinity() -> set[int]:
    """The cores this thread may run on (all the machine's where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def near_mask(affinities: Sequence[Sequence[int]], local_rank: int) -> int:
    """Bit j set: local rank j is pinned to the one core that ``local_rank`` is pinned to (``affinities``: each
    local rank's allowed cores). 0 when ``local_rank`` may run on several cores: then no rank is known to share
    its core. The native path writes the shared parts that only such ranks read with plain stores."""
    mine = set(affinities[local_rank])
    if len(mine) != 1:
        return 0
    return sum(1 << j for j, cores in enumerate(affinities) if j != local_rank and set(cores) == mine)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup may use (quota / period: 1.5 for ``cpu.max`` = ``150000 100000``), the
    tightest of its cgroup and their ancestors, v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``); None if unlimited."""
    try:
        with open(cgroup_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: /sys/fs/cgroup, or /sys/fs/cgroup/unified (hybrid)
            for base in (root, os.path.join(root, "unified")):
                for folder in _with_ancestors(base, path):
                    quota, _, period = _read(os.path.join(folder, "cpu.max")).partition(" ")
                    if quota.isdigit() and period.strip().isdigit():
                        limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu, cpu,cpuacct or the listed name
            for name in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):
                for folder in _with_ancestors(os.path.join(root, name), path):
                    quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
                    period = _read(os.path.join(folder, "cpu.cfs_period_us"))
                    if quota.isdigit() and period.isdigit() and int(quota) > 0:  # -1: no quota
                        limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _with_ancestors(base: str, path: str) -> list[str]:
    parts = [part for part in path.split("/") if part]
    return [os.path.join(base, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class Turns:
    small_turn: int = 0
    staging_turn: int = 0


@dataclass
class Arena:
    """A shared segment holding one tensor per local rank at the same offset (``shm.shared_empty``)."""

    segment: Segment
    stride: int
    """Bytes from one rank's region to the next."""
    local_rank: int
    bytes: torch.Tensor

    def contains(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor`` inside this rank's region, or None when it lives elsewhere."""
        base = self.bytes.data_ptr() + self.local_rank * self.stride
        start = tensor.data_ptr()
        if base <= start and start + tensor.numel() * tensor.element_size() <= base + self.stride:
            return start - base
        return None

    def view(self, local_rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        lo = local_rank * self.stride + offset
        return self.bytes[lo : lo + numel * torch.tensor([], dtype=dtype).element_size()].view(dtype)


class ShmGroup:
    """One rank's view of the shared memory of its host, for one process group."""

    def __init__(self, group: dist.ProcessGroup, hosts: list[str], small_bytes: int, piece_bytes: int):
        self._group = weakref.ref(group)  # see the module docstring: never keep the group alive
        self.size = group_size(group)
        self.rank = group_rank(group)
        self.hosts = hosts
        self.local = [r for r in range(self.size) if hosts[r] == hosts[self.rank]]
        """Group ranks on this host, in rank order; index in it = local rank."""
        self.local_rank = self.local.index(self.rank)
        self.local_size = len(self.local)
        self.leaders = sorted({min(r for r in range(self.size) if hosts[r] == host) for host in hosts})
        """The first group rank of each host: they run the ring between hosts."""
        self.is_leader = self.rank == self.local[0]
        self.hierarchical = len(self.leaders) > 1
        self.small_bytes = small_bytes
        self.piece_bytes = piece_bytes
        self.timeout_s = group_timeout_s(group)
        """The group's timeout, read once (``comm.all_reduce``'s default)."""
        self.region_bytes = 2 * small_bytes + 2 * piece_bytes
        self.header_bytes = header_bytes(self.local_size)
        self.segment: Segment | None = None
        self.board: FlagBoard | None = None
        self.bytes: torch.Tensor | None = None
        self.arenas: dict[int, Arena] = {}
        """The live arenas of ``shared_empty``; one leaves with the last tensor that uses its memory."""
        self.turns = Turns()
        """Which small / staging buffer the last call used (``small_turn``, ``staging_turn``): a Turns, or the
        native workspace once it runs, which both paths then read and write."""
        self._views: dict = {}
        self.native = None
        """The C++ hot path (``shm_native``'s Workspace) or None."""
        self.fast = None
        """``native`` where ``comm.all_reduce`` may hand it tensors directly (``fast_path``): not across hosts."""
        self.native_dtypes: frozenset = frozenset()
        self.p2p = None
        """The point-to-point channels (``shm_p2p.Channels``) the c10d backend makes with the workspace, or None."""

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this shm workspace was destroyed; use tensors from a live group")
        return group

    @classmethod
    def build(cls, group: dist.ProcessGroup, hosts: Sequence[str] | None = None,
              small_bytes: int = SMALL_BYTES, piece_bytes: int = PIECE_BYTES) -> ShmGroup:
        """Collective over ``group``: agree on hosts, create and map one workspace per host."""
        require_tso()
        size = group_size(group)
        if hosts is not None and len(hosts) != size:
            raise ValueError(f"hosts has {len(hosts)} entries for a group of {size} ranks; give one host name per rank")
        mine = hosts[group_rank(group)] if hosts is not None else host_id()
        from ringtrain.comm import shm_native  # here: `python -m ringtrain.comm.shm_native` must run it first

        # A test's fault plan stops a worker between shm barriers: the native path is one C++ call, so it takes
        # the Python path (the host's ranks agree on one path below, so its whole group does).
        native = None if faults.armed_at("shm.arrive") else shm_native.load()
        gathered = all_gather_json([mine, sorted(_affinity()), native is not None], group=group)
        shm_group = cls(group, [str(host) for host, _, _ in gathered], small_bytes, piece_bytes)
        total = shm_group.header_bytes + shm_group.local_size * shm_group.region_bytes
        shm_group.segment = shm_group.share_segment(total, "workspace")
        shm_group.bytes = torch.frombuffer(shm_group.segment.buf, dtype=torch.uint8)
        ranks = [global_rank(group, r) for r in shm_group.local]
        # Spinning only pays when every rank has a core of its own: count the cores the local ranks may run on
        # (their affinity masks, e.g. pinned one core each) within the cgroup's CPU quota, not the machine's.
        cores = len(set().union(*(gathered[r][1] for r in shm_group.local)))
        limit = cgroup_cpu_limit()
        if limit is not None:
            cores = min(cores, max(1, int(limit)))
        spin = shm_group.local_size <= cores
        board = FlagBoard(shm_group.segment.buf, shm_group.local_rank, shm_group.local_size, ranks, spin=spin)
        board.publish_pid()
        dist.barrier(group=group)
        board.read_pids()
        shm_group.board = board
        # Native only if every rank of the host has it: the two paths share the protocol, not the arithmetic.
        if all(gathered[r][2] for r in shm_group.local) and shm_group.local_size <= 64:
            shm_group._start_native(native, spin, near_mask([gathered[r][1] for r in shm_group.local], shm_group.local_rank))
        return shm_group

    def _start_native(self, native, spin: bool, near: int = 0) -> None:
        workspace = native.Workspace(self.bytes.data_ptr(), self.header_bytes, self.region_bytes, self.small_bytes,
                                     self.piece_bytes, self.local_rank, self.local_size, spin, self.board.check_liveness)
        workspace.near_mask = near
        workspace.direct_bytes = min(NATIVE_DIRECT_BYTES, self.small_bytes)
        workspace.piece_bytes = min(NATIVE_PIECE_BYTES, self.piece_bytes)
        self.native_dtypes = frozenset(getattr(torch, name) for name in native.dtypes())
        for dtype in self.native_dtypes:
            workspace.set_code(dtype, *(encode_call("all_reduce", op, dtype, 0)[1] for op in ("sum", "avg")))
        workspace.small_turn, workspace.staging_turn = self.turns.small_turn, self.turns.staging_turn
        self.turns = workspace  # one record of the turns for both paths
        workspace.timeout_s_default = self.timeout_s
        workspace.in_place_bytes = NATIVE_IN_PLACE_BYTES
        flight.recorder().attach(workspace)  # its fast path records its own calls
        self.native = workspace
        self.fast = None if self.hierarchical else workspace.fast_run()

    def close(self) -> None:
        """Let go of the workspace (``destroy``): the native path first, which points into it, then every
        view; the mapping goes now, or with the last tensor that still points into it."""
        if self.native is not None:
            flight.recorder().detach(self.native)
        self.fast = self.native = None
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
        self.native_dtypes = frozenset()
        self.turns = Turns()
        self._views.clear()
        self.board = None
        self.bytes = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def share_segment(self, nbytes: int, purpose: str) -> Segment:
        """Collective: the first rank of each host creates a segment, the others map it, then the name goes.

        Every rank learns the outcome of every step, so a failure (a full /dev/shm, a host name that two
        machines share) is reported on all ranks in one line instead of leaving some waiting.
        """
        infos = all_gather_json([os.getpid(), os.urandom(6).hex()], group=self.group)
        leader = global_rank(self.group, self.local[0])
        try:  # a peer's values become a path in /dev/shm: a pid and 12 hex digits, nothing else
            name = peer_segment_name(infos[self.local[0]], f"{_name_scope}{purpose}", leader)
        except ValueError as err:
            raise PeerDataError(f"shm set-up failed: {err}", peer=leader) from None
        segment = None
        try:
            status = "ok"
            if self.is_leader:
                sweep_stale()
                try:
                    segment = Segment.create(name, nbytes)
                except OSError as err:
                    status = f"rank {global_rank(self.group, self.rank)} could not create {name}: {err.strerror or err}"
            self._all_ok(status)
            if not self.is_leader:
                try:
                    segment = Segment.attach(name)
                except OSError as err:
                    status = (
                        f"rank {global_rank(self.group, self.rank)} could not open {name} made by rank "
                        f"{global_rank(self.group, self.local[0])} on host {self.hosts[self.rank]!r} ({err.strerror}); "
                        "ranks with the same host name must share /dev/shm: pass hosts= to init_shm or use algorithm='ring'"
                    )
            self._all_ok(status)
            return segment
        finally:
            # Mapped everywhere (or failed): the name is no longer needed, and must not outlive the job.
            # (Segment.unlink also lets go of the creator's lock, which kept sweepers off the name.)
            if segment is not None:
                segment.unlink()
            else:
                unlink(name)

    def _all_ok(self, status: str) -> None:
        statuses = all_gather_json(status, group=self.group)
        failed = [s for s in statuses if s != "ok"]
        if failed:
            raise RuntimeError(f"shm set-up failed: {failed[0]}")

    # --- typed views of the workspace ---------------------------------------------------------------
    def region_views(self, kind: str, turn: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every local rank's ``small`` or ``staging`` buffer ``turn``, as 1-D tensors of ``dtype``."""
        key = (kind, turn, dtype)
        views = self._views.get(key)
        if views is None:
            nbytes = self.small_bytes if kind == "small" else self.piece_bytes
            offset = turn * nbytes if kind == "small" else 2 * self.small_bytes + turn * nbytes
            views = []
            for local_rank in range(self.local_size):
                lo = self.header_bytes + local_rank * self.region_bytes + offset
                views.append(self.bytes[lo : lo + nbytes].view(dtype))
            self._views[key] = views
        return views

    # --- shared tensors ------------------------------------------------------------------------------
    def shared_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: a 1-D tensor in shared memory, at the same offset on every rank of this host."""
        element = torch.tensor([], dtype=dtype).element_size()
        stride = max(64, -(-numel * element // 64) * 64)
        segment = self.share_segment(stride * self.local_size, "arena")
        arena = Arena(segment, stride, self.local_rank, torch.frombuffer(segment.buf, dtype=torch.uint8))
        tensor = arena.view(self.local_rank, 0, numel, dtype)
        # Forget the arena once this tensor and every view of it are gone (a re-wrapped model's old buckets):
        # nothing else holds its mapping, so the memory is unmapped then instead of at exit.
        self.arenas[id(arena)] = arena
        _count_arenas(self.arenas, self.native)
        weakref.finalize(tensor, _forget_arena, self.arenas, id(arena), self.native)
        return tensor

    def find_arena(self, tensor: torch.Tensor) -> tuple[Arena, int] | None:
        for arena in self.arenas.values():
            offset = arena.contains(tensor)
            if offset is not None:
                return arena, offset
        return None
