"""A SLURM job across two test hosts (network namespaces): on each host `ringtrain train CONFIG` with no launch
flag at all, and the SLURM_* variables srun would set on that node. The launchers find each other from the node
list (its first host is node 0) and the job id (the port), form one job, and train to the same bits as the same
job launched with explicit flags.

The node list is the hosts' addresses in SLURM's compressed form (198.18.0.[1-2]): the test hosts have no names
a resolver knows, and a real cluster's names resolve the same way through getaddrinfo."""

from __future__ import annotations

import json
from contextlib import ExitStack

from tests.chaos.jobs import Job
from tests.hosts import SUBNET
from tests.multihost.test_launch import CONFIG, SHORT, _launchers

JOB_ID = "70123"
"""Its rendezvous port: 15000 + 70123 % 20000 = 25123."""


def _slurm_env(node: int, nodes: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_STEP_ID": "0", "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NODEID": str(node), "SLURM_NTASKS": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": f"1(x{nodes})", "SLURM_JOB_NODELIST": f"{SUBNET}.[1-{nodes}]",
            "SLURM_LOCALID": "0", "SLURM_PROCID": str(node)}


def _run(jobs: list[Job]) -> None:
    with ExitStack() as stack:
        for job in jobs:
            stack.enter_context(job)
        for job in jobs:
            assert job.finish(timeout=150) == 0, job.stderr


def test_two_slurm_nodes_form_one_job_from_the_environment_alone(make_hosts, tmp_path):
    hosts = make_hosts(2)
    slurm_dir, flags_dir = tmp_path / "slurm", tmp_path / "flags"
    by_env = [Job("train", CONFIG, "--run-dir", str(slurm_dir), *SHORT, env=_slurm_env(i, 2),
                  prefix=hosts.exec_prefix(i)) for i in range(2)]
    _run(by_env)
    for i, job in enumerate(by_env):
        assert (f"ringtrain: SLURM job {JOB_ID}: 2 nodes, node rank {i}, 1 worker per node, rendezvous "
                f"{hosts.addr(0)}:25123") in job.stderr.splitlines(), job.stderr
    _run(_launchers(hosts, 1, flags_dir))
    by_slurm = json.loads((slurm_dir / "summary.json").read_text())
    by_flags = json.loads((flags_dir / "summary.json").read_text())
    assert by_slurm["world_size"] == 2 and by_slurm["param_sha256"] == by_flags["param_sha256"]
