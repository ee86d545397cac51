"""Where the time of the hierarchical all-reduce goes across two test hosts: its phases, side by side.

    sudo .venv/bin/python bench/hosts_phases.py --rate 1gbit --mb 64 --iters 6
    sudo .venv/bin/python bench/hosts_phases.py --hosts 3 --rate 1gbit --mb 64 --iters 5

``--hosts`` test hosts (``ringtrain/testing/hosts.py``, default 2) x 2 ranks, each rank's main thread pinned to core ``local_rank`` as
``ringtrain bench collectives`` pins them. Every round runs, in turn, after a barrier:

- ``sequential``: the hierarchical all-reduce as it was before the two-host stream: the host sums the whole
  tensor through shared memory, the leaders all-reduce it over the ring (``ring.all_reduce``), the leader
  copies it to its host; each phase timed on each rank;
- ``current``: ``hierarchical.all_reduce`` as it is (two hosts: one stream per direction; more: the ring
  with the host's sums and copies beside its steps);
- ``wire``: the leaders' ring alone (the other ranks idle): what the link costs without any host work;
- ``gloo_leaders``: Gloo's own all-reduce between the leaders alone;
- ``flat``: Gloo's own all-reduce over every rank (what ``ringtrain bench collectives`` compares with).

Prints per mode the median over rounds of the slowest rank's wall time, the median phases per rank, and the
machine's CPU during the mode (``/proc/stat``: busy share of all cores, of which softirq: the TCP stacks of
both namespaces run on the same two cores as the ranks). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("sequential", "current", "wire", "gloo_leaders", "flat")
PORT = 29512


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def worker() -> None:
    """One rank (started by ``main`` on a test host): run the rounds, print its rows as one JSON line."""
    import torch
    import torch.distributed as dist

    from ringtrain.comm import hierarchical, ring
    from ringtrain.comm.shm_local import broadcast_from_leader, local_all_reduce
    from ringtrain.comm.shm_group import get_shm_group

    dist.init_process_group("gloo")
    sg = get_shm_group(dist.group.WORLD)
    os.sched_setaffinity(0, [sg.local_rank % os.cpu_count()])
    torch.set_num_threads(1)
    flat = torch.zeros((int(os.environ["PHASES_MB"]) << 20) // 4)
    leaders = dist.new_group(sg.leaders)
    what = "shm all_reduce (ring between hosts)"

    def sequential(stamps: list[float]) -> None:
        local_all_reduce(sg, flat, 60.0, False, divide_by=sg.size)
        stamps.append(time.monotonic())
        if sg.is_leader:
            ring.all_reduce(flat, sg.group, 60.0, members=sg.leaders, what=what)
        stamps.append(time.monotonic())
        broadcast_from_leader(sg, flat, 60.0)

    def current(stamps: list[float]) -> None:
        hierarchical.all_reduce(sg, flat, 60.0)

    def wire(stamps: list[float]) -> None:
        if sg.is_leader:
            ring.all_reduce(flat, sg.group, 60.0, members=sg.leaders, what=what)

    def gloo_leaders(stamps: list[float]) -> None:
        if sg.is_leader:
            dist.all_reduce(flat, group=leaders)

    def everyone(stamps: list[float]) -> None:
        dist.all_reduce(flat)

    calls = {"sequential": sequential, "current": current, "wire": wire, "gloo_leaders": gloo_leaders, "flat": everyone}
    rows, cpu = [], {mode: [0] * 10 for mode in MODES}
    for round_ in range(int(os.environ["PHASES_ITERS"]) + 1):  # round 0 warms up
        for mode in MODES:
            dist.barrier()
            before = _cpu_times()
            stamps = [time.monotonic()]
            calls[mode](stamps)
            stamps.append(time.monotonic())
            after = _cpu_times()
            if round_:
                rows.append({"rank": dist.get_rank(), "mode": mode, "stamps": stamps})
                cpu[mode] = [c + b - a for c, a, b in zip(cpu[mode], before, after)]
    print(json.dumps({"rows": rows, "cpu": cpu}), flush=True)
    dist.destroy_process_group()


def summarize(results: list[dict], hosts: int, per_host: int) -> str:
    rows = [row for result in results for row in result["rows"]]
    lines = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        by_rank = {r: [x for x in mine if x["rank"] == r] for r in range(hosts * per_host)}
        rounds = len(by_rank[0])
        walls = [max(by_rank[r][i]["stamps"][-1] for r in by_rank) - min(by_rank[r][i]["stamps"][0] for r in by_rank)
                 for i in range(rounds)]
        cpu = results[0]["cpu"][mode]  # rank 0's view of the whole machine, summed over its rounds
        total = sum(cpu)
        busy = 1 - (cpu[3] + cpu[4]) / total if total else 0.0  # idle + iowait
        softirq = cpu[6] / total if total else 0.0
        lines.append(f"{mode:13s} wall p50 {statistics.median(walls) * 1e3:7.1f} ms  (rounds: "
                     f"{', '.join(f'{w * 1e3:.0f}' for w in walls)})  CPU busy {busy:.0%}, softirq {softirq:.0%}")
        if mode == "sequential":
            for rank, records in by_rank.items():
                phases = [[b - a for a, b in zip(x["stamps"], x["stamps"][1:])] for x in records]
                host_sum, leaders, copy = (statistics.median(p[k] for p in phases) * 1e3 for k in range(3))
                lines.append(f"    rank {rank}: host sum {host_sum:6.1f} ms, leaders' ring {leaders:6.1f} ms "
                             f"(waiting, if not a leader), copy out {copy:6.1f} ms")
    return "\n".join(lines)


def main() -> int:
    if os.environ.get("PHASES_WORKER"):
        worker()
        return 0
    from ringtrain.testing.hosts import INTERFACE, Hosts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="test hosts of 2 ranks each (default 2)")
    parser.add_argument("--rate", default="1gbit", help="cap every link (default 1gbit)")
    parser.add_argument("--mb", type=int, default=64, help="message size in MiB of float32 (default 64)")
    parser.add_argument("--iters", type=int, default=6, help="timed rounds (default 6)")
    args = parser.parse_args()
    hosts_n, per_host = args.hosts, 2
    with Hosts.up(hosts_n, args.rate) as hosts:
        procs = []
        try:
            for i in range(hosts_n):
                for local in range(per_host):
                    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PHASES_WORKER": "1",
                           "PHASES_MB": str(args.mb), "PHASES_ITERS": str(args.iters), "MASTER_ADDR": hosts.addr(0),
                           "MASTER_PORT": str(PORT), "RANK": str(i * per_host + local),
                           "WORLD_SIZE": str(hosts_n * per_host), "GLOO_SOCKET_IFNAME": INTERFACE}
                    procs.append(hosts.popen(i, [sys.executable, __file__], env=env, cwd=REPO,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            outputs = [proc.communicate(timeout=900)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        print(f"a rank failed: exit codes {[proc.returncode for proc in procs]}", file=sys.stderr)
        return 1
    results = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    print(f"# {hosts_n} test hosts x {per_host} ranks, {args.mb} MiB float32, links {args.rate}, {args.iters} rounds")
    print(summarize(results, hosts_n, per_host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
