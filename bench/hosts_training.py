"""Training across test hosts: throughput and scaling efficiency per gradient algorithm, over capped links.

    sudo .venv/bin/python bench/hosts_training.py --workloads resnet18,lm --rates 1gbit,100mbit \\
        --layouts 1x1,1x2,2x1,1x4,2x2 --algorithms torch,ring,shm,bf16,powersgd --steps 8 --out bench-out/hosts-training

Each case is a real ``ringtrain train`` (weak scaling: a fixed batch per worker) for ``--steps`` optimizer
steps, on test hosts (``ringtrain/testing/hosts.py``: network namespaces on this machine, every link capped with
``tc tbf`` at the rate). A layout ``HxP`` is H hosts of P workers: ``2x2`` runs one launcher per host across
the capped links, ``1x4`` the same four workers in one namespace (loopback, no cap), so that between the
two only the link differs (the two cores of this machine run four workers' compute either way). ``1x1``
is the single worker that scaling efficiency is measured against: ``samples/s / (workers x samples/s of
1x1)``. Algorithms are ``[comm] algorithm`` values: ``torch`` (Gloo's all-reduce: one flat ring across
hosts), ``ring``, ``shm`` (shared memory inside a host, hierarchical across hosts), and torch's DDP hooks
``bf16`` (gradients sent as bfloat16, half the bytes) and ``powersgd`` (rank-``--powersgd-rank`` low-rank
factors; from step 2). Single-host layouts need no rate and run once per algorithm. A rate only matters
across hosts.

Each host pins its workers to cores from the first one on (``[dist] pin_cpu``), which on one machine would
stack the workers of ``2x1`` on core 0: layouts with fewer workers per host than this machine has cores run
unpinned. Throughput is the median of the logged intervals after the first (warm-up, PowerSGD's first steps).
Every case appends to ``OUT/results.json`` (a case measured again replaces its row) and ``OUT/table.md``
is rewritten from all rows, so the grid can be run a piece at a time. Needs root. The CI short form
(tests/multihost/test_bench_hosts.py): the digits MLP, 1x2 and 2x1 at 1 Gbit/s, Gloo and bf16, then
``--predict``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringtrain.testing.hosts import Hosts  # noqa: E402 - the repository's own test hosts

PORT = 29500


@dataclass(frozen=True)
class Workload:
    config: str
    per_worker: int
    """Samples (sequences, images) per worker per step: the global batch is this x workers."""
    params: float
    """Parameters (fp32 gradient bytes / 4), for the cost model's prediction."""
    settings: tuple[str, ...] = ()


WORKLOADS = {
    # torchvision's ResNet-18 (11.7M parameters, 44.7 MB of fp32 gradients), synthetic 64x64 images.
    "resnet18": Workload("configs/bench_user_resnet18.toml", 32, 11_181_642),
    # The byte-level Transformer LM (3.2M parameters, 12.8 MB of gradients), bf16 autocast, 256-byte sequences;
    # a 1% validation split (the run's one evaluation is at its end, outside the measured steps).
    "lm": Workload("configs/text_lm.toml", 16, 3_290_624, ("train.warmup_steps=0", "data.test_fraction=0.01")),
    # The seconds-long MLP of the CI form.
    "mlp": Workload("configs/debug_mlp.toml", 16, 3_530),
}


@dataclass(frozen=True)
class Case:
    workload: str
    hosts: int
    per_host: int
    algorithm: str
    rate: str | None

    @property
    def workers(self) -> int:
        return self.hosts * self.per_host

    @property
    def layout(self) -> str:
        return f"{self.hosts}x{self.per_host}"

    @property
    def name(self) -> str:
        return f"{self.workload}-{self.layout}-{self.algorithm}-{self.rate or 'local'}"


