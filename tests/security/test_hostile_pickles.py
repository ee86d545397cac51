"""Issue 39, rows 2, 3, 8 and 9 (checkpoints): pickles that stay inside an allow-list of classes but do more
with them than make instances, pickles that nest deep enough to crash CPython, and planted files that are not
files at all. Every manifest is rewritten to match (whoever can write the folder can), every refusal is one
line, and nothing of the process changes.

- opcodes beyond "make a new instance of an allowed class from plain values" in ``.metadata`` (``BUILD`` on
  ``PosixPath`` / ``_get_layout``, ``SETITEMS`` on an object, ``REDUCE`` with objects): UnsafeCheckpoint, and
  ``ringtrain export`` writes nothing where the pickle pointed;
- nesting past ``decode_limits.MAX_DEPTH`` in a full checkpoint, ``extra.pt``, ``.metadata``, a shard stretch,
  a peer's torch.save or JSON: refused before decoding (200,000 deep: SIGSEGV before; here 5,000, which CPython
  survives, in process, and 200,000 through the CLI);
- FIFOs, symlinks (to ``/dev/zero``, or out of the folder), sparse files of a TiB, memo slot 2**28, manifests of
  the wrong shape: one line, at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path, PosixPath, PurePath

import pytest
import torch
from torch.distributed.checkpoint import metadata as md

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import Digest, manifest_path, write_manifest
from ringtrain.checkpoint.sharded import EXTRA_FILE, ShardedCheckpointer, check_loadable, manifest_of, verify
from ringtrain.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint
from tests.conftest import REPO, run_cli
from tests.security.test_hostile_files import _fresh_state, _one_line, _rewrite_manifest, _saved_sharded

DEEP = 5_000
"""Past the bound (200), short of what crashes CPython in process (the CLI tests use 200,000)."""


# --- pickle opcodes, written by hand ---------------------------------------------------------------------
def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _path(value: str) -> bytes:
    """PosixPath(value), as pickle makes one: REDUCE of the class with a tuple of strings."""
    return _global("pathlib", "PosixPath") + b"(" + _text(value) + b"tR"


def _dict(*pairs: bytes) -> bytes:
    return b"}(" + b"".join(pairs) + b"u"


def _nested_key_dict(depth: int) -> bytes:
    """The issue's row 3: {((...((0,),)...),): 1}, ``depth`` tuples deep (a protocol-2 pickle, 1 byte a level)."""
    return b"\x80\x02}(K\x00" + b"\x85" * depth + b"K\x01u."


def _torch_zip(data_pkl: bytes) -> bytes:
    """A torch.save zip (what torch.load reads: archive/data.pkl, byteorder, version) around ``data_pkl``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _with_tail(path: Path, tail: bytes) -> None:
    """``path/.metadata``: the real metadata (protocol 2), then ``tail``'s opcodes run with the Metadata object on
    the stack (``tail`` leaves the stack as it found it), then STOP; the manifest rewritten to match."""
    real = pickle.loads((path / ".metadata").read_bytes())  # the test's own file
    (path / ".metadata").write_bytes(pickle.dumps(real, protocol=2)[:-1] + tail + b".")
    _rewrite_manifest(path, ".metadata")


def _redirect(mapping: dict[str, str]) -> bytes:
    """The issue's row 2: BUILD on the class PosixPath (``__fspath__`` = ``_get_layout``) and on the function
    ``_get_layout`` (its ``cache``: path -> where the process will really open it). Every ``open(path)`` of the
    process afterwards goes where the pickle said."""
    layout = _global("torch.serialization", "_get_layout")
    cache = _dict(*(_path(key) + _text(value) for key, value in mapping.items()))
    return (_global("pathlib", "PosixPath") + b"N" + _dict(_text("__fspath__") + layout) + b"\x86b0"
            + layout + _dict(_text("cache") + cache) + b"b0")


@contextlib.contextmanager
def _process_unchanged():
    """The classes and functions the metadata's allow-list admits stay as they were (but for pickle's own
    ``__slotnames__`` cache), and ``_get_layout``'s cache holds layouts only. Whatever the block changed is put
    back on the way out, before the failure is reported: a redirected ``open`` breaks pytest's own reporting."""
    from torch.serialization import _get_layout

    watched = [PosixPath, PurePath, md.Metadata, md.TensorProperties, md.StorageMeta, _get_layout]
    before = [dict(vars(thing)) for thing in watched]
    cache = _get_layout.cache
    try:
        yield
    finally:
        changed = []
        for thing, was in zip(watched, before):
            now = dict(vars(thing))
            names = {n for n in set(now) | set(was) if now.get(n) is not was.get(n)} - {"__slotnames__"}
            changed += [f"{getattr(thing, '__name__', thing)}.{name}" for name in sorted(names)]
            for name in names:
                if name in was:
                    setattr(thing, name, was[name])
                else:
                    delattr(thing, name)
        planted = [str(k) for k, v in _get_layout.cache.items() if not (type(k) is str and isinstance(v, torch.layout))]
        _get_layout.cache = cache
        for key in [k for k, v in cache.items() if not (type(k) is str and isinstance(v, torch.layout))]:
            del cache[key]
        assert not changed and not planted, f"the pickle changed {changed} and planted {planted} in this process"


