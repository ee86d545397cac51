"""Chaos: seeded random schedules of overlapping failures under --heal (tests/heal/random_chaos.py), a few
fixed seeds; bench/heal_chaos.py runs many. Each seed's job must hold every invariant: exit 0 while
--min-nproc workers live, the launcher returns, every sample and step exactly once, equal parameters, every
committed checkpoint verifies and loads, nothing of the job left running or in /dev/shm.

- seed 0: 4 workers (ddp, torch's all-reduce), the writer killed inside the epoch-end evaluation, then rank 3
  after the heal's decision, before its group forms; a joiner waits and is admitted once there is room.
- seed 1: 3 workers (manual, ring): rank 2 stopped past dist.timeout_s (cut off, continued later: it must
  write nothing), rank 1 killed once the next group formed, before the state comparison.
- seed 7: 4 workers (zero2, background sharded saves): rank 3 killed after a step's ledger gather, rank 1
  stopped: two reloads from sharded checkpoints.
"""

from __future__ import annotations

import pytest

from tests.heal.random_chaos import Schedule, check, run_schedule

# Alone still: random_chaos.py's jobs run with dist.timeout_s 8 s, every collective's timeout too (a live worker
# starved beside other tests could break a group with no one lost), and continue a stopped worker 4 s after it.
pytestmark = [pytest.mark.job, pytest.mark.exclusive]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_random_schedule_of_overlapping_failures_keeps_every_invariant(tmp_path, seed):
    schedule = Schedule.from_seed(seed)
    outcome = run_schedule(schedule, tmp_path)
    problems = check(outcome)
    print(f"{schedule.describe()}\n  -> exit {outcome.code} in {outcome.seconds:.0f} s, faults fired {outcome.fired}, "
          f"problems: {problems or 'none'}")
    assert not problems, "\n".join([schedule.describe(), *problems, outcome.stderr[-6000:]])
