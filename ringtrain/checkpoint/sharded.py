"""Sharded checkpoints: every rank writes its own shard with ``torch.distributed.checkpoint`` (DCP), and
ringtrain adds what DCP lacks: a sha256 manifest as the commit marker, metadata read without arbitrary
unpickling, and background saves whose commit waits for every rank's files.

A checkpoint is a folder ``step_00000040.dcp/`` (DCP's ``__R_I.distcp`` shard files and ``.metadata``) plus
``step_00000040.dcp.manifest.json`` beside it. The commit, for synchronous and background saves alike:

1. each rank's DCP write finishes (DCP fsyncs its files), then the rank hashes the files it wrote and
   leaves ``.done-rank-R.json`` in the folder (atomically, fsynced);
2. the writer (rank 0) waits until every rank's ``.done`` file is there, then writes the manifest (every
   file's size and sha256) atomically. No manifest, no checkpoint: a save cut anywhere is ignored on load.

This needs no collective after the write, so a background save (``async_save=True``: DCP stages the state in
memory and writes from a thread) commits from that thread while training goes on; DCP's own collectives
run on a Gloo group of their own, beside the training's.

Loading verifies the manifest first (size and sha256 of every file: corruption, not tampering, since
whoever can write the folder can rewrite the manifest; the manifest a JSON map of the files a save writes,
every file a regular one, every size compared before any byte is read), then reads ``.metadata`` (only as the
manifest lists it) with its opcodes checked against an allow-list and an unpickler that admits the classes
ringtrain's saves write, and checks every entry (tensor storage in the folder's ``__R_I.distcp`` files only;
``checkpoint/dcp_metadata.py``) before DCP opens any shard; the reader and planner refuse a read of a
pickled object (``dcp_io``), each tensor's stretch and ``extra.pt`` are bounded (``decode_limits``) and read
weights-only, so nothing in a checkpoint can run code, crash the process or stall it; what fails is one line.
DCP reshards on load: a state saved by N ranks loads into M ranks' layout (DTensors of another mesh, or plain
full tensors).

    ckpt = ShardedCheckpointer(run_dir / "checkpoints", rank, world_size)
    pending = ckpt.save(40, {"model": model_sd, "optim": optim_sd}, async_save=True)   # returns at once
    ...
    pending.result()                                                                   # committed, report
    ckpt.load(ckpt.latest(), state)                                                    # in place, resharded
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.checkpoint.manager import forbidden_global, refused_pickle
from ringtrain.checkpoint.manifest import (
    FORMAT,
    file_entry_problem,
    fsync_dir,
    make_dirs,
    open_regular,
    read_json,
    read_regular,
    write_atomic,
)
from ringtrain.decode_limits import MAX_PICKLE_BYTES, Refused, load_weights_only
from ringtrain.errors import CheckpointError, CorruptCheckpoint, RingtrainError, UnsafeCheckpoint
from ringtrain.testing import faults

__all__ = ["ShardedCheckpointer", "SaveReport", "PendingSave", "StoredShards", "verify", "check_loadable",
           "SafeFileSystemReader", "checkpoint_step_of", "committed"]

_NAME = re.compile(r"^step_(\d{8})\.dcp$")
_DONE = ".done-rank-{rank}.json"
EXTRA_FILE = "extra.pt"
METADATA_FILE = ".metadata"
MANIFEST_SUFFIX = ".manifest.json"
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
"""DCP's shard files ``__RANK_INDEX.distcp``: with ``.metadata`` and ``extra.pt``, all a manifest may list."""


@dataclass
class SaveReport:
    """One save, as metrics.jsonl records it."""

    step: int
    path: str
    blocked_s: float
    """Seconds the caller waited (the whole save when synchronous; staging when in the background)."""
    background_s: float = 0.0
    """Seconds from the return to the commit (0 when synchronous)."""
    bytes: int = 0
    """This rank's bytes written."""


@dataclass
class PendingSave:
    """A save in flight; ``result()`` waits for its commit (rank 0: the manifest; others: their files)."""

    report: SaveReport
    future: Future = field(default_factory=Future)

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SaveReport:
        self.future.result(timeout)
        return self.report