def _refused_metadata(path: Path, *phrases: str) -> str:
    """Both ways a load meets ``.metadata`` (a worker's load, the launcher's check) refuse it in one line, and
    change nothing in the process."""
    message = ""
    for load in (lambda: ShardedCheckpointer(path.parent, 0, 1).load(path, _fresh_state()), lambda: check_loadable(path)):
        with _process_unchanged(), pytest.raises(UnsafeCheckpoint) as err:
            load()
        message = _one_line(err, "step_00000008.dcp/.metadata", *phrases)
    return message


# --- row 2: opcodes that reach a class or a function ---------------------------------------------------------
@pytest.mark.unit
def test_the_issue_s_redirect_by_build_on_posixpath_and_get_layout_is_refused_and_changes_nothing(tmp_path):
    _, path = _saved_sharded(tmp_path)
    _with_tail(path, _redirect({str(tmp_path / "model.safetensors"): str(tmp_path / "authorized_keys")}))
    _refused_metadata(path, "refused before anything was unpickled")
    assert os.fspath(PosixPath(tmp_path / "model.safetensors")) == str(tmp_path / "model.safetensors")


_TENSOR_PROPERTIES = _global(md.__name__, "TensorProperties")
_STORAGE_META = _global(md.__name__, "StorageMeta")

OPCODE_TRICKS = {
    # BUILD on an allowed class itself: class attributes of the whole process.
    "build on the class PosixPath": (_global("pathlib", "PosixPath") + b"N" + _dict(_text("__fspath__") + _text("x"))
                                      + b"\x86b0", "applies BUILD to global pathlib.PosixPath"),
    "build on the function _get_layout": (_global("torch.serialization", "_get_layout")
                                          + _dict(_text("cache") + _dict(_path("/a") + _text("/b"))) + b"b0",
                                          "applies BUILD to global torch.serialization._get_layout"),
    "build on the class TensorProperties": (_TENSOR_PROPERTIES + b"N" + _dict(_text("__setstate__") + b"N") + b"\x86b0",
                                            "applies BUILD to global torch.distributed.checkpoint.metadata.TensorProperties"),
    # BUILD on a new instance: its own fields only.
    "build of a field an instance does not have": (_STORAGE_META + b")\x81" + _dict(_text("note") + _text("x")) + b"b0",
                                                    "sets note on an instance of torch.distributed.checkpoint.metadata.StorageMeta"),
    # SETITEMS into something that is not a dict (here the Metadata object on the stack).
    "setitems on an object": (b"(" + _text("x") + b"K\x01u", "applies SETITEMS to an instance of"),
    # REDUCE: an allowed function with an object for an argument; a call of something that is no class.
    "reduce with an object argument": (_global("torch.serialization", "_get_layout") + b"(" + _path("/a") + b"tR0",
                                       "calls torch.serialization._get_layout with a tuple that is not plain values"),
    "reduce of an instance": (_global("torch", "Size") + b"(]tR)R0", "calls an instance of torch.Size"),
    # A class where a value belongs (TensorProperties' pin_memory, which nothing after the unpickler checks).
    "a class as a value": (_TENSOR_PROPERTIES + b")\x81(" + _global("torch", "float32")
                           + _global("torch.serialization", "_get_layout") + b"(" + _text("torch.strided") + b"tR"
                           + b"\x89" + _global(md.__name__, "_MEM_FORMAT_ENCODING") + b"(K\x00tR"
                           + _global("pathlib", "PosixPath") + b"tb0", "uses global pathlib.PosixPath as a value"),
}


