"""Hostile files: for every file ringtrain turns into objects (docs/architecture.md, "What turns bytes into
objects"), a planted one that would run code if unpickled, fed through ringtrain's real load path. The
attacker can write the folder, so every manifest is rewritten to match: the sha256 manifest detects
corruption, not tampering. Each test asserts that the payload did not run (its marker file does not exist)
and that the refusal is one line naming the file."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
from pathlib import Path

import pytest
import torch

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import Digest, write_manifest
from ringtrain.checkpoint.sharded import EXTRA_FILE, ShardedCheckpointer, check_loadable, manifest_of
from ringtrain.errors import CheckpointError, LaunchError, UnsafeCheckpoint

pytestmark = pytest.mark.unit


class Payload:
    """Unpickled, it runs ``touch MARKER`` (what the issue's exploit did with a real command)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "payload-ran"
    yield path
    assert not path.exists(), "the planted pickle ran"


def _one_line(err: pytest.ExceptionInfo, *names: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    return message


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# --- full checkpoints (step_X.pt): weights-only unpickling after the manifest ------------------------------
def test_a_full_checkpoint_holding_a_pickled_object_is_refused_on_resume(tmp_path, marker):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(10, {"model": {"w": torch.ones(2)}})
    forged = manager.path_for(20)
    forged.write_bytes(_torch_saved({"model": {"w": Payload(marker)}}))
    data = forged.read_bytes()
    write_manifest(forged, Digest(hashlib.sha256(data).hexdigest(), len(data)), step=20)
    with pytest.raises(UnsafeCheckpoint) as err:
        manager.load_latest(lambda message: None)  # what a resume calls: no silent fallback to step 10 either
    _one_line(err, "step_00000020.pt", "posix.system")


# --- sharded checkpoints (step_X.dcp/): .metadata, its entries, extra.pt ----------------------------------
def _saved_sharded(tmp_path) -> tuple[ShardedCheckpointer, Path]:
    checkpointer = ShardedCheckpointer(tmp_path / "checkpoints", rank=0, world_size=1)
    state = {"model": {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3)}, "optim": {"w.m": torch.zeros(4, 3)}}
    checkpointer.save(8, state, extra={"step": 8, "config": "x = 1"}).result()
    return checkpointer, checkpointer.path_for(8)


def _fresh_state() -> dict:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "optim": {"w.m": torch.ones(4, 3)}}


def _rewrite_manifest(path: Path, *names: str) -> None:
    """What an attacker who can write the folder does: make the manifest vouch for the new bytes."""
    manifest = json.loads(manifest_of(path).read_text())
    for name in names:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_of(path).write_text(json.dumps(manifest))


