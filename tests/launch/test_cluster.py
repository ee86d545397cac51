"""ringtrain/cluster.py: SLURM node lists, and the launch flags a scheduler's variables fill in (SLURM under srun,
Kubeflow's PyTorchJob); flags given win, and a flag that contradicts the allocation is one line, exit 2."""

from __future__ import annotations

import pytest

from ringtrain.cluster import LaunchFlags, NodelistError, expand_nodelist, fill_launch_flags, slurm_port
from ringtrain.errors import LaunchError
from ringtrain.group.env import cluster_environ
from tests.conftest import run_cli


@pytest.mark.unit
@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-003]-ib", ["gpu-001-ib", "gpu-002-ib", "gpu-003-ib"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[3],login, y[5-6]", ["x3", "login", "y5", "y6"]),
    ("198.18.0.[1-2]", ["198.18.0.1", "198.18.0.2"]),
])
def test_nodelists_as_slurm_prints_them(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.unit
@pytest.mark.parametrize("text, says", [
    ("node[01-04", "never closed"),
    ("node01-04]", "closes nothing"),
    ("node[[1-2]]", "nested"),
    ("node[a-b]", "not a number"),
    ("node[4-2]", "backwards"),
    ("node[]", "not a number"),
    ("a,,b", "empty host name"),
    ("", "empty host name"),
])
def test_bad_nodelists_say_what_is_wrong(text, says):
    with pytest.raises(NodelistError, match=says):
        expand_nodelist(text)


def slurm(**extra) -> dict[str, str]:
    """Node 1 of a 2-node `srun --ntasks-per-node=1` step of job 98765."""
    env = {"SLURM_JOB_ID": "98765", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)",
           "SLURM_JOB_NODELIST": "gpu-[007-008]-ib", "SLURM_LOCALID": "0", "SLURM_PROCID": "1"}
    return {**env, **extra}


@pytest.mark.unit
def test_slurm_fills_nodes_rank_and_rendezvous():
    filled = fill_launch_flags(LaunchFlags(), slurm())
    assert filled.flags == LaunchFlags(nproc=1, nnodes="2", node_rank=1, rdzv_endpoint="gpu-007-ib:33765")
    assert slurm_port("98765") == 15000 + 98765 % 20000 == 33765
    assert filled.line == "ringtrain: SLURM job 98765: 2 nodes, node rank 1, 1 worker per node, rendezvous gpu-007-ib:33765"
    assert filled.slurm


@pytest.mark.unit
def test_a_job_steps_own_view_comes_first():
    """srun on part of the allocation: SLURM_STEP_* name the step's nodes."""
    env = slurm(SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu-[010-011]-ib", SLURM_NNODES="4",
                SLURM_JOB_NUM_NODES="4", SLURM_JOB_NODELIST="gpu-[007-010]-ib", SLURM_TASKS_PER_NODE="1(x4)")
    assert fill_launch_flags(LaunchFlags(), env).flags.rdzv_endpoint == "gpu-010-ib:33765"