class ShardedCheckpointer:
    """Saves and loads ``step_XXXXXXXX.dcp`` checkpoints in one folder; every rank of the group calls save
    and load (collectives), only rank 0 commits and prunes."""

    def __init__(self, directory: str | Path, rank: int, world_size: int, keep_last: int = 3,
                 commit_timeout_s: float = 600.0, fence: Callable[[], None] | None = None,
                 new_group: Callable[[], Any] | None = None):
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.commit_timeout_s = commit_timeout_s
        self.fence = fence
        """Called before the writer commits (under --heal: raises if it was cut off from the job meanwhile)."""
        # DCP's planning collectives run beside training's (a background save): a Gloo group of their own.
        # (``new_group``: how to make it; under --heal, recording its sockets so a failed job can shut them.)
        make_group = new_group or (lambda: dist.new_group(backend="gloo"))
        self.group = make_group() if dist.is_initialized() and world_size > 1 else None
        self._abandoned = False
        self._pending: PendingSave | None = None
        self._stager = None  # a dcp_io.ReusedStager, made at the first background save

    # --- names -----------------------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.dcp"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoints (a manifest beside the folder), oldest first."""
        return committed(self.directory)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    # --- save ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], async_save: bool = False, extra: dict[str, Any] | None = None,
             lowest_rank: bool = False, **manifest_fields: Any) -> PendingSave:
        """Save ``state`` (nested dicts of tensors / DTensors) as step ``step``. Every rank calls it. A
        background save returns once the state is staged in memory; the previous one must have finished
        (waited for here), so at most one is in flight. ``extra`` (rank 0's: counters, the sampler, the
        config; tensors, numbers, strings and containers) goes beside the shards as ``extra.pt``, read back
        weights-only (``load_extra``) and covered by the same manifest. A key several ranks hold is written
        once, by the rank DCP balances the writes onto; ``lowest_rank``: by the lowest of them (where the ranks'
        copies may differ, DiLoCo's replicas between outer steps: rank 0's replica's, as a full checkpoint's)."""
        faults.point("checkpoint.sharded.enter", step=step)
        self.wait()
        path = self.path_for(step)
        if self.rank == 0:
            if path.exists():  # an uncommitted leftover of a save that died
                manifest_of(path).unlink(missing_ok=True)
                shutil.rmtree(path)
            make_dirs(path)
            if extra is not None:
                write_atomic(path / EXTRA_FILE, lambda f: torch.save(extra, f))
        self._barrier()  # the folder exists for everyone
        start = time.perf_counter()
        report = SaveReport(step=step, path=str(path), blocked_s=0.0)
        pending = PendingSave(report)
        dcp, dcp_io = _dcp()
        writer = dcp.FileSystemWriter(path, sync_files=True)
        tensors = _only_tensors(state)
        planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True) if lowest_rank else None
        if async_save:
            if self._stager is None:
                self._stager = dcp_io.ReusedStager()
            response = dcp.async_save(tensors, storage_writer=writer, process_group=self.group,
                                      async_stager=self._stager, planner=planner)
            staged = time.perf_counter()
            report.blocked_s = staged - start
            future = response if isinstance(response, Future) else response.upload_completion

            def finish(done: Future) -> None:
                try:
                    done.result()
                    self._commit(path, step, manifest_fields, report)
                    report.background_s = time.perf_counter() - staged
                    pending.future.set_result(report)
                except BaseException as err:  # noqa: BLE001 - handed to whoever waits for it
                    pending.future.set_exception(err)

            future.add_done_callback(lambda done: threading.Thread(target=finish, args=(done,), daemon=True).start())
        else:
            dcp.save(tensors, storage_writer=writer, process_group=self.group, planner=planner)
            self._commit(path, step, manifest_fields, report)
            report.blocked_s = time.perf_counter() - start
            pending.future.set_result(report)
        self._pending = pending
        return pending

    def wait(self) -> SaveReport | None:
        """Wait for the save in flight, if any (its errors are raised here)."""
        pending, self._pending = self._pending, None
        return pending.result(self.commit_timeout_s) if pending is not None else None

    def abandon(self, wait_s: float = 5.0) -> None:
        """The group failed (healing): a background save in flight must not commit any more; wait briefly for
        one that is committing right now, so the checkpoints on disk stand still before anybody chooses one."""
        self._abandoned = True
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result(wait_s)
            except BaseException:  # noqa: BLE001 - a save of a failed group fails; nothing of it is kept
                pass

    def _commit(self, path: Path, step: int, fields: dict, report: SaveReport) -> None:
        mine = {p.name: _digest(p) for p in sorted(path.iterdir()) if _written_by(p.name, self.rank)}
        report.bytes = sum(size for _, size in mine.values())
        done = path / _DONE.format(rank=self.rank)
        write_atomic(done, lambda f: f.write(json.dumps({n: list(d) for n, d in mine.items()}).encode()))
        if self.rank != 0:
            return
        files: dict[str, list] = {}
        deadline = time.monotonic() + self.commit_timeout_s
        for rank in range(self.world_size):
            marker = path / _DONE.format(rank=rank)
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise CheckpointError(f"checkpoint {path.name}: rank {rank} did not finish writing its shard within "
                                          f"{self.commit_timeout_s:g} s; the checkpoint is not committed")
                time.sleep(0.01)
            files.update(json.loads(marker.read_text()))
        if self._abandoned:
            raise CheckpointError(f"checkpoint {path.name}: the group that saved it failed; not committed")
        if self.fence is not None:
            self.fence()
        manifest = {"format": FORMAT, "kind": "sharded", "folder": path.name, "step": step, "world_size": self.world_size,
                    "files": {name: {"bytes": size, "sha256": sha} for name, (sha, size) in sorted(files.items())},
                    **fields}
        faults.point("checkpoint.sharded.commit", step=step)
        write_atomic(manifest_of(path), lambda f: f.write(json.dumps(manifest, indent=1).encode() + b"\n"), self.fence)
        self._prune()

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep_last] if self.keep_last > 0 else []:
            manifest_of(old).unlink(missing_ok=True)  # uncommit first: a crash leaves a folder, never a half manifest
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(self.directory)

    # --- load ------------------------------------------------------------------------------------
    def load(self, path: str | Path, state: dict[str, Any], manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        """Verify ``path`` and load it into ``state`` in place (its tensors' layout decides the resharding);
        returns the manifest. Every rank calls it. ``manifest``: ``verify``'s answer for ``path`` already (a
        checkpoint loaded in parts, ``StoredShards``: its files are hashed once)."""
        path = Path(path)
        if manifest is None:
            manifest = verify(path)  # corruption (torn, truncated, bit rot); not tampering: see dcp_metadata
        dcp, dcp_io = _dcp()
        reader = dcp_io.SafeFileSystemReader(path, listed=manifest["files"])
        reader.read_metadata()  # UnsafeCheckpoint here, in one line, before DCP opens any shard
        target = _only_tensors(state)
        with one_line_errors():
            dcp.load(target, storage_reader=reader, planner=dcp_io.TensorsOnlyLoadPlanner(), process_group=self.group)
        _copy_back(target, state)
        return manifest

    @staticmethod
    def load_extra(path: str | Path) -> dict[str, Any]:
        """Rank 0's ``extra`` of a verified checkpoint (weights-only: no object can be unpickled)."""
        path = Path(path)
        return _read_extra(path, verify(path))

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


class StoredShards:
    """One verified sharded checkpoint as the parts that load from it see it: what it stores (``stored``: DCP's
    flattened keys under this view's prefix and their shapes, from its checked ``.metadata``) and ``load(state)``,
    its tensors in place into ``state`` (nested under the prefix). A part checks that the keys it would read are
    there, in its shapes, before it asks for them (DCP's own refusal of a missing key is a traceback per rank).

        shards = StoredShards(checkpointer, path)      # verified once
        outer = shards.part("outer")
        outer.stored                                    # {"global.0": (16, 8), ...}
        outer.load({"global": {"0": tensor}})           # collective: every rank calls it
    """

    def __init__(self, checkpointer: ShardedCheckpointer, path: str | Path, manifest: dict[str, Any] | None = None,
                 prefix: tuple[str, ...] = (), _keys: dict[str, tuple[int, ...]] | None = None):
        self.checkpointer, self.path = checkpointer, Path(path)
        self.manifest = manifest if manifest is not None else verify(self.path)
        self.prefix = prefix
        self._keys = _keys

    def part(self, name: str) -> StoredShards:
        """The view of what is stored under ``name`` (a dict in the saved state)."""
        return StoredShards(self.checkpointer, self.path, self.manifest, (*self.prefix, name), self._all_keys())

    def _all_keys(self) -> dict[str, tuple[int, ...]]:
        if self._keys is None:  # read once, through the checked reader (``dcp_io``)
            from torch.distributed.checkpoint.metadata import TensorStorageMetadata

            _, dcp_io = _dcp()
            metadata = dcp_io.SafeFileSystemReader(self.path, listed=self.manifest["files"]).read_metadata()
            self._keys = {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
                          if isinstance(entry, TensorStorageMetadata)}
        return self._keys

    @property
    def stored(self) -> dict[str, tuple[int, ...]]:
        """Every tensor stored under this view's prefix: its flattened key (after the prefix) and its shape."""
        head = "".join(f"{name}." for name in self.prefix)
        return {key[len(head):]: size for key, size in self._all_keys().items() if key.startswith(head)}

    def holds(self, state: dict[str, Any], exactly: bool = False) -> bool:
        """Whether every tensor of ``state`` (nested dicts) is stored under this view, in its shape (a DTensor's
        whole shape); ``exactly``: and nothing else is."""
        want, stored = _flat_shapes(state), self.stored
        return want == stored if exactly else all(stored.get(key) == shape for key, shape in want.items())

    def load(self, state: dict[str, Any]) -> None:
        """Fill ``state``'s tensors in place from the checkpoint (resharded as their layout says). Collective."""
        for name in reversed(self.prefix):
            state = {name: state}
        self.checkpointer.load(self.path, state, manifest=self.manifest)


def _flat_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``state``'s tensors as DCP stores them: flattened keys (dict keys joined by '.') and shapes (a DTensor's
    whole shape); what ``StoredShards.stored`` answers for the same state once saved."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(_only_tensors(state))
    return {key: tuple(value.shape) for key, value in flat.items() if isinstance(value, torch.Tensor)}