def _tamper_metadata(path: Path, change) -> None:
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own file: plain pickle is fine here
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _bytes_entry(path: Path, marker: Path, file_name: str = "__0_1.distcp", fqn: str = "model.w") -> None:
    """The issue's exploit: a tensor entry turned into a BytesStorageMetadata entry whose bytes are a
    torch.save of a pickle with __reduce__ (DCP's load_bytes: torch.load(weights_only=False))."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    payload = _torch_saved(Payload(marker))
    (path / file_name).write_bytes(payload)

    def change(metadata):
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
        metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(file_name, 0, len(payload))

    _tamper_metadata(path, change)
    _rewrite_manifest(path, ".metadata", file_name)


def test_the_issue_s_bytes_entry_is_refused_before_any_shard_is_read(tmp_path, marker):
    checkpointer, path = _saved_sharded(tmp_path)
    _bytes_entry(path, marker)
    for load in (lambda: checkpointer.load(path, _fresh_state()), lambda: check_loadable(path)):
        with pytest.raises(UnsafeCheckpoint) as err:
            load()
        _one_line(err, "step_00000008.dcp/.metadata", "'model.w'", "BytesStorageMetadata")


def test_a_metadata_pickle_that_calls_anything_else_is_refused(tmp_path, marker):
    checkpointer, path = _saved_sharded(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest(path, ".metadata")
    with pytest.raises(UnsafeCheckpoint) as err:
        checkpointer.load(path, _fresh_state())
    _one_line(err, "step_00000008.dcp/.metadata", "posix.system")


def _point_storage_at(file_name: str, offset: int = 0, length: int | None = None):
    def change(metadata):
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == "model.b":
                info.relative_path, info.offset = file_name, offset
                info.length = info.length if length is None else length
    return change


@pytest.mark.parametrize("target, offset, length, complaint", [
    ("../../evil.distcp", 0, None, "points at '../../evil.distcp', not a __R_I.distcp file"),
    ("/etc/passwd", 0, None, "points at '/etc/passwd', not a __R_I.distcp file"),
    ("__0_1.distcp", 0, None, "points at __0_1.distcp, which the manifest does not list"),
    ("__0_0.distcp", 0, 10**9, "points at bytes 0+1000000000 of __0_0.distcp"),
    ("__0_0.distcp", -4, None, "points at bytes -4+"),
])
def test_storage_outside_the_folder_s_listed_shards_is_refused(tmp_path, marker, target, offset, length, complaint):
    checkpointer, path = _saved_sharded(tmp_path)
    (path / "__0_1.distcp").write_bytes(_torch_saved(Payload(marker)))  # planted but not in the manifest
    _tamper_metadata(path, _point_storage_at(target, offset, length))
    _rewrite_manifest(path, ".metadata")
    with pytest.raises(UnsafeCheckpoint) as err:
        checkpointer.load(path, _fresh_state())
    _one_line(err, "step_00000008.dcp/.metadata", "'model.b'", complaint)


def test_the_unpickler_admits_what_a_real_save_writes_and_never_dcp_s_bytes_class(tmp_path):
    """The first lock: the allow-list. DCP's BytesStorageMetadata comes out as a marker DCP would not take for
    a bytes entry, so even without the entry check below DCP never plans a pickled-object read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from ringtrain.checkpoint.dcp_metadata import read_metadata

    _, path = _saved_sharded(tmp_path)
    assert type(read_metadata((path / ".metadata").read_bytes(), path)) is Metadata
    import ringtrain.checkpoint.dcp_metadata as dcp_metadata

    loaded = dcp_metadata._Unpickler(io.BytesIO(pickle.dumps(BytesStorageMetadata()))).load()
    assert not isinstance(loaded, BytesStorageMetadata), "the unpickler handed out DCP's bytes-entry class"


def test_the_entry_check_refuses_a_bytes_entry_even_if_the_unpickler_admitted_dcp_s_class(tmp_path):
    """The second lock: metadata built in memory with DCP's real BytesStorageMetadata (no unpickler involved)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ringtrain.checkpoint.dcp_metadata import check_metadata

    _, path = _saved_sharded(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    check_metadata(metadata, path, listed=None)  # ringtrain's own metadata passes
    metadata.state_dict_metadata["optim.w.m"] = BytesStorageMetadata()
    with pytest.raises(UnsafeCheckpoint) as err:
        check_metadata(metadata, path, listed=None)
    _one_line(err, "'optim.w.m'", "BytesStorageMetadata")


def test_a_bytes_read_is_refused_by_the_reader_and_the_planner_before_its_bytes_are_loaded(tmp_path, marker):
    """The third lock, should a plan ever hold a bytes read: neither DCP's reader nor its planner reaches
    torch.load(weights_only=False)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from ringtrain.checkpoint.dcp_io import SafeFileSystemReader, TensorsOnlyLoadPlanner

    _, path = _saved_sharded(tmp_path)
    payload = _torch_saved(Payload(marker))
    (path / "__0_1.distcp").write_bytes(payload)
    index = MetadataIndex("model.w")
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]), storage_index=index,
                    storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    reader = SafeFileSystemReader(path)
    reader.storage_data = {index: _StorageInfo("__0_1.distcp", 0, len(payload))}
    planner = TensorsOnlyLoadPlanner()
    planner.set_up_planner({"model": {"w": torch.zeros(4, 3)}}, None)
    with pytest.raises(UnsafeCheckpoint) as err:
        reader.read_data(LoadPlan([item]), planner)
    _one_line(err, "step_00000008.dcp", "'model.w'", "pickled object")
    with pytest.raises(UnsafeCheckpoint) as err:
        planner.load_bytes(item, io.BytesIO(payload))
    _one_line(err, "'model.w'", "pickled object")


