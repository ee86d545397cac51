"""Healing across layouts (heal/replicas.py, issue 40), the parts that need no job: the agreement keeps whole
model-parallel replicas only (a lost rank's replica peers leave with it, told so with ``Spared``), and the
launcher's checks of a split model under --heal (the sizes a heal can reach, --min-nproc in whole replicas,
the strategies whose state a replica holds), and the admission of joiners by whole replicas: held until enough
are there to complete one, then admitted together; a lone one named as waiting; one that left never admitted."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ringtrain.config import load_config
from ringtrain.config.checks import validate_for_world_sizes
from ringtrain.errors import ConfigError
from ringtrain.group.jobstore import JobStore
from ringtrain.heal.membership import (
    JOINER_BASE,
    Generation,
    HealFailed,
    Membership,
    Spared,
    admit_whole_replicas,
    whole_replicas,
)
from ringtrain.heal.supervisor import Supervisor

pytestmark = pytest.mark.unit


def test_whole_replicas_keeps_only_replicas_with_every_member_present():
    members = (0, 1, 2, 3, 4, 5)
    assert whole_replicas(members, {0, 2, 3, 4, 5}, 2) == [2, 3, 4, 5]
    assert whole_replicas(members, {0, 1, 2, 4, 5}, 3) == [0, 1, 2]
    assert whole_replicas(members, {0, 2, 4, 5}, 3) == []
    assert whole_replicas(members, {0, 1, 2, 4, 5}, 1) == [0, 1, 2, 4, 5]


@pytest.fixture
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store.port
    del store


def _agree(port: int, members: tuple[int, ...], arriving: tuple[int, ...], replica_size: int) -> dict:
    """Each of ``arriving`` agrees after a failure of generation 0 (the others are lost: they withdrew)."""
    results: dict[int, object] = {}

    def member(me: int) -> None:
        membership = Membership(JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False),
                                Generation(0, members, me), timeout_s=10)
        membership.publish_failure(step=5)
        try:
            results[me] = membership.agree(applied_step=4, replica_size=replica_size)[0]
        except (Spared, HealFailed) as err:
            results[me] = err

    setup = Membership(JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False), Generation(0, members, 0), 10)
    for lost in set(members) - set(arriving):
        setup.store.set(f"join/withdrawn/{lost}", "1")  # known lost at once
    threads = [threading.Thread(target=member, args=(m,)) for m in arriving]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    return results


def test_a_lost_rank_takes_its_replica_peer_out_and_the_whole_replica_goes_on(store_port):
    results = _agree(store_port, (0, 1, 2, 3), arriving=(0, 2, 3), replica_size=2)  # rank 1 lost: replica 0
    assert results[2] == Generation(1, (2, 3), member=2) and results[3] == Generation(1, (2, 3), member=3)
    assert isinstance(results[0], Spared) and "its model-parallel replica was lost" in str(results[0])
    assert Spared.exit_code == 0


def test_no_whole_replica_left_ends_the_heal_in_one_line(store_port):
    results = _agree(store_port, (0, 1, 2, 3), arriving=(0, 3), replica_size=2)
    assert all(isinstance(r, HealFailed) and "no whole replica remains" in str(r) for r in results.values()), results


def _config(*overrides: str):
    return load_config("configs/debug_lm.toml", ["train.auto_micro_batch=false", "dist.heal=true", *overrides])


def test_a_split_model_heals_at_whole_replicas_only():
    validate_for_world_sizes(_config("parallel.tp=2"), 2, 4)  # 4 and 2 (3 is never reached)
    validate_for_world_sizes(_config("parallel.pp=2"), 2, 6)
    with pytest.raises(ConfigError, match=r"^--min-nproc 3 with a model split over 2 ranks .* set --min-nproc to a "
                                          r"multiple of 2$"):
        validate_for_world_sizes(_config("parallel.tp=2"), 3, 4)


def test_a_split_model_refuses_heal_beside_a_strategy_whose_state_is_spread_over_the_data_ranks():
    with pytest.raises(ConfigError, match=r"a split model heals by whole replicas, .* use comm.strategy = 'ddp'"):
        validate_for_world_sizes(_config("parallel.tp=2", "comm.strategy='zero2'", "checkpoint.sharded=true"), 2, 4)


def test_joiners_are_admitted_only_as_whole_replicas_as_many_as_there_is_room_for():
    # (pending joiners, replica size, room) -> (admitted now, how many more the next replica needs)
    assert admit_whole_replicas([1001], 2, room=2) == ([], 1)
    assert admit_whole_replicas([1001, 1002], 2, room=2) == ([1001, 1002], 0)
    assert admit_whole_replicas([1001, 1002, 1003], 2, room=4) == ([1001, 1002], 1)
    assert admit_whole_replicas([1001, 1002, 1003], 2, room=2) == ([1001, 1002], 0)  # no room for the next
    assert admit_whole_replicas([1001, 1002, 1003, 1004], 2, room=4) == ([1001, 1002, 1003, 1004], 0)
    assert admit_whole_replicas([1001, 1002], 4, room=4) == ([], 2)  # tp 2 x pp 2: two more
    assert admit_whole_replicas([1001, 1002], 2, room=1) == ([], 0)  # a replica does not fit: nobody waits for more
    assert admit_whole_replicas([1001, 1002, 1003], 1, room=2) == ([1001, 1002], 0)  # whole models: one at a time


def _ask_to_join(port: int) -> Membership:
    """A `ringtrain join` worker's request (as request_join makes it): its member id, then its registration."""
    joiner = Membership(JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=False), Generation(-1, (), -1), 10)
    joiner.generation = Generation(-1, (), JOINER_BASE + joiner.store.add("join/requests", 1))
    joiner.register()
    return joiner


def test_a_lone_joiner_waits_named_in_the_log_and_one_that_left_is_never_admitted(store_port, capsys):
    """Rank 0 of a tp-2 job healed down to one replica (members 2, 3 of --nproc 4) looks for joiners at each
    step boundary: one joiner is held and named as waiting for 1 more; it leaves (withdraws); two others come
    and are admitted together, never the one that left."""
    membership = Membership(JobStore("127.0.0.1", store_port, "ringtrain/test/", is_writer=False),
                            Generation(1, (2, 3), member=2), timeout_s=10)
    supervisor = Supervisor(membership, min_workers=2, max_workers=4, rebuild=None, reloads=False)
    supervisor.trainer = SimpleNamespace(ctx=SimpleNamespace(layout=SimpleNamespace(model_parallel=2)),
                                         state=SimpleNamespace(step=5), total_steps=100)

    lone = _ask_to_join(store_port)
    supervisor.at_boundary()
    assert membership.admission() is None
    assert "member 1001 asked to join: waiting for 1 more to complete a replica of 2 workers" in capsys.readouterr().err
    supervisor.at_boundary()  # nothing changed: said once
    assert capsys.readouterr().err == ""

    lone.store.set(f"join/withdrawn/{lone.generation.member}", "1")  # it left before its replica completed
    _ask_to_join(store_port)
    supervisor.trainer.state.step = 6
    supervisor.at_boundary()
    assert membership.admission() is None
    assert "member 1002 asked to join: waiting for 1 more" in capsys.readouterr().err

    _ask_to_join(store_port)
    supervisor.trainer.state.step = 7
    supervisor.at_boundary()
    assert membership.admission() == (8, [1002, 1003])  # after the next step, the pair together
