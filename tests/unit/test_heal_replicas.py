"""Healing across layouts (heal/replicas.py, issue 40), the parts that need no job: the agreement keeps whole
model-parallel replicas only (a lost rank's replica peers leave with it, told so with ``Spared``), and the
launcher's checks of a split model under --heal (the sizes a heal can reach, --min-nproc in whole replicas,
the strategies whose state a replica holds)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ringtrain.config import load_config
from ringtrain.config.checks import validate_for_world_sizes
from ringtrain.errors import ConfigError
from ringtrain.group.jobstore import JobStore
from ringtrain.heal.membership import Generation, HealFailed, Membership, Spared, whole_replicas


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