def check_loadable(path: str | Path) -> dict[str, Any]:
    """``verify`` (corruption), then what a load reads before any shard, refused in one line if it is not what
    ringtrain writes: ``.metadata`` (allow-list and entry checks) and ``extra.pt`` (weights-only). The
    launcher's check under --resume, so that a tampered checkpoint stops the job before any worker starts.
    Returns the manifest."""
    path = Path(path)
    manifest = verify(path)
    _, dcp_io = _dcp()
    dcp_io.SafeFileSystemReader(path, listed=manifest["files"]).read_metadata()
    if EXTRA_FILE in manifest["files"]:
        _read_extra(path, manifest)
    return manifest


@contextmanager
def one_line_errors():
    """Around ``dcp.load``: DCP wraps every rank's exception in a CheckpointException whose text is each rank's
    traceback; when each of them is ringtrain's own one-line refusal (the reader's), that refusal is raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
        if failures and all(isinstance(failure, RingtrainError) for failure in failures):
            raise type(failures[0])(str(failures[0])) from None
        raise


def _read_extra(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``extra.pt`` of a verified checkpoint: listed by its manifest, a regular file of the size listed, its pickle
    bounded (``decode_limits``), then read weights-only."""
    where = f"checkpoint {path.name}/{EXTRA_FILE}"
    if EXTRA_FILE not in manifest["files"]:
        raise CorruptCheckpoint(f"checkpoint {path.name} has no {EXTRA_FILE} in its manifest")
    try:
        payload = read_regular(path / EXTRA_FILE, size=manifest["files"][EXTRA_FILE]["bytes"])
        extra = load_weights_only(payload)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path.name} has no {EXTRA_FILE}") from None
    except Refused as err:
        raise refused_pickle(err, where) from None
    except CheckpointError:
        raise
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(f"checkpoint {path.name}/{EXTRA_FILE} holds {forbidden_global(err)}, which ringtrain "
                               "never stores; it was not loaded (not written by ringtrain, or tampered with)") from None
    except Exception as err:  # noqa: BLE001 - torch raises several types for files that are not its own
        raise CorruptCheckpoint(f"checkpoint {path.name}/{EXTRA_FILE} matches its manifest but cannot be read "
                                f"({type(err).__name__})") from None
    if not isinstance(extra, dict):
        raise CorruptCheckpoint(f"checkpoint {path.name}/{EXTRA_FILE} does not hold a state dictionary")
    return extra


