"""The one checkpoint front: a checkpoint is the dict of stateful parts it is handed, saved full or sharded,
and "the newest verified checkpoint" is found in one place.

What a checkpoint holds is never assembled by hand: the caller names its parts once, ``{name: Stateful}``
(anything with ``state_dict()`` / ``load_state_dict()``: torch's ``Stateful`` protocol), and every save, load
and the heal's state transfer use that dict (torchtitan's ``CheckpointManager(states=...)``). Two forms:

- full: one ``step_XXXXXXXX.pt`` of ``{name: part.state_dict()}`` (``CheckpointManager``: atomic, sha256
  manifest, weights-only load);
- sharded: the parts that hold tensors in a strategy's own layout (``Tensors``: the model and optimizer of a
  zero or FSDP run) go through DCP, each rank its shard (``ShardedCheckpointer``), the rest beside them in
  rank 0's weights-only ``extra.pt``; a part with a sharded form of its own (``ShardedPart``: DiLoCo's outer
  state) puts its tensors through DCP under its name, each rank's own under keys of its own, and its plain
  values in ``extra.pt``.

``newest()`` is the newest checkpoint of either form that verifies (broken newer ones skipped, each with a
warning), the same on every rank (one all-gather of the step picked)::

    front = CheckpointFront(run_dir / "checkpoints", rank, world_size, keep_last=3, sharded=True)
    front.save(40, parts, tensors)                         # every rank; returns once staged (background)
    found = front.newest(warn)                             # Found(path, step, sharded) or None
    front.load(found, parts, tensors)                      # in place; DCP reshards the tensors
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import read_manifest
from ringtrain.checkpoint.sharded import PendingSave, ShardedCheckpointer, StoredShards, checkpoint_step_of
from ringtrain.checkpoint.sharded import committed as committed_sharded
from ringtrain.checkpoint.sharded import verify as verify_sharded
from ringtrain.errors import CorruptCheckpoint

__all__ = ["CheckpointFront", "Found", "Stateful", "ShardedPart", "Tensors", "load_parts", "newest_verified"]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Tensors(Protocol):
    """Parts whose tensors a sharded checkpoint stores in the layout they are held in (a strategy's model and
    optimizer): ``names`` are the parts' names in the dict, whose full forms these replace."""

    names: tuple[str, ...]
    lowest_rank: bool
    """A key several ranks hold is written by the lowest of them (their copies may differ: DiLoCo's replicas)."""

    def sharded_state(self) -> dict[str, Any]: ...

    def load_sharded_state(self, shards: StoredShards) -> None: ...


class ShardedPart(Stateful, Protocol):
    """A part whose sharded form is not its full one: ``sharded_state_dict()`` returns its plain values (rank
    0's go into ``extra.pt``: they must be the same on every rank) and its tensors (through DCP under the part's
    name: a key only one rank holds is that rank's own, a key every rank holds is written once);
    ``load_sharded_state_dict(plain, shards)`` gets them back (``shards``: the view under its name; a collective,
    every rank reads the same number of times)."""

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def load_sharded_state_dict(self, plain: dict[str, Any], shards: StoredShards) -> None: ...


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    sharded: bool


