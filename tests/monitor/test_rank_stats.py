"""The straggler statistic every logged record carries (monitor/rank_stats.py), on real ranks: the slowest rank
is the one with the most busy time, its lag the distance to the fastest, the loss summed and memory the largest,
the same answer on every rank. (test_monitoring.py sees it only through a launched job's records.)"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

BUSY_S = [0.25, 1.0, 0.5, 0.125]


def _stats(rank: int, world_size: int):
    from ringtrain.monitor.rank_stats import gather_rank_stats

    stats = gather_rank_stats(loss_sum=float(rank + 1), busy_s=BUSY_S[rank], peak_rss_mb=100.0 * (rank + 1),
                              model_state_mb=10.0 * (world_size - rank))
    return stats.slowest_rank, stats.lag_s, stats.loss_sum, stats.peak_rss_mb, stats.model_state_mb


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_straggler_is_the_busiest_rank_and_its_lag_the_gap_to_the_fastest(world_size):
    busy = BUSY_S[:world_size]
    expected = (busy.index(max(busy)), max(busy) - min(busy), float(sum(range(1, world_size + 1))),
                100.0 * world_size, 10.0 * world_size)
    assert run_distributed(_stats, world_size) == [expected] * world_size
