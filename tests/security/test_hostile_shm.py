"""/dev/shm is every local user's (issue 39, row 7): what another uid plants under a ringtrain name (a file of
theirs dated an hour ago, a symlink, a FIFO) never fails, stalls or redirects a job's shm set-up, and a name
built from a peer's ``[pid, token]`` is checked before it becomes a path (ringtrain/comm/shm_segment.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringtrain.comm.shm_segment import (
    SHM_DIR, STALE_AFTER_S, Segment, peer_segment_name, segment_name, sweep_stale, unlink,
)

MODULE = Path(__file__).resolve().parents[2] / "ringtrain" / "comm" / "shm_segment.py"
VICTIM, ATTACKER = 12345, 12346
"""Two uids nobody else on the test machine uses: the job's user and the one who plants."""

as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="planting another uid's file and sweeping as a non-root user need root and setpriv")


def _plant(name: str, owner: int, age_s: float = 3600.0, mode: int = 0o644) -> str:
    """A file under ``name`` in /dev/shm owned by ``owner``, last modified ``age_s`` ago, locked by nobody."""
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(path, mode)
    os.chown(path, owner, owner)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def _sweep_as(uid: int, timeout: float = 30) -> subprocess.CompletedProcess:
    """``sweep_stale()`` of ringtrain's module (stdlib only) in a process of ``uid``: a non-root user's job."""
    script = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('seg', sys.argv[1]); "
              "seg = importlib.util.module_from_spec(spec); spec.loader.exec_module(seg); "
              "print(json.dumps(seg.sweep_stale()))")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", script,
                           str(MODULE)], capture_output=True, text=True, timeout=timeout, cwd="/")


@pytest.mark.job
@as_root
def test_another_uids_old_file_does_not_fail_a_non_root_users_sweep_and_its_own_orphans_still_go():
    planted = _plant(segment_name(1, "0123456789ab"), owner=ATTACKER)  # an hour old, unlocked, not the victim's
    own_orphan = _plant(segment_name(2, "ba9876543210"), owner=VICTIM, mode=0o600)
    try:
        swept = _sweep_as(VICTIM)
        # Before: PermissionError (the sticky /dev/shm lets only the owner unlink), and the job failed to start.
        assert swept.returncode == 0 and "Traceback" not in swept.stderr, swept.stderr
        assert json.loads(swept.stdout) == [os.path.basename(own_orphan)]
        assert os.path.exists(planted) and not os.path.exists(own_orphan)
    finally:
        for path in (planted, own_orphan):
            unlink(os.path.basename(path))


@pytest.mark.unit
@as_root
def test_a_sweep_leaves_another_uids_files_even_as_root():
    """Root's job sweeps only root's segments: an orphan of user 12346 is 12346's to clean up."""
    theirs = _plant(segment_name(3, "00112233aabb"), owner=ATTACKER)
    try:
        assert os.path.basename(theirs) not in sweep_stale() and os.path.exists(theirs)
    finally:
        unlink(os.path.basename(theirs))


@pytest.mark.job
def test_a_fifo_under_a_ringtrain_name_does_not_stall_a_sweep():
    name = segment_name(4, "a1b2c3d4e5f6")
    path = os.path.join(SHM_DIR, name)
    os.mkfifo(path, 0o600)
    old = time.time() - STALE_AFTER_S - 60
    os.utime(path, (old, old))
    try:
        code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('seg', sys.argv[1]); "
                "seg = importlib.util.module_from_spec(spec); spec.loader.exec_module(seg); print(seg.sweep_stale())")
        # Before: open(O_RDONLY) of a FIFO waits for a writer, forever.
        swept = subprocess.run([sys.executable, "-c", code, str(MODULE)], capture_output=True, text=True, timeout=30)
        assert swept.returncode == 0 and swept.stdout.strip() == "[]", swept.stderr
        assert os.path.exists(path)
    finally:
        os.unlink(path)


@pytest.mark.unit
def test_a_symlink_planted_at_the_expected_name_is_refused_not_followed(tmp_path):
    target = tmp_path / "victim.bin"
    target.write_bytes(b"precious" * 512)
    name = segment_name(5, "feedfacecafe")
    os.symlink(target, os.path.join(SHM_DIR, name))
    try:
        with pytest.raises(OSError, match="symbolic link, refused") as refused:
            Segment.attach(name)
        assert "\n" not in str(refused.value)
        old = time.time() - STALE_AFTER_S - 60
        os.utime(os.path.join(SHM_DIR, name), (old, old), follow_symlinks=False)
        sweep_stale()
        assert target.read_bytes() == b"precious" * 512 and os.path.islink(os.path.join(SHM_DIR, name))
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.unit
@as_root
def test_a_segment_another_uid_owns_is_refused_by_attach():
    name = segment_name(6, "0badc0ffee00")
    _plant(name, owner=ATTACKER, age_s=0, mode=0o666)  # anyone may write it: the attacker reads what ranks share
    try:
        with pytest.raises(OSError, match=f"owned by uid {ATTACKER}, not this process's uid 0; refused"):
            Segment.attach(name)
    finally:
        unlink(name)


@pytest.mark.unit
def test_a_segment_of_this_uid_still_attaches():
    created = Segment.create(segment_name(), 4096)
    try:
        attached = Segment.attach(created.name)
        assert attached.size == 4096
        attached.close()
    finally:
        created.unlink()
        created.close()


@pytest.mark.unit
@pytest.mark.parametrize("announced", [
    [1234, "../../../etc/x"],          # a path out of /dev/shm
    [1234, "0123456789ab/../../x"],
    ["1234", "0123456789ab"],          # a pid that is not an int
    [True, "0123456789ab"],
    [0, "0123456789ab"],
    [-5, "0123456789ab"],
    [2**40, "0123456789ab"],
    [1234, "0123456789AB"],            # not what os.urandom(6).hex() writes
    [1234, "0123456789abc"],
    [1234, "0123456789a"],
    [1234, 12345678],
    [1234, "0123456789ab", "extra"],
    {"pid": 1234},
    "x" * 10_000,
    None,
])
def test_a_peers_bad_pid_or_token_is_refused_in_one_line(announced):
    with pytest.raises(ValueError) as refused:
        peer_segment_name(announced, "workspace", rank=3)
    message = str(refused.value)
    assert message.startswith("rank 3 announced shm segment ") and message.endswith("not a ringtrain peer; refused")
    assert "\n" not in message and len(message) < 250, message


@pytest.mark.unit
def test_a_peers_good_pid_and_token_name_the_segment_as_before():
    assert peer_segment_name([1234, "0123456789ab"], "g1-arena", rank=0) == "ringtrain-1234-0123456789ab-g1-arena"
    assert peer_segment_name([1234, "0123456789ab"], "workspace", rank=0) == segment_name(1234, "0123456789ab-workspace")
    with pytest.raises(ValueError, match="suffix"):
        peer_segment_name([1234, "0123456789ab"], "../x", rank=0)