@pytest.mark.unit
@pytest.mark.parametrize("tail, complaint", OPCODE_TRICKS.values(), ids=OPCODE_TRICKS.keys())
def test_metadata_opcodes_beyond_new_instances_of_allowed_classes_are_refused(tmp_path, tail, complaint):
    _, path = _saved_sharded(tmp_path)
    _with_tail(path, tail)
    _refused_metadata(path, complaint)


@pytest.mark.job
def test_export_refuses_the_redirect_and_writes_nowhere(tmp_path):
    """The issue's end-to-end attack on ``ringtrain export RUN_DIR``: the metadata maps every path the export
    opens after reading it to itself, but the output (and its temporary, named by the pid) to the attacker's
    file. Before: exit 0, "wrote RUN_DIR/model.safetensors", which did not exist; the attacker's file held the
    weights."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(REPO / "configs" / "debug_mlp.toml", run_dir / "config.toml")
    checkpointer = ShardedCheckpointer(run_dir / "checkpoints", 0, 1)
    checkpointer.save(4, {"model": {"w": torch.ones(2, 2)}}, extra={"train_state": {"step": 4}}).result()
    path = checkpointer.path_for(4)
    out, target = run_dir / "model.safetensors", tmp_path / "authorized_keys"
    # The pid is known before the process reads anything: the shell waits for a line, then execs python.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(["sh", "-c", 'read go && exec "$0" -m ringtrain export "$1"', sys.executable, str(run_dir)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO, env=env)
    same = [run_dir, run_dir / "checkpoints", path, manifest_of(path), *(path / n for n in os.listdir(path))]
    mapping = {str(p): str(p) for p in same}
    mapping[str(out.with_name(f".{out.name}.tmp-{process.pid}"))] = str(tmp_path / "staged")
    mapping[str(out)] = str(target)
    _with_tail(path, _redirect(mapping))
    stdout, stderr = process.communicate("go\n", timeout=240)
    assert not target.exists() and not out.exists(), (stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip() and "UserWarning" not in line and "return func" not in line]
    assert process.returncode == 2 and len(lines) == 1, (process.returncode, stdout, stderr)
    assert lines[0].startswith("ringtrain: error: checkpoint metadata step_00000004.dcp/.metadata"), stderr


# --- row 3: nesting past the bound, before any decoder sees it ------------------------------------------------
def _planted_full(tmp_path: Path, payload: bytes) -> tuple[CheckpointManager, Path]:
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(10, {"model": {"w": torch.ones(2)}})
    forged = manager.path_for(20)
    forged.write_bytes(payload)
    write_manifest(forged, Digest(hashlib.sha256(payload).hexdigest(), len(payload)), step=20)
    return manager, forged


@pytest.mark.unit
def test_a_deep_full_checkpoint_is_refused_before_unpickling(tmp_path):
    manager, forged = _planted_full(tmp_path, _torch_zip(_nested_key_dict(DEEP)))
    for load in (lambda: manager.load(forged), lambda: manager.load_latest(lambda message: None)):
        with pytest.raises(UnsafeCheckpoint) as err:
            load()
        _one_line(err, "step_00000020.pt", "nests more than 200 levels deep")


def _deep_through_aliases(depth: int) -> bytes:
    """{"model": L0}, where L0 holds L1 ... holds L(depth-1): lists made first, each memoized, then joined by
    APPEND through second references (GET). Each APPEND alone nests one level: counted per opcode, it looks 2
    deep."""
    slot = lambda i: struct.pack("<I", i)  # noqa: E731
    made = b"".join(b"]r" + slot(i) + b"0" for i in range(depth))                       # EMPTY_LIST, LONG_BINPUT, POP
    joined = b"".join(b"j" + slot(i) + b"j" + slot(i + 1) + b"a0" for i in range(depth - 1))  # GET, GET, APPEND, POP
    return b"\x80\x02" + made + joined + b"}" + _text("model") + b"j" + slot(0) + b"s."


@pytest.mark.unit
def test_nesting_built_through_second_references_is_refused(tmp_path):
    """In ``.metadata`` (the C unpickler runs every opcode; torch's weights-only one refuses these itself)."""
    _, path = _saved_sharded(tmp_path)
    (path / ".metadata").write_bytes(_deep_through_aliases(DEEP))
    _rewrite_manifest(path, ".metadata")
    _refused_metadata(path, "applies APPEND to a list after a second reference to it was taken")


@pytest.mark.unit
def test_a_deep_extra_pt_is_refused_before_unpickling(tmp_path):
    checkpointer, path = _saved_sharded(tmp_path)
    (path / EXTRA_FILE).write_bytes(_torch_zip(_nested_key_dict(DEEP)))
    _rewrite_manifest(path, EXTRA_FILE)
    for load in (lambda: checkpointer.load_extra(path), lambda: check_loadable(path)):
        with pytest.raises(UnsafeCheckpoint) as err:
            load()
        _one_line(err, "step_00000008.dcp/extra.pt", "nests more than 200 levels deep")


@pytest.mark.unit
def test_deep_metadata_is_refused_before_unpickling(tmp_path):
    _, path = _saved_sharded(tmp_path)
    (path / ".metadata").write_bytes(_nested_key_dict(DEEP))
    _rewrite_manifest(path, ".metadata")
    _refused_metadata(path, "nests more than 200 levels deep")


@pytest.mark.unit
def test_a_deep_shard_stretch_is_refused_before_unpickling(tmp_path):
    """The stretch DCP reads with torch.load(weights_only=True): a shard file rewritten to hold a deep pickle
    where a tensor was, its metadata and manifest to match."""
    checkpointer, path = _saved_sharded(tmp_path)
    deep = _torch_zip(_nested_key_dict(DEEP))
    (path / "__0_0.distcp").write_bytes(deep)

    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.offset, info.length = 0, len(deep)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(path, ".metadata", "__0_0.distcp")
    with pytest.raises(UnsafeCheckpoint) as err:
        checkpointer.load(path, _fresh_state())
    _one_line(err, "step_00000008.dcp: __0_0.distcp bytes 0+", "nests more than 200 levels deep")


@pytest.mark.unit
def test_a_peer_s_deep_torch_save_or_json_is_refused_in_one_line_naming_it():
    from ringtrain.comm import objects
    from ringtrain.comm.errors import PeerDataError
    from ringtrain.heal import transfer

    deep = _torch_zip(_nested_key_dict(DEEP))
    for decode in (lambda: objects._weights_only(deep, 1), lambda: transfer._weights_only(deep, 1)):
        with pytest.raises(PeerDataError) as err:
            decode()
        _one_line(err, "rank 1", "nests more than 200 levels deep")
    with pytest.raises(PeerDataError) as err:
        objects.decode_json(b"[" * 100_000 + b"]" * 100_000, 1)  # before: RecursionError
    _one_line(err, "rank 1", "nests more than 200 levels deep")
    # Brackets inside strings are text, not nesting: a real value with many of them still decodes.
    assert objects.decode_json(json.dumps({"note": "[" * 5000, "x": [[1]]}).encode(), 1)["x"] == [[1]]


@pytest.mark.job
@pytest.mark.parametrize("where", ["full", "extra.pt", ".metadata"])
def test_the_cli_refuses_the_issue_s_200000_deep_pickle_in_one_line_instead_of_a_segfault(tmp_path, where):
    """``ringtrain export`` over each file (before: exit -11, SIGSEGV, no message)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(REPO / "configs" / "debug_mlp.toml", run_dir / "config.toml")
    deep = _nested_key_dict(200_000)
    args = ["export", str(run_dir)]
    if where == "full":
        _, forged = _planted_full(run_dir, _torch_zip(deep))
        args += ["--checkpoint", str(forged)]
    else:
        checkpointer = ShardedCheckpointer(run_dir / "checkpoints", 0, 1)
        checkpointer.save(4, {"model": {"w": torch.ones(2, 2)}}, extra={"train_state": {"step": 4}}).result()
        path = checkpointer.path_for(4)
        (path / where).write_bytes(deep if where == ".metadata" else _torch_zip(deep))
        _rewrite_manifest(path, where)
    done = run_cli(*args, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("ringtrain")]
    assert done.returncode == 2 and len(lines) == 1 and "nests more than 200 levels deep" in lines[0], done.stderr
    assert not (run_dir / "model.safetensors").exists()


# --- row 8: files that are not files ----------------------------------------------------------------------------
def _within(seconds: float, call, fifos: list[Path] = ()):
    """``call()``'s result or exception, or a failure if it has not returned in ``seconds`` (a reader stuck on
    a FIFO is released first, by opening it for writing)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"still waiting after {seconds} s (it would hang the launcher)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _fake_manifest(path: Path, size: int = 100) -> None:
    write_manifest(path, Digest("0" * 64, size), step=int(path.stem.removeprefix("step_")))


