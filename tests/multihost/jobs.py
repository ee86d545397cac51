"""A long debug job across test hosts, one `ringtrain train` launcher per host (node 0 holds the rendezvous)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from tests.jobs import Job
from tests.hosts import Hosts

PORT = 29400


def start_node_jobs(stack: ExitStack, hosts: Hosts, run_dir: Path, timeout_s: float, count: int = 2) -> list[Job]:
    """Start node i of a ``count``-node debug MLP job in test host i (one worker each, 200 epochs: it runs
    until the test ends it, logging every step); the jobs are stopped when ``stack`` closes."""
    return [
        stack.enter_context(Job(
            "train", "configs/debug_mlp.toml", "--nproc", "1", "--nnodes", str(count), "--node-rank", str(i),
            "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}", "--local-addr", hosts.addr(i),
            "--run-dir", str(run_dir), "--set", "train.epochs=200", "--set", f"dist.timeout_s={timeout_s}",
            "--set", "monitor.log_every_steps=1", prefix=hosts.exec_prefix(i)))
        for i in range(count)
    ]
