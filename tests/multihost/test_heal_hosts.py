"""--heal across test hosts with DiLoCo replicas of several workers (issue 40): two hosts of two workers each,
``diloco.inner`` left at 'auto', so each host's workers are one replica (DDP inside it, the leaders exchanging
pseudo-gradients). A worker of host 1 is lost between outer steps: the survivors heal in place from the last
outer step, the replicas are formed again from the survivors' hosts (host 0's two workers, host 1's one), the job
ends with exit 0 on one model, every sample used once."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from tests.faults import Fault, fault_plan
from tests.heal.test_heal_compound import assert_exactly_once, sets
from tests.jobs import Job, records
from tests.runs import summary

pytestmark = pytest.mark.hosts

PORT = 29400
H = 5


def test_a_worker_lost_from_a_hosts_replica_is_healed_and_the_replicas_form_again(make_hosts, tmp_path):
    hosts = make_hosts(2)
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, Fault("step.micro_batch", member=3, step=8))
    args = ["configs/digits_mlp.toml", "--nproc", "2", "--min-nproc", "1", "--nnodes", "2", "--heal",
            "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}", "--run-dir", str(run_dir), *sets(epochs=1),
            "--set", "comm.strategy=diloco", "--set", f"diloco.sync_every={H}", "--set", "comm.algorithm=shm"]
    with ExitStack() as stack:
        jobs = [stack.enter_context(Job("train", *args, "--node-rank", str(i), "--local-addr", hosts.addr(i),
                                        env=plan.env, prefix=hosts.exec_prefix(i)))
                for i in range(2)]
        codes = [job.finish(timeout=300) for job in jobs]
    assert codes == [0, 0], "\n".join(job.stderr for job in jobs)
    assert plan.fired_points() == ["step.micro_batch"], plan.fired_points()
    heals = records(run_dir, "heal")
    print(f"heals: {[(h['step'], h['lost_ranks'], h['world_size'], h['inner_steps_dropped']) for h in heals]}")
    # Step 8 failed (7 applied): the inner steps since the outer step of step 5 are dropped.
    assert [(h["step"], h["world_size"], h["inner_steps_dropped"]) for h in heals] == [(8, 3, 2)], heals
    done = summary(run_dir)
    # After the heal: host 0's two workers are one replica, host 1's survivor another; one model at the end.
    assert done["world_size"] == 3 and done["diloco_replicas"] == 2, done
    assert len(done["param_sha256"]) == 3 and len(set(done["param_sha256"])) == 1, done
    assert_exactly_once(run_dir, epochs=1)