@pytest.mark.unit
def test_a_fifo_as_the_newest_full_checkpoint_is_refused_not_waited_on(tmp_path):
    from ringtrain.checkpoint.front import newest_verified

    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(10, {"model": {"w": torch.ones(2)}})
    fifo = manager.path_for(20)
    os.mkfifo(fifo)
    _fake_manifest(fifo)
    for look in (lambda: newest_verified(manager.directory, check_sharded=check_loadable),  # the launcher's
                 lambda: manager.load_latest(lambda message: None)):                       # a worker's
        with pytest.raises(UnsafeCheckpoint) as err:
            _within(20, look, [fifo])
        _one_line(err, "step_00000020.pt is a FIFO")


@pytest.mark.unit
@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_a_symlinked_full_checkpoint_is_refused_without_following_it(tmp_path, target):
    """A symlink to /dev/zero (before: read until MemoryError), or to a real checkpoint outside the folder."""
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(10, {"model": {"w": torch.ones(2)}})
    if target == "outside":
        elsewhere = CheckpointManager(tmp_path / "elsewhere")
        target = str(elsewhere.save(20, {"model": {"w": torch.zeros(2)}}))
        shutil.copy(manifest_path(Path(target)), manifest_path(manager.path_for(20)))
    else:
        _fake_manifest(manager.path_for(20))
    manager.path_for(20).symlink_to(target)
    with pytest.raises(UnsafeCheckpoint) as err:
        _within(20, lambda: manager.load(manager.path_for(20)))
    _one_line(err, "step_00000020.pt is a symbolic link")


