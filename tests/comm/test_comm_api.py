"""ringtrain.comm without processes: the shard cut, one-line errors for bad input, stale segment clean-up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain import comm
from ringtrain.comm.shards import chunk_bounds
from ringtrain.comm.shm_group import cgroup_cpu_limit
from ringtrain.comm.shm_segment import (
    PREFIX, SHM_DIR, STALE_AFTER_S, Segment, segment_name, sweep_dead, sweep_stale, unlink,
)
from ringtrain.config import load_config
from ringtrain.errors import ConfigError


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 10_000), world_size=st.integers(1, 9), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_shards_cover_the_tensor_in_order_on_cache_line_boundaries(numel, world_size, itemsize):
    dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]
    bounds = comm.tensor_shards(torch.empty(numel, dtype=dtype), world_size)
    assert len(bounds) == world_size
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (lo, hi), (next_lo, _) in zip(bounds, bounds[1:]):
        assert lo <= hi == next_lo
        assert (lo * itemsize) % 64 == 0 or lo == numel
    lengths = [hi - lo for lo, hi in bounds]
    assert lengths == sorted(lengths, reverse=True), "only trailing shards may be short"


@pytest.mark.unit
def test_chunks_cover_a_range():
    assert chunk_bounds(3, 13, 4) == [(3, 7), (7, 11), (11, 13)]
    assert chunk_bounds(5, 5, 4) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool)), "dtype torch.bool is not supported; use a floating-point or integer"),
        (lambda: comm.all_reduce(torch.ones(2), op="max"), "op='max' is not supported; use 'sum' or 'avg'"),
        (lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"), "op='avg' needs a floating-point tensor, got torch.int64; use op='sum'"),
        (lambda: comm.all_reduce(torch.ones(2), algorithm="rign"), "algorithm='rign' is unknown; choose one of torch, ring, ring_chunked, shm"),
        (lambda: comm.all_reduce(torch.ones(2, device="meta"), algorithm="shm"), "algorithm='shm' needs CPU tensors"),
        (lambda: comm.all_reduce(torch.ones(2), algorithm="ring", chunk_kb=64), "chunk_kb applies to algorithm='ring_chunked' only"),
        (lambda: comm.reduce_scatter(torch.ones(4, 4).t()), "needs a contiguous tensor; call .contiguous() first"),
        (lambda: comm.all_reduce([1.0, 2.0]), "needs a torch.Tensor, got list"),
        (lambda: comm.all_reduce(torch.ones(4).as_strided((3, 2), (1, 1))), "elements of this tensor overlap in memory (as_strided?); pass tensor.clone()"),
        (lambda: comm.all_reduce(torch.ones(2)), "needs an initialised process group; call torch.distributed.init_process_group"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(call, fragment):
    with pytest.raises((TypeError, ValueError, RuntimeError)) as caught:
        call()
    message = str(caught.value)
    assert fragment in message and "\n" not in message, message


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)


def _create_and_die(name: str) -> None:
    """A set-up that crashed: a process creates the segment with ringtrain's code and exits, leaving the name."""
    module = Path(__file__).resolve().parents[2] / "ringtrain" / "comm" / "shm_segment.py"
    script = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('seg', sys.argv[1]); "
        "seg = importlib.util.module_from_spec(spec); spec.loader.exec_module(seg); seg.Segment.create(sys.argv[2], 4096)"
    )
    subprocess.run([sys.executable, "-c", script, str(module), name], check=True)


@pytest.mark.job
def test_orphaned_segments_are_swept_and_live_ones_kept_whatever_pid_their_name_carries():
    orphan = segment_name(_dead_pid())
    _create_and_die(orphan)
    # Live, created here, but named with a pid this process cannot see: what a job in another container
    # (another pid namespace) sharing /dev/shm looks like. Before, the sweep unlinked it mid-set-up.
    live_elsewhere = Segment.create(segment_name(_dead_pid()), 4096)
    live_here = Segment.create(segment_name(), 4096)
    young_orphan = segment_name(_dead_pid())
    _create_and_die(young_orphan)
    try:
        old = time.time() - STALE_AFTER_S - 5
        for name in (orphan, live_elsewhere.name, live_here.name):
            os.utime(os.path.join(SHM_DIR, name), (old, old))
        removed = sweep_stale()
        names = os.listdir(SHM_DIR)
        assert orphan in removed and orphan not in names
        assert live_elsewhere.name in names and live_here.name in names
        assert young_orphan in names, "an unlocked segment younger than STALE_AFTER_S may be mid-creation"
    finally:
        for segment in (live_elsewhere, live_here):
            segment.unlink()
            segment.close()
        for name in (orphan, young_orphan):
            unlink(name)
    assert not any(n in os.listdir(SHM_DIR) for n in (orphan, young_orphan, live_elsewhere.name, live_here.name))
    assert orphan.startswith(PREFIX)


@pytest.mark.job
def test_segments_dead_peers_left_named_are_swept_at_once_and_locked_ones_kept():
    """Healing (shm_group.destroy): what a peer that died in a set-up left in /dev/shm goes at once, by its pid."""
    dead = _dead_pid()
    left = segment_name(dead)
    _create_and_die(left)
    held = Segment.create(segment_name(dead, "held"), 4096)  # that pid reused by a live creator: its lock keeps it
    try:
        assert sweep_dead([dead, os.getpid()]) == [left]
        names = os.listdir(SHM_DIR)
        assert left not in names and held.name in names
    finally:
        held.unlink()
        held.close()
        unlink(left)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.unit
@pytest.mark.parametrize(
    "proc_cgroup, files, cpus",
    [
        # v2: the job's cgroup allows 1.5 CPUs, its parent 4: the tighter one counts.
        ("0::/job/worker\n", {"job/cpu.max": "400000 100000\n", "job/worker/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/job\n", {"unified/job/cpu.max": "max 100000\n"}, None),  # hybrid mount, no quota
        ("4:memory:/x\n1:cpu,cpuacct:/job\n0::/\n",  # v1, as docker sets it
         {"cpu,cpuacct/job/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, 2.0),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ],
    ids=["v2-nested", "v2-unlimited", "v1-quota", "v1-unlimited"],
)
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path, proc_cgroup, files, cpus):
    _tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(proc_cgroup)
    assert cgroup_cpu_limit(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == cpus


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["comm.strategy=manual", "comm.algorithm=powersgd"], "algorithm 'powersgd' is one of torch's DDP hooks; use strategy = 'ddp'"),
        (["comm.algorithm=shm", "dist.backend=nccl"], "comm.algorithm = 'shm' reduces CPU tensors"),
        (["comm.algorithm=nccl_ring"], "comm.algorithm"),
        (["comm.powersgd_rank=0"], "comm.powersgd_rank = 0"),
        (["comm.chunk_kb=0"], "comm.chunk_kb = 0"),
    ],
)
def test_comm_config_mistakes_are_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as caught:
        load_config(Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml", overrides)
    assert fragment in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