def committed(directory: str | Path) -> list[Path]:
    """The committed sharded checkpoints in ``directory`` (a manifest beside the folder), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name) and manifest_of(p).exists()), key=lambda p: p.name)


def checkpoint_step_of(path: Path) -> int:
    """The step of ``step_XXXXXXXX.dcp``."""
    found = _NAME.match(Path(path).name)
    if found is None:
        raise CheckpointError(f"{path} is not a sharded checkpoint folder (step_XXXXXXXX.dcp)")
    return int(found.group(1))


def manifest_of(path: Path) -> Path:
    return path.with_name(path.name + MANIFEST_SUFFIX)


def verify(path: str | Path) -> dict[str, Any]:
    """The manifest of a committed sharded checkpoint, after checking every file's size and sha256."""
    path = Path(path)
    try:
        manifest = read_json(manifest_of(path))
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} has no manifest {manifest_of(path).name} (a save that never finished?)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("kind") != "sharded":
        raise CorruptCheckpoint(f"checkpoint manifest {manifest_of(path)} is not a sharded {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"checkpoint manifest {manifest_of(path)} lists its files as a {type(files).__name__}, "
                                "not a map of names to sizes and sha256s")
    for name, want in files.items():
        if not (SHARD_FILE.match(name) or name in (METADATA_FILE, EXTRA_FILE)):
            raise UnsafeCheckpoint(f"checkpoint manifest {manifest_of(path)} lists {name!r}, not a file a ringtrain save "
                                   f"writes (__R_I.distcp, {METADATA_FILE}, {EXTRA_FILE}); refused")
        problem = file_entry_problem(want)
        if problem:
            raise CorruptCheckpoint(f"checkpoint manifest {manifest_of(path)}: {name} {problem}")
    # Every size first (a stat each): a file that is no regular file, or not the size listed, is refused before
    # any byte of any file is read; .metadata and extra.pt are bounded besides (they are read whole).
    for name, want in files.items():
        size = _size(path, name)
        if size != want["bytes"]:
            raise CorruptCheckpoint(f"checkpoint {path.name}: {name} is {size} bytes but the manifest says "
                                    f"{want['bytes']} (truncated?)")
        if name in (METADATA_FILE, EXTRA_FILE) and size > MAX_PICKLE_BYTES:
            raise UnsafeCheckpoint(f"checkpoint {path.name}: {name} is {size} bytes, more than the {MAX_PICKLE_BYTES} "
                                   "a ringtrain save writes there; refused before reading it")
    for name, want in files.items():
        sha, _ = _digest(path / name, want["bytes"])
        if sha != want["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path.name}: {name} does not match the sha256 in its manifest (altered on disk)")
    return manifest