class CheckpointFront:
    """Saves and loads the checkpoints of one run directory (see the module's docstring); every rank makes one
    and calls save and load (collectives under sharded checkpoints); only rank 0 writes full ones."""

    def __init__(self, directory: str | Path, rank: int, world_size: int, keep_last: int = 3, sharded: bool = False,
                 background: bool = False, fence: Callable[[], None] | None = None,
                 new_group: Callable[[], Any] | None = None):
        self.directory = Path(directory)
        self.rank, self.world_size = rank, world_size
        self.keep_last = keep_last
        self.background = background
        self.fence = fence
        self._new_group = new_group
        self.full = CheckpointManager(self.directory, keep_last=keep_last, is_writer=rank == 0, fence=fence)
        self.shards: ShardedCheckpointer | None = self._shards() if sharded or background else None

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    def _shards(self) -> ShardedCheckpointer:
        return ShardedCheckpointer(self.directory, self.rank, self.world_size, self.keep_last, fence=self.fence,
                                   new_group=self._new_group)

    def path_for(self, step: int) -> Path:
        return self.shards.path_for(step) if self.shards is not None else self.full.path_for(step)

    # --- save ------------------------------------------------------------------------------------------
    def save(self, step: int, parts: dict[str, Stateful], tensors: Tensors | None = None,
             **manifest_fields: Any) -> PendingSave | None:
        """Save ``parts`` as the checkpoint of ``step``: sharded (``tensors`` through DCP, in the background if
        asked) or full (rank 0 writes ``{name: part.state_dict()}``; every rank calls state_dict, which may
        gather). Returns the sharded save in flight (``wait``), else None."""
        if self.shards is not None and tensors is not None:
            state, extra = tensors.sharded_state(), {}
            for name, part in parts.items():
                if name in tensors.names:
                    continue
                if hasattr(part, "sharded_state_dict"):
                    extra[name], state[name] = part.sharded_state_dict()
                else:
                    extra[name] = part.state_dict()
            return self.shards.save(step, state, async_save=self.background, extra=extra if self.rank == 0 else None,
                                    lowest_rank=getattr(tensors, "lowest_rank", False), **manifest_fields)
        state = {name: part.state_dict() for name, part in parts.items()}
        self.full.save(step, state, **manifest_fields)
        return None

    def wait(self) -> None:
        if self.shards is not None:
            self.shards.wait()

    def abandon(self) -> None:
        """The group failed: a background save in flight must not commit any more."""
        if self.shards is not None:
            self.shards.abandon()

    # --- find and load ---------------------------------------------------------------------------------
    def newest(self, warn: Callable[[str], None]) -> Found | None:
        """The newest checkpoint of either form that verifies (``warn`` hears about each broken newer one)."""
        return newest_verified(self.directory, warn)

    def load(self, found: Found, parts: dict[str, Stateful], tensors: Tensors | None = None) -> dict[str, Any]:
        """Load ``found`` into ``parts`` (the parts it holds; names it lacks are left alone) and return what it
        held (the full form's dict, or a sharded one's extra). Raises CheckpointError / CorruptCheckpoint."""
        if found.sharded:
            if tensors is None:
                raise CorruptCheckpoint(f"checkpoint {found.path.name} is sharded, but this run has no sharded "
                                        "parts to load it into")
            checkpointer = self.shards or self._shards()  # saved sharded, resumed by a run that saves full ones
            saved = checkpointer.load_extra(found.path)
            shards = StoredShards(checkpointer, found.path)
            tensors.load_sharded_state(shards)
            load_parts(parts, saved, skip=tensors.names, shards=shards)
            return saved
        saved = self.full.load(found.path)
        load_parts(parts, saved)
        return saved


def load_parts(parts: dict[str, Stateful], saved: dict[str, Any], skip: Iterable[str] = (),
               shards: StoredShards | None = None) -> None:
    """Load each part ``saved`` holds (but those in ``skip``); a part it lacks is left alone, or told so when it
    asks (``absent_from_checkpoint()``: a strategy's own state in a checkpoint another strategy wrote). From a
    sharded checkpoint (``shards``), a ``ShardedPart`` loads its sharded form."""
    for name, part in parts.items():
        if name in skip:
            continue
        if name in saved and shards is not None and hasattr(part, "load_sharded_state_dict"):
            part.load_sharded_state_dict(saved[name], shards.part(name))
        elif name in saved:
            part.load_state_dict(saved[name])
        elif hasattr(part, "absent_from_checkpoint"):
            part.absent_from_checkpoint()


def newest_verified(directory: str | Path, warn: Callable[[str], None] | None = None,
                    check_sharded: Callable[[Path], Any] = verify_sharded) -> Found | None:
    """The newest checkpoint in ``directory``, full or sharded, that verifies against its manifest; broken newer
    ones are skipped (``warn`` names each). Reads files only: usable before any worker starts (the launcher
    passes a ``check_sharded`` that also reads the metadata; a tampered one raises instead of being skipped)."""
    directory = Path(directory)
    warn = warn or (lambda message: None)
    candidates = [(checkpoint_step_of(p), True, p) for p in committed_sharded(directory)]
    full = CheckpointManager(directory, is_writer=False)
    candidates += [(_full_step(p), False, p) for p in full.checkpoints()]
    skipped: list[str] = []
    for step, sharded, path in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            if sharded:
                check_sharded(path)
            else:
                full.verify(path)
        except CorruptCheckpoint as err:
            skipped.append(str(err))
            continue
        for reason in skipped:
            warn(f"{reason}; skipping it and resuming from {path.name}")
        return Found(path, step, sharded)
    for reason in skipped:
        warn(f"{reason}; skipping it (no older valid checkpoint)")
    return None


def _full_step(path: Path) -> int:
    try:
        return int(read_manifest(path)["step"])
    except (CorruptCheckpoint, KeyError, TypeError, ValueError):
        return int(path.name.removeprefix("step_").removesuffix(".pt"))
