"""A SLURM job and a Kubeflow PyTorchJob across two test hosts (network namespaces): on each host `ringtrain train
CONFIG` with no launch flag at all, and the variables srun (SLURM_*) or the training operator (PET_*, MASTER_*)
would set on that node. The launchers find each other from the node
list (its first host is node 0) and the job id (the port), form one job, and train to the same bits as the same
job launched with explicit flags.

The node list is the hosts' addresses in SLURM's compressed form (198.18.0.[1-2]): the test hosts have no names
a resolver knows, and a real cluster's names resolve the same way through getaddrinfo."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from tests.jobs import Job
from tests.hosts import SUBNET
from tests.multihost.test_launch import CONFIG, SHORT, _launchers

pytestmark = pytest.mark.hosts

JOB_ID = "70123"
"""Its rendezvous port: 15000 + 70123 % 20000 = 25123."""


def _slurm_env(node: int, nodes: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_STEP_ID": "0", "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NODEID": str(node), "SLURM_NTASKS": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": f"1(x{nodes})", "SLURM_JOB_NODELIST": f"{SUBNET}.[1-{nodes}]",
            "SLURM_LOCALID": "0", "SLURM_PROCID": str(node)}


def _pytorchjob_env(node: int, nodes: int, master: str) -> dict[str, str]:
    """What the training operator gives a pod of an elastic-style PyTorchJob (one launcher per pod)."""
    return {"PET_NNODES": str(nodes), "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": master, "PET_MASTER_PORT": "23456",
            "PET_NPROC_PER_NODE": "1", "MASTER_ADDR": master, "MASTER_PORT": "23456", "WORLD_SIZE": str(nodes),
            "RANK": str(node)}


def _run(jobs: list[Job]) -> None:
    with ExitStack() as stack:
        for job in jobs:
            stack.enter_context(job)
        for job in jobs:
            assert job.finish(timeout=150) == 0, job.stderr


def test_two_slurm_nodes_and_two_pytorchjob_pods_form_one_job_from_the_environment_alone(make_hosts, tmp_path):
    hosts = make_hosts(2)
    slurm_dir, flags_dir = tmp_path / "slurm", tmp_path / "flags"
    by_env = [Job("train", CONFIG, "--run-dir", str(slurm_dir), *SHORT, env=_slurm_env(i, 2),
                  prefix=hosts.exec_prefix(i)) for i in range(2)]
    _run(by_env)
    for i, job in enumerate(by_env):
        assert (f"ringtrain: SLURM job {JOB_ID}: 2 nodes, node rank {i}, 1 worker per node, rendezvous "
                f"{hosts.addr(0)}:25123") in job.stderr.splitlines(), job.stderr
    k8s_dir = tmp_path / "pytorchjob"
    by_operator = [Job("train", CONFIG, "--run-dir", str(k8s_dir), *SHORT, env=_pytorchjob_env(i, 2, hosts.addr(0)),
                       prefix=hosts.exec_prefix(i)) for i in range(2)]
    _run(by_operator)
    for i, job in enumerate(by_operator):
        assert f"ringtrain: PyTorchJob: 2 nodes, node rank {i}" in job.stderr, job.stderr
    _run(_launchers(hosts, 1, flags_dir))
    by_flags = json.loads((flags_dir / "summary.json").read_text())
    for found in (slurm_dir, k8s_dir):
        got = json.loads((found / "summary.json").read_text())
        assert got["world_size"] == 2 and got["param_sha256"] == by_flags["param_sha256"], found.name