def test_rank_local_metadata_is_never_read(tmp_path, marker):
    from ringtrain.checkpoint.dcp_io import SafeFileSystemReader

    _, path = _saved_sharded(tmp_path)
    (path / "__0.metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint) as err:
        SafeFileSystemReader(path).read_metadata(rank=0)
    _one_line(err, "step_00000008.dcp", "__0.metadata", "never writes")


def test_extra_pt_holding_a_pickled_object_is_refused(tmp_path, marker):
    checkpointer, path = _saved_sharded(tmp_path)
    (path / EXTRA_FILE).write_bytes(_torch_saved({"step": 8, "sampler": Payload(marker)}))
    _rewrite_manifest(path, EXTRA_FILE)
    for load in (lambda: checkpointer.load_extra(path), lambda: check_loadable(path)):
        with pytest.raises(UnsafeCheckpoint) as err:
            load()
        _one_line(err, "step_00000008.dcp/extra.pt", "posix.system")
    (path / EXTRA_FILE).write_bytes(pickle.dumps(Payload(marker)))  # a bare pickle, not torch's zip format
    _rewrite_manifest(path, EXTRA_FILE)
    with pytest.raises(CheckpointError) as err:
        checkpointer.load_extra(path)
    _one_line(err, "step_00000008.dcp/extra.pt")


def test_a_real_sharded_checkpoint_still_loads(tmp_path):
    checkpointer, path = _saved_sharded(tmp_path)
    state = _fresh_state()
    checkpointer.load(path, state)
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(4, 3)) and torch.equal(state["optim"]["w.m"], torch.zeros(4, 3))
    assert check_loadable(path)["step"] == 8 and checkpointer.load_extra(path) == {"step": 8, "config": "x = 1"}


# --- the ledger and job.json: JSON, shapes checked ---------------------------------------------------------
def test_a_ledger_holding_a_pickle_or_junk_is_refused_in_one_line(tmp_path, marker):
    from ringtrain.data.ledger import CorruptLedger, Ledger
    from tests.conftest import run_main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = run_dir / "ledger.jsonl"
    ledger.write_bytes(pickle.dumps(Payload(marker)))
    done = run_main("ledger", str(run_dir))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "ledger.jsonl" in done.stderr, done.stderr
    ledger.write_text('{"type": "header", "num_samples": 10}\n{"step": 1, "epoch": 0, "world_size": 1, "ids": "0"}\n')
    done = run_main("ledger", str(run_dir))
    assert done.returncode == 2 and "ledger.jsonl line 2 holds ids that are not one list" in done.stderr, done.stderr
    with pytest.raises(CorruptLedger) as err:
        Ledger(ledger, 10, is_writer=True).start(1)  # a resume's rewrite of the ledger
    _one_line(err, "ledger.jsonl line 2")


@pytest.mark.parametrize("content, complaint", [
    (None, "is not a ringtrain job description"),
    ('["a list"]', "a JSON list, not an object"),
    ('{"rdzv_endpoint": 5}', "rdzv_endpoint is 5, not a str"),
    ('{"heal": "yes"}', "heal is 'yes', not a bool"),
    ('{"program": {"args": ["-c", 1]}}', "program is not {args: [strings]"),
    ('{"program": {"args": ["-c", "import os"]}}', "not sealed with the job's secret (no seal)"),
])
def test_a_job_file_holding_a_pickle_or_junk_is_refused_in_one_line(tmp_path, marker, content, complaint):
    """Junk, and (sealed with the job's secret, as if the launcher had gone wrong) fields of the wrong type; an
    unsealed one is refused before its fields are looked at (tests/launch/test_job_secret.py)."""
    from ringtrain.elastic import JOB_FILE, JobSpec, _canonical
    from ringtrain.group.auth import load_job_secret
    from tests.conftest import run_main

    path = tmp_path / JOB_FILE
    if content is None:
        path.write_bytes(pickle.dumps(Payload(marker)))
    elif content.startswith("{") and "import os" not in content:
        values = json.loads(content)
        secret = load_job_secret(os.environ)  # the suite's (tests/conftest.py)
        path.write_text(json.dumps({**values, "seal": secret.tag(JOB_FILE, _canonical(values)).hex()}))
    else:
        path.write_text(content)
    with pytest.raises(LaunchError) as err:
        JobSpec.read(tmp_path)
    _one_line(err, str(path), complaint)
    done = run_main("join", str(tmp_path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and complaint in done.stderr, done.stderr


# --- the digits cache (RINGTRAIN_CACHE_DIR): weights-only, recomputed when foreign --------------------------
def test_a_planted_digits_cache_is_ignored_and_replaced(tmp_path, marker, monkeypatch):
    from ringtrain.data import digits

    monkeypatch.setenv("RINGTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    path = digits._cache_path(0.2, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(_torch_saved((Payload(marker),) * 4))
    split = digits.load_digits_split(0.2, 0)  # the weights-only unpickler refuses it: computed again instead
    assert len(split.train) + len(split.test) == 1797
    assert all(isinstance(t, torch.Tensor) for t in torch.load(path, weights_only=True))  # and the cache replaced
