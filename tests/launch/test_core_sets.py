"""Which cores a worker's compute threads may use: disjoint sets where the host has enough cores."""

from __future__ import annotations

import pytest

from ringtrain.host.pinning import cores_for_worker

pytestmark = pytest.mark.unit


def test_two_threads_per_worker_get_disjoint_pairs_of_the_allowed_cores():
    allowed = [2, 3, 4, 5, 8, 9, 10, 11]  # what the host lets this job use, not always 0..n-1
    warnings: list[str] = []
    pairs = [cores_for_worker(host_rank, 2, 2, allowed, warnings.append) for host_rank in range(2)]
    quads = [cores_for_worker(host_rank, 2, 4, allowed, warnings.append) for host_rank in range(2)]
    assert pairs == [[2, 3], [4, 5]]
    assert quads == [[2, 3, 4, 5], [8, 9, 10, 11]]
    assert warnings == []


def test_more_threads_than_cores_share_them_and_say_so_once_per_host():
    warnings: list[str] = []
    sets = [cores_for_worker(host_rank, 2, 2, [0, 1], warnings.append) for host_rank in range(2)]
    assert sets == [[0, 1], [0, 1]]
    assert warnings == ["2 workers x 2 threads_per_worker need 4 cores, this host allows 2: threads will share "
                        "cores; set dist.threads_per_worker = 1"]


def test_one_thread_per_worker_keeps_the_round_robin_over_cores():
    warnings: list[str] = []
    assert [cores_for_worker(host_rank, 3, 1, [0, 1], warnings.append) for host_rank in range(3)] == [[0], [1], [0]]
    assert warnings == []
