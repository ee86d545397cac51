"""The product as a user runs it: `ringtrain train`, plain torchrun, two nodes on one host, resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from ringtrain.data.ledger import check_ledger
from tests.jobs import Job, assert_loopback_only
from tests.conftest import REPO, run_cli, run_clis
from tests.distributed import run_distributed
from tests.runs import summary
from tests.trainers import train_uninterrupted

pytestmark = pytest.mark.job


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_job_on_two_workers_reaches_97_percent(tmp_path):
    run_dir = tmp_path / "run"
    # Chaos 11 rides along: every socket the job listens on, sampled while it runs, is on loopback.
    with Job("train", "configs/digits_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir), watch_sockets=True) as job:
        code = job.finish()
    result = subprocess.CompletedProcess(job.process.args, code, "".join(job.stdout), job.stderr)
    assert result.returncode == 0, result.stderr
    assert_loopback_only(job.listening, "default run")
    got = summary(run_dir)
    print(f"default job: accuracy {got['eval']['accuracy']:.4f}, {got['samples_per_s']:.0f} samples/s, "
          f"{got['wall_s']:.2f} s of training")
    assert got["world_size"] == 2
    assert got["eval"]["accuracy"] >= 0.97
    assert got["steps"] == 40 * 23 and got["epochs"] == 40
    assert "ringtrain summary" in result.stdout and "eval.accuracy" in result.stdout
    records = metrics(run_dir)
    train_records = [r for r in records if r["type"] == "train"]
    for key in ("step", "epoch", "loss", "lr", "samples_per_s", "step_time_s"):
        assert key in train_records[0]
    assert train_records[-1]["loss"] < train_records[0]["loss"] / 10
    assert (run_dir / "config.toml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step_00000920.pt"


def test_same_job_under_plain_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "ringtrain.worker", "configs/debug_mlp.toml", "--run-dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert summary(run_dir)["world_size"] == 2


def test_two_nodes_on_one_host(tmp_path):
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["train", "configs/debug_mlp.toml", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
            "--run-dir", str(run_dir)]
    node0 = subprocess.Popen([sys.executable, "-m", "ringtrain", *args, "--node-rank", "0"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    node1 = run_cli(*args, "--node-rank", "1")
    out0, err0 = node0.communicate(timeout=180)
    assert node1.returncode == 0, node1.stderr
    assert node0.returncode == 0, err0
    assert summary(run_dir)["world_size"] == 2


def _a_second_address() -> str | None:
    """An IPv4 address of this machine besides loopback (None: only loopback here)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def test_rank_0_runs_on_node_0_whatever_the_addresses_sort_to(tmp_path):
    """Issue 41's hostfile row ("rank 0's lines prefixed with the second host"): torch's rendezvous ranked nodes by
    their address, so node 1 at the address that sorts first held global rank 0. Node 0's launcher, here at the
    address that sorts last, prints rank 0's summary; node 1's does not."""
    other = _a_second_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    first, last = sorted(["127.0.0.1", other])
    with socket.socket() as probe:
        probe.bind((last, 0))
        port = probe.getsockname()[1]
    args = ["train", "configs/debug_mlp.toml", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"{last}:{port}",
            "--run-dir", str(tmp_path / "run"), "--set", "train.max_steps=3"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start(rank: int, addr: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "ringtrain", *args, "--node-rank", str(rank), "--local-addr",
                                 addr], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    # Node 1 first, from loopback: it is refused until node 0's launcher listens, and must wait for it (the CI
    # failure of 2026-12-07: it took the refusal for "loopback cannot reach that address" and quit).
    node_1 = start(1, first)
    time.sleep(1)
    nodes = [start(0, last), node_1]
    deadline = time.monotonic() + 240
    while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        if any(node.returncode not in (None, 0) for node in nodes):
            break  # one node failed: the other would wait for it until its rendezvous timeout
        time.sleep(0.2)
    for node in nodes:
        if node.poll() is None:
            node.kill()
    (out0, err0), (out1, err1) = [node.communicate() for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], (err0, err1)
    assert "ringtrain summary" in out0 and "ringtrain summary" not in out1, (out0, out1)


def test_corrupt_newest_checkpoint_is_skipped_on_resume_with_a_warning_naming_it(tmp_path):
    """Chaos 4 as a user meets it: the newest checkpoint truncated; --resume warns, names it and the
    checkpoint used instead, and finishes the run from there."""
    run_dir = tmp_path / "run"
    common = ["train", "configs/debug_mlp.toml", "--nproc", "1", "--run-dir", str(run_dir)]
    # The run to resume, made in-process (the same trainer) to save a launch.
    run_distributed(train_uninterrupted, 1, "configs/debug_mlp.toml", ["train.max_steps=40"], str(run_dir))
    newest = run_dir / "checkpoints" / "step_00000040.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    result = run_cli(*common, "--resume")
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if "warning" in line)
    assert str(newest) in warning and "step_00000030.pt" in warning, warning
    assert "resumed from step_00000030.pt (step 30)" in result.stderr
    assert summary(run_dir)["steps"] == 46


def test_a_global_batch_that_does_not_divide_trains_at_every_world_size_of_the_range(tmp_path):
    """Issue 21: refused before ("must be divisible by local_batch_size (32) * world_size (2)"), both jobs now
    train, each step's window dealt unevenly where it does not divide, every sample once."""
    elastic, fixed = tmp_path / "elastic", tmp_path / "fixed"
    one_epoch = ["--set", "train.epochs=1", "--set", "data.ledger=true", "--set", "monitor.eval_every_epochs=0"]
    results = run_clis(
        ["train", "configs/digits_mlp.toml", "--nproc", "3", "--min-nproc", "2", "--set", "train.global_batch_size=96",
         *one_epoch, "--run-dir", str(elastic)],
        ["train", "configs/digits_mlp.toml", "--nproc", "3", "--set", "train.global_batch_size=128", *one_epoch,
         "--run-dir", str(fixed)],
    )
    for run_dir, result, global_batch in ((elastic, results[0], 96), (fixed, results[1], 128)):
        assert result.returncode == 0, result.stderr
        got = summary(run_dir)
        assert got["world_size"] == 3 and got["steps"] == -(-1437 // global_batch)
        [epoch] = check_ledger(run_dir / "ledger.jsonl")
        assert epoch.exactly_once and epoch.complete and epoch.missing == 0 and epoch.world_sizes == (3,)
        steps = [r for r in map(json.loads, (run_dir / "ledger.jsonl").read_text().splitlines()) if "ids" in r]
        shares = [len(ids) for ids in steps[0]["ids"]]
        assert shares == ([32, 32, 32] if global_batch == 96 else [43, 43, 42]), shares
