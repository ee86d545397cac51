"""Checkpoints: committed by a manifest, verified on load, never unpickled unsafely, exported as safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ringtrain.checkpoint.export import export_model
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import manifest_path, read_verified
from ringtrain.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint


def state_for(step: int) -> dict:
    """A checkpoint-shaped state whose every tensor encodes its step, so a load can be checked."""
    return {"model": {"w": torch.full((64, 32), float(step))}, "train_state": {"step": step}, "config_digest": "d"}


def saved(tmp_path, steps=(10, 20, 30), keep_last=3) -> CheckpointManager:
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=keep_last)
    for step in steps:
        manager.save(step, state_for(step), config_sha256="d")
    return manager


@pytest.mark.unit
def test_save_writes_data_then_manifest_and_keeps_the_last_k(tmp_path):
    manager = saved(tmp_path, steps=(10, 20, 30, 40), keep_last=2)
    names = sorted(p.name for p in manager.directory.iterdir())
    assert names == ["step_00000030.manifest.json", "step_00000030.pt", "step_00000040.manifest.json", "step_00000040.pt"]
    manifest = json.loads(manifest_path(manager.path_for(40)).read_text())
    assert manifest["step"] == 40 and manifest["bytes"] == manager.path_for(40).stat().st_size
    assert manager.load(manager.path_for(40))["train_state"]["step"] == 40


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def delete_manifest(path):
    manifest_path(path).unlink()


@pytest.mark.unit
@pytest.mark.parametrize("corrupt", [flip_a_byte, truncate, delete_manifest])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, corrupt):
    manager = saved(tmp_path)
    newest = manager.path_for(30)
    corrupt(newest)
    warnings = []
    path, state = manager.load_latest(warnings.append)
    assert path == manager.path_for(20) and state["train_state"]["step"] == 20
    assert len(warnings) == 1 and str(newest) in warnings[0] and "step_00000020.pt" in warnings[0], warnings
    # Asked for by name, the broken checkpoint is an error, not a silent substitute.
    with pytest.raises(CorruptCheckpoint, match=newest.name):
        manager.load(newest)
    print(f"{corrupt.__name__}: detected, fell back to {path.name}")


@pytest.mark.unit
def test_three_corruptions_three_detections(tmp_path):
    """The issue's tally: flip a byte, truncate, delete the manifest -> 3/3 detected, each falls back."""
    detected = 0
    for index, corrupt in enumerate([flip_a_byte, truncate, delete_manifest]):
        manager = saved(tmp_path / str(index))
        corrupt(manager.path_for(30))
        warnings = []
        path, _ = manager.load_latest(warnings.append)
        detected += path == manager.path_for(20) and len(warnings) == 1
    print(f"corrupt newest checkpoint: {detected}/3 detected with fallback")
    assert detected == 3


@pytest.mark.unit
def test_no_valid_checkpoint_at_all_is_none_with_every_problem_named(tmp_path):
    manager = saved(tmp_path, steps=(10, 20))
    flip_a_byte(manager.path_for(10))
    truncate(manager.path_for(20))
    warnings = []
    assert manager.load_latest(warnings.append) is None
    assert len(warnings) == 2 and "step_00000010.pt" in warnings[1]


class _CreatesAFile:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.unit
def test_a_malicious_pickle_with_a_valid_manifest_is_refused_and_runs_nothing(tmp_path):
    manager = saved(tmp_path, steps=(10,))
    target = tmp_path / "pwned"
    evil = manager.path_for(20)
    # A forged checkpoint: the manifest only proves integrity, so the attacker writes a matching one.
    torch.save({"model": _CreatesAFile(target)}, evil)  # torch's own format, to look legitimate
    from ringtrain.checkpoint.manifest import Digest, write_manifest
    import hashlib
    payload = evil.read_bytes()
    write_manifest(evil, Digest(hashlib.sha256(payload).hexdigest(), len(payload)), step=20)
    with pytest.raises(UnsafeCheckpoint, match="io.open.*never stores") as err:
        manager.load(evil)
    assert not target.exists(), "unpickling ran the payload"
    # No silent fallback to an older checkpoint either: someone must look at it.
    with pytest.raises(UnsafeCheckpoint):
        manager.load_latest(lambda message: None)
    assert not target.exists()
    print(f"malicious checkpoint refused: {str(err.value)[:100]}...")