@pytest.mark.unit
def test_flags_given_win_over_slurm():
    given = LaunchFlags(nproc=4, nnodes="2", node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    filled = fill_launch_flags(given, slurm())
    assert filled.flags == given
    assert filled.line.endswith("node rank 1, 4 workers per node, rendezvous 10.0.0.1:29400")


@pytest.mark.unit
def test_nnodes_1_trains_on_this_node_alone_but_sigusr1_still_saves():
    filled = fill_launch_flags(LaunchFlags(nnodes="1"), slurm())
    assert filled.flags == LaunchFlags(nproc=1, nnodes="1", node_rank=0, rdzv_endpoint=None)
    assert filled.line is None and filled.slurm


@pytest.mark.unit
@pytest.mark.parametrize("flags, env, says", [
    (LaunchFlags(nnodes="3"), slurm(), "--nnodes 3 but the SLURM job 98765 has 2 nodes"),
    (LaunchFlags(node_rank=0), slurm(), "--node-rank 0 but the SLURM job 98765 says this is node 1"),
    (LaunchFlags(), slurm(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="2(x2)"),
     "srun started 4 tasks on 2 nodes.*one task per node"),
    # --ntasks 4 without --ntasks-per-node: SLURM spreads them, no SLURM_NTASKS_PER_NODE.
    (LaunchFlags(), {k: v for k, v in slurm(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="3,1").items()
                     if k != "SLURM_NTASKS_PER_NODE"}, "srun started 4 tasks on 2 nodes"),
    (LaunchFlags(), {k: v for k, v in slurm().items() if k not in ("SLURM_STEP_ID",)}, "not started by srun"),
    (LaunchFlags(), slurm(SLURM_JOB_NODELIST="gpu-[007-009]-ib"), "names 3 hosts, SLURM_NNODES says 2"),
    (LaunchFlags(), slurm(SLURM_JOB_NODELIST="gpu-[007-008-ib"), "never closed"),
    (LaunchFlags(), {"PET_NNODES": "2", "PET_NODE_RANK": "0"}, "PyTorchJob: the master's address and port"),
])
def test_flags_that_contradict_the_allocation_are_one_error(flags, env, says):
    with pytest.raises(LaunchError, match=says):
        fill_launch_flags(flags, env)


@pytest.mark.unit
def test_one_node_slurm_and_no_scheduler_change_nothing():
    one = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "n1"}
    for env in (one, {}, {"MASTER_ADDR": "10.0.0.1"}, {**slurm(), "RINGTRAIN_CLUSTER": "none"}):
        filled = fill_launch_flags(LaunchFlags(), env)
        assert filled.flags == LaunchFlags(nproc=1, nnodes="1", node_rank=0) and filled.line is None
    assert fill_launch_flags(LaunchFlags(), one).slurm and not fill_launch_flags(LaunchFlags(), {}).slurm


@pytest.mark.unit
def test_pytorchjob_elastic_variables():
    env = {"PET_NNODES": "1:3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "12",
           "RANK": "2"}
    filled = fill_launch_flags(LaunchFlags(), env)
    assert filled.flags == LaunchFlags(nproc=4, nnodes="1:3", node_rank=2, rdzv_endpoint="job-master-0:23456")
    assert filled.line == "ringtrain: PyTorchJob: 1:3 nodes, node rank 2, 4 workers per node, rendezvous job-master-0:23456"
    assert not filled.slurm
    # nprocPerNode "auto": the workers per node stay ringtrain's (--nproc, default 1).
    assert fill_launch_flags(LaunchFlags(nproc=2), {**env, "PET_NPROC_PER_NODE": "auto"}).flags.nproc == 2
    assert fill_launch_flags(LaunchFlags(), {**env, "PET_NPROC_PER_NODE": "auto"}).flags.nproc == 1


@pytest.mark.unit
def test_pytorchjob_master_and_workers():
    """No elastic policy: WORLD_SIZE pods, RANK this pod's index (one launcher per pod)."""
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}
    filled = fill_launch_flags(LaunchFlags(nproc=2), env)
    assert filled.flags == LaunchFlags(nproc=2, nnodes="3", node_rank=1, rdzv_endpoint="job-master-0:23456")
    with pytest.raises(LaunchError, match="--node-rank 0 but the PyTorchJob says this is node 1"):
        fill_launch_flags(LaunchFlags(node_rank=0), env)


@pytest.mark.unit
def test_the_environment_is_read_in_group_env_only():
    env = cluster_environ({**slurm(), "PET_NNODES": "2", "HOME": "/root", "MASTER_ADDR": "m", "RANK": "0",
                           "CUDA_VISIBLE_DEVICES": "0"})
    assert "HOME" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert env["SLURM_JOB_ID"] == "98765" and env["PET_NNODES"] == "2" and env["MASTER_ADDR"] == "m"


@pytest.mark.job
def test_the_cli_says_a_disagreement_in_one_line_with_exit_2(tmp_path):
    result = run_cli("train", "configs/debug_mlp.toml", "--nnodes", "3", "--run-dir", str(tmp_path / "run"),
                     env=slurm(), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "ringtrain: error: --nnodes 3 but the SLURM job 98765 has 2 nodes: drop --nnodes (it is read from the "
        "allocation) or ask the scheduler for that many nodes"]
    assert not (tmp_path / "run").exists()
