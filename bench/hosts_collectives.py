"""`ringtrain bench collectives` across test hosts: network namespaces on this machine, links capped with tc.

    sudo .venv/bin/python bench/hosts_collectives.py --hosts 2 --nproc 2 --rate 1gbit \\
        --sizes 1M,4M,16M,64M --iters 5 --out bench-out/hosts-2x2-1gbit

Makes ``--hosts`` namespaces (``ringtrain/testing/hosts.py``: a veth each into one bridge, 198.18.0.x, a ``tbf`` cap of
``--rate`` on every link, both directions), runs ``ringtrain bench collectives --nnodes H --node-rank R`` in
each with ``--nproc`` workers, prints node 0's table (which writes ``--out``) and removes the namespaces.
Other flags go to ``ringtrain bench collectives`` as they are. Needs root.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringtrain.testing.hosts import Hosts  # noqa: E402 - the repository's own test hosts

PORT = 29500


def run(hosts: int, nproc: int, rate: str | None, bench_args: list[str], timeout_s: float = 3600) -> int:
    """Run the benchmark on ``hosts`` fresh test hosts; node 0's output goes to stdout; return its exit code."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with Hosts.up(hosts, rate) as test_hosts:
        procs = []
        try:
            for i in range(hosts):
                command = [sys.executable, "-m", "ringtrain", "bench", "collectives", "--nnodes", str(hosts),
                           "--node-rank", str(i), "--nproc", str(nproc), "--rdzv-endpoint",
                           f"{test_hosts.addr(0)}:{PORT}", "--local-addr", test_hosts.addr(i), *bench_args]
                procs.append(test_hosts.popen(i, command, cwd=REPO, env=env,
                                              stdout=None if i == 0 else subprocess.DEVNULL))
            codes = [proc.wait(timeout=timeout_s) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return max(codes, key=abs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="test hosts (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="workers per host (default 2)")
    parser.add_argument("--rate", help="cap every link, e.g. 1gbit or 100mbit (default: uncapped)")
    args, bench_args = parser.parse_known_args()
    print(f"# {args.hosts} test hosts x {args.nproc} workers, links {args.rate or 'uncapped'}", flush=True)
    return run(args.hosts, args.nproc, args.rate, bench_args)


if __name__ == "__main__":
    sys.exit(main())