def run_case(case: Case, steps: int, interval: int, out: Path, powersgd_rank: int, timeout_s: float) -> dict:
    """Run one case on fresh test hosts; its row (throughput, step time, exposed communication)."""
    work = WORKLOADS[case.workload]
    run_dir = out / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    settings = [f"train.max_steps={steps}", f"monitor.log_every_steps={interval}", "monitor.progress=false",
                "checkpoint.every_steps=100000", f"train.local_batch_size={work.per_worker}",
                f"train.global_batch_size={work.per_worker * case.workers}", f"comm.algorithm={case.algorithm}",
                "comm.powersgd_start_iter=2", f"comm.powersgd_rank={powersgd_rank}", *work.settings]
    if case.hosts > 1 and case.per_host < (os.cpu_count() or 1):
        # The test hosts share this machine's cores, and each host pins its workers from the first core on:
        # 2x1 would put both workers on core 0 and leave core 1 idle. Unpinned, they spread as in one host.
        settings.append("dist.pin_cpu=false")
    base = [sys.executable, "-m", "ringtrain", "train", str(REPO / work.config), "--nproc", str(case.per_host),
            "--run-dir", str(run_dir)]
    for setting in settings:
        base += ["--set", setting]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with Hosts.up(case.hosts, case.rate if case.hosts > 1 else None) as hosts:
        procs = []
        try:
            for i in range(case.hosts):
                command = list(base)
                if case.hosts > 1:
                    command += ["--nnodes", str(case.hosts), "--node-rank", str(i), "--rdzv-endpoint",
                                f"{hosts.addr(0)}:{PORT}", "--local-addr", hosts.addr(i)]
                procs.append(hosts.popen(i, command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True))
            errors = [proc.communicate(timeout=timeout_s)[1] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        lines = [line for err in errors for line in err.splitlines() if "ringtrain: error" in line]
        raise SystemExit(f"{case.name}: exit codes {codes}: {lines[-1] if lines else errors[0][-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r.get("type") == "train"][1:]
    if not steady:
        raise SystemExit(f"{case.name}: too few logged intervals; raise --steps")
    return {
        **asdict(case), "name": case.name, "layout": case.layout, "workers": case.workers, "steps": steps,
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "comm_exposed_s": statistics.median(r.get("time/comm_exposed_s", 0.0) for r in steady),
        "comm_s": statistics.median(r.get("time/comm_s", 0.0) for r in steady),
        "forward_backward_s": statistics.median(r.get("time/forward_backward_s", 0.0) for r in steady),
        "wall_s": time.monotonic() - started,
    }


def cases(workloads: list[str], layouts: list[str], algorithms: list[str], rates: list[str]) -> list[Case]:
    found = []
    for workload in workloads:
        for layout in layouts:
            hosts, per_host = (int(x) for x in layout.split("x"))
            for algorithm in (["torch"] if hosts * per_host == 1 else algorithms):
                if hosts == 1 and per_host == 1 and algorithm != "torch":
                    continue
                for rate in (rates if hosts > 1 else [None]):
                    found.append(Case(workload, hosts, per_host, algorithm, rate))
    return found


def table(rows: list[dict]) -> str:
    """Markdown: per workload, samples/s and scaling efficiency (vs 1x1) per layout, rate and algorithm;
    across hosts also the ratio to the same workers in one namespace (only the link differs)."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        single = next((r["samples_per_s"] for r in mine if r["workers"] == 1), None)
        local = {(r["workers"], r["algorithm"]): r["samples_per_s"] for r in mine if r["hosts"] == 1}
        lines += [f"### {workload} ({WORKLOADS[workload].config}, {WORKLOADS[workload].per_worker} per worker per step)",
                  "", "| layout | link | algorithm | samples/s | step | exposed comm | efficiency | vs one namespace |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        order = {"torch": 0, "ring": 1, "shm": 2, "bf16": 3, "powersgd": 4}
        mine.sort(key=lambda r: (r["hosts"] > 1, r["workers"], _rate_order(r["rate"]), order.get(r["algorithm"], 9)))
        for r in mine:
            eff = f"{r['samples_per_s'] / (r['workers'] * single):.0%}" if single else "-"
            same = local.get((r["workers"], r["algorithm"])) if r["hosts"] > 1 else None
            vs = f"{r['samples_per_s'] / same:.2f}x" if same else "-"
            lines.append(f"| {r['layout']} | {r['rate'] or 'loopback'} | {r['algorithm']} | {r['samples_per_s']:.1f} "
                         f"| {r['step_time_s'] * 1e3:.0f} ms | {r['comm_exposed_s'] * 1e3:.0f} ms | {eff} | {vs} |")
        lines.append("")
    return "\n".join(lines)


LINK_MBPS = {"1gbit": 118.0, "100mbit": 11.8}
"""A plain TCP stream through each cap, in MB/s (measured here: 118 MB/s through 1 Gbit/s)."""


def predict(rows: list[dict], links_path: str, inter_alpha_us: float = 100.0, bucket_mb: float = 25.0) -> list[dict]:
    """The cost model (``ringtrain plan``) against each case across hosts: compute from the same workers in
    one namespace with Gloo (step minus exposed communication; forward+backward split 1:2), the inter-host
    link from the cap's TCP rate, the intra-host link from this machine's calibration (``--links``).
    torch/ring: a flat ring; shm: hierarchical; bf16: a flat ring of half the bytes; PowerSGD is not modelled."""
    from ringtrain.bench.plan import Link, Topology
    from ringtrain.bench.plan import Workload as PlanWorkload
    from ringtrain.bench.plan import predict_step, read_links

    links = read_links(links_path)
    local = {(r["workload"], r["workers"]): r for r in rows if r["hosts"] == 1 and r["algorithm"] == "torch"}
    kinds = {"torch": ("flat", 1.0), "ring": ("flat", 1.0), "shm": ("hierarchical", 1.0), "bf16": ("flat", 0.5)}
    out = []
    for r in rows:
        base = local.get((r["workload"], r["workers"]))
        if r["hosts"] < 2 or r["algorithm"] not in kinds or base is None or r["rate"] not in LINK_MBPS:
            continue
        algorithm, compression = kinds[r["algorithm"]]
        fb = base["forward_backward_s"]
        other = max(0.0, base["step_time_s"] - fb - base["comm_exposed_s"])
        work = PlanWorkload(WORKLOADS[r["workload"]].params * 4, fb / 3, 2 * fb / 3, other)
        inter = Link(inter_alpha_us * 1e-6, LINK_MBPS[r["rate"]] * 1e6, r["rate"])
        got = predict_step(work, Topology(r["hosts"], r["per_host"]), links["shm"], inter, algorithm,
                           bucket_mb * 1e6, compression)
        out.append({"name": r["name"], "measured_step_ms": r["step_time_s"] * 1e3, "predicted_step_ms": got.step_s * 1e3,
                    "error": got.step_s / r["step_time_s"] - 1})
    return out


def _rate_order(rate: str | None) -> float:
    if rate is None:
        return 0
    value = float(rate.rstrip("gmbit") or 0) * (1e9 if "g" in rate else 1e6)
    return -value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="resnet18,lm", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--layouts", default="1x1,1x2,2x1,1x4,2x2", help="HOSTSxWORKERS, e.g. 2x2")
    parser.add_argument("--algorithms", default="torch,ring,shm,bf16,powersgd", help="[comm] algorithm values")
    parser.add_argument("--rates", default="1gbit,100mbit", help="link caps across hosts (tc's units)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=int, default=2, help="steps per logged interval")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    parser.add_argument("--out", default="bench-out/hosts-training")
    parser.add_argument("--predict", metavar="LINKS", help="run nothing: compare OUT/results.json with the cost model "
                        "(ringtrain plan), this machine's links from LINKS (bench-out/plan/links.json); writes "
                        "OUT/predicted.md and .json")
    args = parser.parse_args()
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    unknown = set(split(args.workloads)) - set(WORKLOADS)
    if unknown:
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    if args.predict:
        predicted = predict(rows, args.predict)
        lines = ["| case | measured step | predicted | error |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {c['name']} | {c['measured_step_ms']:.0f} ms | {c['predicted_step_ms']:.0f} ms | {c['error']:+.0%} |"
                  for c in predicted]
        (out / "predicted.md").write_text("\n".join(lines) + "\n")
        (out / "predicted.json").write_text(json.dumps(predicted, indent=1) + "\n")
        print("\n".join(lines))
        return 0
    for case in cases(split(args.workloads), split(args.layouts), split(args.algorithms), split(args.rates)):
        row = run_case(case, args.steps, args.interval, out, args.powersgd_rank, args.timeout)
        print(f"{case.name}: {row['samples_per_s']:.1f} samples/s, step {row['step_time_s'] * 1e3:.0f} ms, "
              f"exposed comm {row['comm_exposed_s'] * 1e3:.0f} ms ({row['wall_s']:.0f} s)", flush=True)
        rows = [r for r in rows if r["name"] != case.name] + [row]
        results.write_text(json.dumps(rows, indent=1) + "\n")
        (out / "table.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