@pytest.mark.unit
def test_a_sparse_full_checkpoint_is_refused_by_its_size_before_reading(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(10, {"model": {"w": torch.ones(2)}})
    with open(manager.path_for(20), "wb") as f:
        f.truncate(1 << 40)
    _fake_manifest(manager.path_for(20))
    with pytest.raises(CorruptCheckpoint) as err:
        _within(20, lambda: manager.load(manager.path_for(20)))
    _one_line(err, "step_00000020.pt is 1099511627776 bytes but its manifest says 100")


def _unlisted_metadata(path: Path) -> None:
    manifest = json.loads(manifest_of(path).read_text())
    del manifest["files"][".metadata"]
    manifest_of(path).write_text(json.dumps(manifest))


@pytest.mark.unit
@pytest.mark.parametrize("planted", ["fifo", "/dev/zero", "real"])
def test_a_metadata_file_left_out_of_the_manifest_is_never_opened(tmp_path, planted):
    """The launcher's check (check_loadable) and a worker's load. Before: a FIFO hung both; a symlink to
    /dev/zero read until MemoryError; a real file was read although nothing vouched for it."""
    checkpointer, path = _saved_sharded(tmp_path)
    _unlisted_metadata(path)
    if planted == "fifo":
        (path / ".metadata").unlink()
        os.mkfifo(path / ".metadata")
    elif planted == "/dev/zero":
        (path / ".metadata").unlink()
        (path / ".metadata").symlink_to(planted)
    fifos = [path / ".metadata"] if planted == "fifo" else []
    for load in (lambda: check_loadable(path), lambda: checkpointer.load(path, _fresh_state())):
        with pytest.raises(CorruptCheckpoint) as err:
            _within(20, load, fifos)
        _one_line(err, "step_00000008.dcp", "manifest does not list .metadata")


@pytest.mark.unit
@pytest.mark.parametrize("planted, complaint", [("fifo", "is a FIFO"), ("/dev/zero", "is a symbolic link")])
def test_a_listed_shard_that_is_not_a_regular_file_is_refused(tmp_path, planted, complaint):
    _, path = _saved_sharded(tmp_path)
    shard = path / "__0_0.distcp"
    shard.unlink()
    if planted == "fifo":
        os.mkfifo(shard)
    else:
        shard.symlink_to(planted)
    with pytest.raises(UnsafeCheckpoint) as err:
        _within(20, lambda: verify(path), [shard] if planted == "fifo" else [])
    _one_line(err, "__0_0.distcp", complaint)


@pytest.mark.unit
def test_a_metadata_memo_slot_of_2_28_is_refused_at_once(tmp_path):
    """10 bytes: BININT1 1, LONG_BINPUT 2**28, STOP. Before: the C unpickler sized its memo to it, 23 s and
    4 GiB, then a refusal."""
    _, path = _saved_sharded(tmp_path)
    (path / ".metadata").write_bytes(b"\x80\x02K\x01r" + struct.pack("<I", 1 << 28) + b".")
    _rewrite_manifest(path, ".metadata")
    start = time.monotonic()
    with pytest.raises(UnsafeCheckpoint) as err:
        check_loadable(path)
    _one_line(err, "step_00000008.dcp/.metadata", "stores memo slot 268435456, beyond the 10 bytes")
    assert time.monotonic() - start < 5


# --- row 9: manifests of the wrong shape, a tampered stretch, a metadata of a TiB --------------------------------
@pytest.mark.unit
def test_a_full_manifest_of_the_wrong_shape_is_one_line(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    path = manager.save(10, {"model": {"w": torch.ones(2)}})
    manifest = json.loads(manifest_path(path).read_text())
    for change, complaint in (({"bytes": None}, "has no bytes"), ({"bytes": "12"}, "has bytes '12'"),
                              ({"sha256": 5}, "has sha256 5")):
        broken = {k: v for k, v in {**manifest, **change}.items() if v is not None}
        manifest_path(path).write_text(json.dumps(broken))
        with pytest.raises(CorruptCheckpoint) as err:
            manager.load(path)
        _one_line(err, "step_00000010.manifest.json", complaint)
    manifest_path(path).write_text("[" * 100_000)
    with pytest.raises(CheckpointError) as err:
        manager.load(path)
    _one_line(err, "step_00000010.manifest.json", "nests more than 200 levels deep")


@pytest.mark.unit
@pytest.mark.parametrize("change, kind, complaint", [
    (lambda m: m.update(files=list(m["files"])), CorruptCheckpoint, "lists its files as a list"),
    (lambda m: m["files"][".metadata"].pop("bytes"), CorruptCheckpoint, ".metadata has no bytes"),
    (lambda m: m["files"].update({"../outside.distcp": m["files"]["__0_0.distcp"]}), UnsafeCheckpoint,
     "lists '../outside.distcp', not a file a ringtrain save writes"),
])
def test_a_sharded_manifest_of_the_wrong_shape_is_one_line(tmp_path, change, kind, complaint):
    _, path = _saved_sharded(tmp_path)
    manifest = json.loads(manifest_of(path).read_text())
    change(manifest)
    manifest_of(path).write_text(json.dumps(manifest))
    for load in (lambda: verify(path), lambda: check_loadable(path)):
        with pytest.raises(kind) as err:
            load()
        _one_line(err, "step_00000008.dcp.manifest.json", complaint)


@pytest.mark.unit
def test_a_metadata_of_a_tib_is_refused_by_its_size_before_reading(tmp_path):
    """A sparse ``.metadata`` of 2**40 bytes (the issue's 10**18 is past ext4's largest file), the manifest
    saying so. Before: hashed for minutes, then read until MemoryError."""
    _, path = _saved_sharded(tmp_path)
    with open(path / ".metadata", "r+b") as f:
        f.truncate(1 << 40)
    manifest = json.loads(manifest_of(path).read_text())
    manifest["files"][".metadata"]["bytes"] = 1 << 40
    manifest_of(path).write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpoint) as err:
        _within(20, lambda: check_loadable(path))
    _one_line(err, "step_00000008.dcp: .metadata is 1099511627776 bytes, more than")


@pytest.mark.unit
@pytest.mark.parametrize("tamper, complaint", [
    ("stretch", "__0_0.distcp bytes "),
    ("unlisted", "its manifest does not list .metadata"),
])
def test_export_of_a_tampered_sharded_checkpoint_is_one_line_and_exit_2(tmp_path, tamper, complaint):
    """``ringtrain export`` reads shards through the same reader: a stretch overwritten (before: DCP's
    CheckpointException, a traceback per rank), a .metadata the manifest leaves out (before: read anyway)."""
    from tests.conftest import run_main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(REPO / "configs" / "debug_mlp.toml", run_dir / "config.toml")
    checkpointer = ShardedCheckpointer(run_dir / "checkpoints", 0, 1)
    checkpointer.save(4, {"model": {"w": torch.ones(64, 64)}}, extra={"train_state": {"step": 4}}).result()
    path = checkpointer.path_for(4)
    if tamper == "stretch":
        shard = path / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[100:140] = b"\0" * 40
        shard.write_bytes(bytes(data))
        _rewrite_manifest(path, "__0_0.distcp")
    else:
        _unlisted_metadata(path)
    done = run_main("export", str(run_dir))
    lines = [line for line in done.stderr.splitlines() if line.startswith("ringtrain")]
    assert done.returncode == 2 and len(lines) == 1 and complaint in lines[0], done.stderr
    assert not (run_dir / "model.safetensors").exists()


@pytest.mark.unit
def test_a_tampered_shard_stretch_is_one_line_naming_it(tmp_path):
    """Bytes inside a tensor's stretch overwritten, the manifest rewritten: before, DCP's CheckpointException
    with every rank's traceback (a BaseException, past ringtrain's one-line reporting)."""
    checkpointer, path = _saved_sharded(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:140] = b"\0" * 40
    shard.write_bytes(bytes(data))
    _rewrite_manifest(path, "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        checkpointer.load(path, _fresh_state())
    _one_line(err, "step_00000008.dcp: __0_0.distcp bytes ", "(entry '")
