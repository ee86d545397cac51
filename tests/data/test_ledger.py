"""The exactly-once ledger: cut back to the resumed step, torn lines dropped, epochs checked."""

from __future__ import annotations

import json
import os

import pytest

from ringtrain.data.ledger import Ledger, check_ledger, read_ledger
from ringtrain.data.sampler import ResumableSampler

pytestmark = pytest.mark.unit


def record_epoch(ledger: Ledger, sampler: ResumableSampler, world_size: int, step: int, steps: int | None = None) -> int:
    """Record up to ``steps`` steps of the sampler's epoch at ``world_size`` as one process would see them."""
    shards = [sampler.iter_shards(rank, world_size) for rank in range(world_size)]
    for per_rank in zip(*shards):
        if steps is not None and steps == 0:
            break
        step += 1
        ledger.file.write(json.dumps({"step": step, "epoch": sampler.epoch, "world_size": world_size,
                                      "ids": [list(ids) for ids in per_rank], "skipped": False}) + "\n")
        sampler.advance()
        steps = None if steps is None else steps - 1
    ledger.file.flush()
    return step


def test_an_epoch_re_dealt_from_two_workers_to_one_is_exactly_once(tmp_path):
    path = tmp_path / "ledger.jsonl"
    sampler = ResumableSampler(100, global_batch_size=12, seed=0)
    ledger = Ledger(path, num_samples=100, is_writer=True)
    ledger.start(0)
    step = record_epoch(ledger, sampler, world_size=2, step=0, steps=4)
    step = record_epoch(ledger, sampler, world_size=1, step=step)
    [report] = check_ledger(path)
    assert (report.used, report.duplicates, report.missing, report.complete) == (100, 0, 0, True)
    assert report.world_sizes == (2, 1) and report.exactly_once


def test_start_cuts_the_ledger_back_to_the_resumed_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    sampler = ResumableSampler(100, global_batch_size=12, seed=0)
    ledger = Ledger(path, num_samples=100, is_writer=True)
    ledger.start(0)
    record_epoch(ledger, sampler, world_size=2, step=0, steps=6)
    ledger.file.write('{"step": 7, "epoch": 0, "wor')  # the writer died mid-line
    ledger.close()
    # The job resumes from the checkpoint of step 4: steps 5 and 6 are redone and must appear once.
    resumed = Ledger(path, num_samples=100, is_writer=True)
    resumed.start(4)
    assert [r["step"] for r in read_ledger(path) if "ids" in r] == [1, 2, 3, 4]
    sampler.set_epoch(0)
    for _ in range(4):
        sampler.advance()
    record_epoch(resumed, sampler, world_size=2, step=4)
    [report] = check_ledger(path)
    assert report.exactly_once and report.complete and report.used == 100


def test_a_repeated_window_is_a_duplicate_and_an_unfinished_last_epoch_is_not_missing(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, num_samples=10, is_writer=True)
    ledger.start(0)
    for step, epoch, ids in [(1, 0, [[0, 1, 2], [3, 4]]), (2, 0, [[0, 5, 6], [7, 8]]), (3, 0, [[5]]), (4, 1, [[1, 2]])]:
        ledger.file.write(json.dumps({"step": step, "epoch": epoch, "world_size": len(ids), "ids": ids}) + "\n")
    ledger.close()
    first, last = check_ledger(path)
    assert (first.duplicates, first.missing, first.exactly_once) == (2, 1, False)
    assert (last.complete, last.exactly_once, last.missing) == (False, True, 8)


def test_the_rewrite_at_start_is_fsynced_before_and_after_it_replaces_the_ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"type": "header", "num_samples": 10}\n{"step": 1, "epoch": 0, "world_size": 1, "ids": [[0]]}\n')
    synced, fsync = [], os.fsync  # (inode, path) of every fsync; the call still happens

    def spy(fd: int) -> None:
        synced.append((os.fstat(fd).st_ino, os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ledger = Ledger(path, num_samples=10, is_writer=True)
    ledger.start(1)
    ledger.close()
    # The file now at the ledger's name was fsynced (before the rename), and then the folder holding the name.
    assert path.stat().st_ino in [inode for inode, _ in synced], f"the rewritten ledger was not fsynced: {synced}"
    assert str(tmp_path) in [name for _, name in synced], f"the folder was not fsynced after the rename: {synced}"
    assert [r["step"] for r in read_ledger(path) if "ids" in r] == [1]