@pytest.mark.unit
def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        CheckpointManager(tmp_path).load(tmp_path / "step_00000001.pt")


@pytest.mark.unit
def test_stale_temp_files_of_a_crashed_save_are_removed_by_the_next_save(tmp_path):
    manager = saved(tmp_path, steps=(10,))
    stale = manager.directory / ".step_00000020.pt.tmp-12345"
    stale.write_bytes(b"half a checkpoint")
    manager.save(20, state_for(20))
    assert not stale.exists()


def fsynced_paths(monkeypatch) -> list[str]:
    """Record the path of every file or folder os.fsync is called on (the call still happens)."""
    synced, fsync = [], os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


@pytest.mark.unit
def test_a_new_checkpoints_folder_is_fsynced_in_its_parent(tmp_path, monkeypatch):
    synced = fsynced_paths(monkeypatch)
    CheckpointManager(tmp_path / "run" / "checkpoints").save(10, state_for(10))
    # Without these, a crash can lose the folder (and the committed checkpoint in it) though every file was fsynced.
    assert str(tmp_path / "run") in synced, f"checkpoints/ was not fsynced in run/: {synced}"
    assert str(tmp_path) in synced, f"run/ was not fsynced in its parent: {synced}"


@pytest.mark.unit
def test_export_writes_the_newest_valid_weights_as_safetensors(tmp_path):
    manager = saved(tmp_path)
    truncate(manager.path_for(30))
    warnings = []
    used = export_model(manager, tmp_path / "model.safetensors", warn=warnings.append)
    assert used == manager.path_for(20) and len(warnings) == 1
    weights = load_file(tmp_path / "model.safetensors")
    assert torch.equal(weights["w"], torch.full((64, 32), 20.0))
    assert read_verified(manager.path_for(20))  # exporting changed nothing


@pytest.mark.unit
def test_the_export_command_writes_safetensors_from_a_run_directory(tmp_path, capsys):
    from ringtrain.cli import main
    from ringtrain.config import load_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(load_config("configs/debug_mlp.toml", run_dir=str(run_dir)).to_toml())
    CheckpointManager(run_dir / "checkpoints").save(10, state_for(10))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "w.safetensors")]) == 0
    assert "from " + str(run_dir / "checkpoints" / "step_00000010.pt") in capsys.readouterr().out
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.full((64, 32), 10.0))
    assert main(["export", str(tmp_path / "nothing-here")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.mark.job
def test_a_writer_cut_off_while_it_saves_commits_nothing_and_its_prune_spares_a_live_writers_files(tmp_path):
    """Issue 21: after its fence check a writer can be stopped, a heal make another worker the writer, and the
    stopped one resume. Its save checks the fence again right before each file takes its name, so nothing it
    wrote becomes a checkpoint; and its prune removes only its own leftovers or a dead process's, never the
    temp files of a save in progress by the live writer."""
    import os
    import subprocess
    import sys

    from ringtrain.checkpoint.manifest import manifest_path
    from ringtrain.errors import RingtrainError

    class Fenced(RingtrainError):
        pass

    cut_off = {"after": None}

    def fence() -> None:
        if cut_off["after"] is not None:
            cut_off["after"] -= 1
            if cut_off["after"] < 0:
                raise Fenced("cut off")

    directory = tmp_path / "checkpoints"
    old_writer = CheckpointManager(directory, keep_last=1, fence=fence)
    old_writer.save(1, {"step": 1})
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        in_progress = directory / f".step_00000003.pt.tmp-{live.pid}"  # the new writer's save, under way
        leftover = directory / f".step_00000002.pt.tmp-{dead.pid}"  # a crashed writer's
        in_progress.write_bytes(b"new writer")
        leftover.write_bytes(b"crashed")
        old_writer.save(2, {"step": 2})  # not cut off yet: commits, and prunes
        assert in_progress.exists() and not leftover.exists()
        # The next save passes its first check, then the heal happens while the writer is stopped inside it.
        cut_off["after"] = 1
        with pytest.raises(Fenced):
            old_writer.save(4, {"step": 4})
        assert not (directory / "step_00000004.pt").exists() and not manifest_path(directory / "step_00000004.pt").exists()
        assert in_progress.exists()
        assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
            "step_00000002.manifest.json", "step_00000002.pt"]
        assert not any(p.name.endswith(f"tmp-{os.getpid()}") for p in directory.iterdir())
    finally:
        live.kill()
        live.wait()