def _size(path: Path, name: str) -> int:
    try:
        file, size = open_regular(path / name)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path.name}: shard file {name} is missing (its manifest lists it)") from None
    file.close()
    return size


def _dcp():
    """``torch.distributed.checkpoint`` and ringtrain's DCP pieces, imported at the first sharded save or load:
    DCP's import costs about half a second in every worker process, and most runs never use it."""
    import torch.distributed.checkpoint as dcp

    from ringtrain.checkpoint import dcp_io

    return dcp, dcp_io


def __getattr__(name: str) -> Any:
    if name == "SafeFileSystemReader":
        from ringtrain.checkpoint.dcp_io import SafeFileSystemReader

        return SafeFileSystemReader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- helpers -------------------------------------------------------------------------------------------
def _digest(path: Path, expected: int | None = None) -> tuple[str, int]:
    """sha256 and size of the regular file ``path`` (``open_regular``); with ``expected``, its size is compared
    before reading, and no more than that is read."""
    try:
        f, size = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path.parent.name}: shard file {path.name} is missing (its manifest lists "
                                "it)") from None
    sha = hashlib.sha256()
    read = 0
    with f:
        if expected is not None and size != expected:
            raise CorruptCheckpoint(f"checkpoint {path.parent.name}: {path.name} is {size} bytes but the manifest says "
                                    f"{expected} (truncated?)")
        while read < size and (chunk := f.read(min(1 << 20, size - read))):
            sha.update(chunk)
            read += len(chunk)
    return sha.hexdigest(), read


def _written_by(name: str, rank: int) -> bool:
    """DCP's files: ``__R_I.distcp`` per rank R; the coordinator (rank 0) writes ``.metadata`` (and ``extra.pt``)."""
    return name.startswith(f"__{rank}_") or (rank == 0 and name in (".metadata", EXTRA_FILE))


def _only_tensors(state: Any) -> Any:
    """The tensors of ``state`` (nested dicts), nothing else. DCP stores any other value by pickling it and
    loads it with ``torch.load(weights_only=False)``: ringtrain never hands it one, so loading never
    unpickles an object. The rest (an optimizer's param_groups: they follow the config on resume anyway;
    counters, the sampler) belongs in the weights-only part of a checkpoint."""
    if isinstance(state, dict):
        kept = {k: _only_tensors(v) for k, v in state.items() if isinstance(v, (dict, torch.Tensor))}
        return {k: v for k, v in kept.items() if not (isinstance(v, dict) and not v)}
    return state


def _copy_back(loaded: dict, state: dict) -> None:
    """DCP loads in place into the tensors it was given; plain dicts are the same objects, nothing to do
    except for values DCP replaced (it may return new tensors for non-DTensor entries)."""
    for key, value in loaded.items():
        if isinstance(value, dict):
            _copy_back(value, state[key])
        elif state[key] is not value:
            state[key].copy_(value)
