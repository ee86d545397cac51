"""``ringtrain plan``: an alpha-beta cost model of data-parallel training, calibrated here, used to plan there.

A collective over a link class costs ``alpha`` seconds per message step plus bytes over ``beta`` (its
bus bandwidth). A ring all-reduce of B bytes over n ranks takes 2(n-1) steps of B/n bytes:

    ring(B, n, link) = 2(n-1) * alpha + 2(n-1)/n * B / beta

Across h hosts of w workers (n = h*w), two algorithms:

- flat: one ring through every rank. Each of its steps waits for the slowest hop, a host-to-host link, so
  ring(B, n, inter): every inter-host link carries 2(n-1)/n of the message.
- hierarchical (ringtrain's ``shm`` across hosts): reduce inside each host, a ring between host leaders,
  broadcast inside each host: ring(B, w, intra) + ring(B, h, inter); the inter-host links carry 2(h-1)/h.

A training step is forward + backward + the exposed part of the gradient all-reduce + optimizer. The
gradient is all-reduced in buckets (DDP's: a 1 MB first bucket, then ``bucket_mb``), each ready when the
backward has produced its share of the gradient bytes (evenly over the backward: a stated simplification),
all-reduced one after another; what runs past the end of the backward is exposed. Scaling efficiency is
the single worker's step over the step at n workers (weak scaling: the batch per worker is fixed).

The link constants of other hardware and the compute time per step are stated inputs (``TABLE_DEFAULTS``,
published figures); this machine's calibration (``calibrate``) only checks the model's shape against what
ringtrain measures here (``validate``).

    ringtrain plan calibrate --out bench-out/plan/links.json        # alpha, beta of Gloo and shm, 2 ranks
    ringtrain plan validate bench-out/user-resnet18-shm/train_bench.json --params 11.69M --links bench-out/plan/links.json
    ringtrain plan validate-hosts docs/img/hosts_collectives_1gbit.json --hosts 2 --per-host 2 --inter-mbps 118 --links L
    ringtrain plan table --out bench-out/plan                        # 8 to 1,024 workers, 25 and 400 Gbit/s
    ringtrain plan diloco --params 0.47M --compute-ms 30 --hosts 2 --inter-mbps 12.5 --sync-every 10,50

DiLoCo (``predict_diloco_step``): no gradient all-reduce; every H / F steps one fragment's pseudo-gradient
(1/F of the parameters, in fp32 or a packet of ``codec`` bytes per value) is exchanged: all-reduced as above
in fp32, all-gathered (a ring: (n-1) alpha + (n-1) packet / beta) when compressed. A delay of tau steps hides
up to tau steps of compute behind it (an asynchronous op); the rest is exposed. The mean step is compute +
F / H x the exposed exchange. This is time per step, not time to a loss: how many more samples DiLoCo needs
to reach DDP's loss at a given H is measured, not modelled.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ringtrain.errors import RingtrainError

__all__ = ["Link", "Workload", "Topology", "ring_time", "all_reduce_time", "predict_step", "fit_link",
           "add_plan_parser", "TABLE_DEFAULTS", "validate_collectives", "predict_diloco_step", "VALUE_BYTES"]

DDP_FIRST_BUCKET_BYTES = 1 << 20
"""torch DDP's first bucket (the gradients ready first) is capped at 1 MB, the rest at bucket_cap_mb."""


class PlanError(RingtrainError):
    exit_code = 2


@dataclass(frozen=True)
class Link:
    """One link class: seconds per message step, and bus bandwidth in bytes per second."""

    alpha_s: float
    beta_Bps: float
    name: str = ""


@dataclass(frozen=True)
class Workload:
    """What one worker's step needs: its gradient's bytes and its compute time (no communication)."""

    grad_bytes: float
    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    name: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass(frozen=True)
class Topology:
    hosts: int
    per_host: int

    @property
    def workers(self) -> int:
        return self.hosts * self.per_host


def ring_time(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks on ``link``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.beta_Bps


def all_reduce_time(nbytes: float, topo: Topology, intra: Link, inter: Link, algorithm: str) -> float:
    """One all-reduce of ``nbytes`` over the topology: 'flat' (one ring) or 'hierarchical'."""
    if topo.hosts == 1:
        return ring_time(nbytes, topo.per_host, intra)
    if algorithm == "flat":
        return ring_time(nbytes, topo.workers, inter)
    if algorithm == "hierarchical":
        return ring_time(nbytes, topo.per_host, intra) + ring_time(nbytes, topo.hosts, inter)
    raise PlanError(f"algorithm {algorithm!r} is unknown: use 'flat' or 'hierarchical'")


def bucket_sizes(grad_bytes: float, bucket_bytes: float, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES) -> list[float]:
    """The gradient's buckets in the order they become ready."""
    sizes, left = [], grad_bytes
    first = min(first_bucket_bytes, left)
    if first > 0:
        sizes.append(first)
        left -= first
    while left > 1e-9:
        sizes.append(min(bucket_bytes, left))
        left -= sizes[-1]
    return sizes


@dataclass(frozen=True)
class Prediction:
    step_s: float
    comm_s: float
    """All-reduce time of the whole gradient (sum over buckets)."""
    exposed_s: float
    efficiency: float


def predict_step(work: Workload, topo: Topology, intra: Link, inter: Link, algorithm: str,
                 bucket_bytes: float, compression: float = 1.0) -> Prediction:
    """Step time, total and exposed communication, scaling efficiency (``compression``: bytes sent per
    gradient byte, 0.5 for bf16)."""
    done = 0.0
    ready_bytes = 0.0
    comm = 0.0
    for size in bucket_sizes(work.grad_bytes, bucket_bytes):
        ready_bytes += size
        ready = work.backward_s * ready_bytes / work.grad_bytes
        took = all_reduce_time(size * compression, topo, intra, inter, algorithm)
        done = max(done, ready) + took
        comm += took
    exposed = max(0.0, done - work.backward_s)
    step = work.compute_s + exposed
    return Prediction(step, comm, exposed, work.compute_s / step)


VALUE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 256, "int4": 0.5 + 4 / 256}
"""Bytes a pseudo-gradient value travels in (ringtrain/comm/codec.py: an fp32 scale per 256 values)."""


def gather_time(nbytes: float, n: int, link: Link) -> float:
    """A ring all-gather of ``n`` pieces of ``nbytes`` each: n - 1 steps, each piece crossing every link once."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) * nbytes / link.beta_Bps


def predict_diloco_step(work: Workload, topo: Topology, intra: Link, inter: Link, algorithm: str, sync_every: int,
                        fragments: int = 1, delay: int = 0, dtype: str = "fp32") -> Prediction:
    """DiLoCo's mean step time (module docstring): compute, plus F / H of each fragment exchange's exposed part.
    ``comm_s`` and ``exposed_s`` are per step, averaged over the H steps."""
    if sync_every <= 0 or fragments <= 0 or sync_every % fragments or not 0 <= delay < sync_every // fragments:
        raise PlanError(f"sync_every {sync_every}, fragments {fragments}, delay {delay}: H must be divisible by F "
                        "and the delay below H / F")
    if dtype not in VALUE_BYTES:
        raise PlanError(f"dtype {dtype!r} is unknown: use one of {', '.join(VALUE_BYTES)}")
    values = work.grad_bytes / 4 / fragments  # fp32 gradients: the parameters' count, per fragment
    if dtype == "fp32":
        exchange = all_reduce_time(values * 4, topo, intra, inter, algorithm)
    else:
        exchange = gather_time(values * VALUE_BYTES[dtype], topo.workers, inter if topo.hosts > 1 else intra)
    exposed = max(0.0, exchange - delay * work.compute_s)
    comm = fragments / sync_every * exchange
    step = work.compute_s + fragments / sync_every * exposed
    return Prediction(step, comm, fragments / sync_every * exposed, work.compute_s / step)


def diloco_rows(work: Workload, topo: Topology, intra: Link, inter: Link, algorithm: str, bucket_bytes: float,
                sync_every: list[int], fragments: list[int], delays: list[int], dtypes: list[str]) -> list[dict]:
    """DDP's predicted step, then DiLoCo's for every combination that fits (H divisible by F, delay < H / F)."""
    ddp = predict_step(work, topo, intra, inter, algorithm, bucket_bytes)
    rows = [{"case": "ddp", "step_ms": ddp.step_s * 1e3, "exposed_ms": ddp.exposed_s * 1e3,
             "efficiency": ddp.efficiency, "bytes_per_step": work.grad_bytes, "speedup": 1.0}]
    for h in sync_every:
        for f in fragments:
            for tau in delays:
                if h % f or tau >= h // f:
                    continue
                for dtype in dtypes:
                    got = predict_diloco_step(work, topo, intra, inter, algorithm, h, f, tau, dtype)
                    rows.append({"case": f"diloco H={h} F={f} delay={tau} {dtype}", "step_ms": got.step_s * 1e3,
                                 "exposed_ms": got.exposed_s * 1e3, "efficiency": got.efficiency,
                                 "bytes_per_step": work.grad_bytes / 4 * VALUE_BYTES[dtype] / h,
                                 "speedup": ddp.step_s / got.step_s})
    return rows


# --- calibration: alpha and beta of this machine's links, from `ringtrain bench collectives` -------------
def fit_link(points: list[tuple[float, float]], n: int, name: str = "") -> Link:
    """Least-squares fit of ring_time to (bytes, seconds) measured at ``n`` ranks, in relative error (each
    point weighted by 1/t^2), so that the small messages set alpha and the large ones beta."""
    if n < 2 or len(points) < 2:
        raise PlanError("calibration needs at least 2 message sizes measured at 2 or more ranks")
    xs = [2 * (n - 1) / n * b for b, _ in points]
    ys = [t for _, t in points]
    ws = [1.0 / (t * t) for t in ys]
    total = sum(ws)
    mean_x = sum(w * x for w, x in zip(ws, xs)) / total
    mean_y = sum(w * y for w, y in zip(ws, ys)) / total
    var = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / var
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        raise PlanError(f"{name}: the measured time does not grow with the message size; calibrate on a quiet machine")
    return Link(alpha_s=max(intercept, 0.0) / (2 * (n - 1)), beta_Bps=1.0 / slope, name=name)


def links_from_bench(rows: list[dict], world_size: int) -> dict[str, Link]:
    """One Link per algorithm in a collectives.json, at ``world_size`` ranks."""
    by_algorithm: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if row.get("world_size") == world_size and row.get("op", "all_reduce") == "all_reduce":
            by_algorithm.setdefault(row["algorithm"], []).append((float(row["bytes"]), float(row["p50_s"])))
    if not by_algorithm:
        raise PlanError(f"no measurement at {world_size} ranks in the collectives results")
    return {name: fit_link(points, world_size, name) for name, points in by_algorithm.items()}


def calibrate(out: Path, nproc: int = 2, algorithms: str = "torch,shm", sizes: str = "256K,1M,4M,16M") -> dict[str, Link]:
    """Run a short `ringtrain bench collectives` and fit each algorithm's link."""
    with tempfile.TemporaryDirectory(prefix="ringtrain-plan-") as folder:
        command = [sys.executable, "-m", "ringtrain", "bench", "collectives", "--nproc", str(nproc),
                   "--algorithms", algorithms, "--sizes", sizes, "--iters", "20", "--out", folder]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise PlanError(f"calibration failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        rows = json.loads((Path(folder) / "collectives.json").read_text())
    links = links_from_bench(rows, nproc)
    write_links(out, links, {"measured": f"ringtrain bench collectives --nproc {nproc} --algorithms {algorithms} --sizes {sizes}"})
    return links


def write_links(path: Path, links: dict[str, Link], extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, "links": {k: asdict(v) for k, v in links.items()}}, indent=2) + "\n")


def read_links(path: str | Path) -> dict[str, Link]:
    try:
        data = json.loads(Path(path).read_text())
        return {name: Link(**value) for name, value in data["links"].items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PlanError(f"--links {path}: not a links file from `ringtrain plan calibrate` ({err})") from None


# --- validation: predict what `ringtrain bench train` measured -----------------------------------------
def validate(bench_rows: list[dict], grad_bytes: float, links: dict[str, Link], bucket_bytes: float) -> list[dict]:
    """For each ringtrain case of a bench train result at 2+ workers on one host: the model's step time from
    the case's own measured compute (forward+backward, optimizer), against the measured step."""
    cases = []
    for row in bench_rows:
        if row.get("runner") == "bare" or row.get("world_size", 1) < 2 or not row.get("breakdown_s"):
            continue
        algorithm = row.get("algorithm", "torch")
        link = links.get("shm" if algorithm == "shm" else "torch")
        if link is None:
            continue
        phases = row["breakdown_s"]
        compute = phases.get("forward_backward", 0.0)
        # The clock books forward+backward together; the backward is about 2/3 of it (twice the forward's FLOPs).
        work = Workload(grad_bytes, compute / 3, 2 * compute / 3,
                        phases.get("optimizer", 0.0) + phases.get("data", 0.0) + phases.get("monitor", 0.0))
        topo = Topology(1, int(row["world_size"]))
        got = predict_step(work, topo, link, link, "flat", bucket_bytes)
        measured = float(row["median_step_s"])
        cases.append({
            "case": row.get("label") or row.get("name"), "workers": topo.workers, "link": link.name,
            "measured_step_ms": measured * 1e3, "predicted_step_ms": got.step_s * 1e3,
            "step_error": got.step_s / measured - 1,
            "measured_exposed_ms": phases.get("comm_exposed", 0.0) * 1e3, "predicted_exposed_ms": got.exposed_s * 1e3,
        })
    return cases


def validate_collectives(rows: list[dict], topo: Topology, intra: Link, inter: Link) -> list[dict]:
    """Predict each flat ('torch', 'ring', 'ring_chunked') and hierarchical ('shm') all-reduce of a
    `bench collectives` run across hosts from links calibrated elsewhere; compare with its p50."""
    kinds = {"torch": "flat", "ring": "flat", "ring_chunked": "flat", "shm": "hierarchical", "hierarchical": "hierarchical"}
    cases = []
    for row in rows:
        algorithm = kinds.get(row.get("algorithm", ""))
        if algorithm is None or row.get("world_size") != topo.workers:
            continue
        predicted = all_reduce_time(float(row["bytes"]), topo, intra, inter, algorithm)
        measured = float(row["p50_s"])
        cases.append({"algorithm": row["algorithm"], "model": algorithm, "bytes": int(row["bytes"]),
                      "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3, "error": predicted / measured - 1})
    return cases


# --- the extrapolated table ----------------------------------------------------------------------------
TABLE_DEFAULTS = {
    "models": {
        # ResNet-50: 25.6M parameters, fp32 gradients; 256 images per GPU at ~2,600 images/s (A100, mixed
        # precision, published training throughput): ~100 ms per step.
        "resnet50": Workload(25.6e6 * 4, 0.033, 0.067, 0.002, "ResNet-50, 256 img/GPU"),
        # GPT-2 small: 124M parameters, fp32 gradients; 16 x 1024 tokens per GPU: 6 * 124M * 16K = 1.2e13 FLOPs
        # at 40% of an A100's 312 bf16 TFLOP/s: ~100 ms per step.
        "gpt2-small": Workload(124e6 * 4, 0.033, 0.065, 0.004, "GPT-2 small, 16K tok/GPU"),
    },
    # Inside a host: NVLink-class, NCCL all-reduce bus bandwidth ~200 GB/s, ~5 us per step.
    "intra": Link(5e-6, 200e9, "NVLink-class"),
    # Between hosts, per host NIC: Ethernet 25 Gbit/s (3.1 GB/s, ~20 us) and 400 Gbit/s (50 GB/s, ~10 us).
    "inter": {"25gbit": Link(20e-6, 25e9 / 8, "25 Gbit/s"), "400gbit": Link(10e-6, 400e9 / 8, "400 Gbit/s")},
    "per_host": 8,
    "workers": [8, 16, 64, 256, 1024],
    "bucket_mb": 25.0,
}


def extrapolate(defaults: dict = TABLE_DEFAULTS) -> list[dict]:
    rows = []
    for model, work in defaults["models"].items():
        for speed, inter in defaults["inter"].items():
            for workers in defaults["workers"]:
                topo = Topology(max(1, workers // defaults["per_host"]), min(workers, defaults["per_host"]))
                row = {"model": model, "link": speed, "workers": workers, "hosts": topo.hosts}
                for label, algorithm, compression in (("flat", "flat", 1.0), ("hierarchical", "hierarchical", 1.0),
                                                      ("hierarchical+bf16", "hierarchical", 0.5)):
                    got = predict_step(work, topo, defaults["intra"], inter, algorithm,
                                       defaults["bucket_mb"] * 1e6, compression)
                    row[label] = got.efficiency
                    row[f"{label}_step_ms"] = got.step_s * 1e3
                rows.append(row)
    return rows


def table_markdown(rows: list[dict], defaults: dict = TABLE_DEFAULTS) -> str:
    lines = ["| model | inter-host link | workers | hosts | flat ring | hierarchical | hierarchical + bf16 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['link']} | {r['workers']:,} | {r['hosts']} | {r['flat']:.0%} "
                     f"| {r['hierarchical']:.0%} | {r['hierarchical+bf16']:.0%} |")
    intra = defaults["intra"]
    notes = ["", "Assumptions (stated inputs, not this machine's calibration):"]
    for name, w in defaults["models"].items():
        notes.append(f"- {name}: {w.name}; gradient {w.grad_bytes / 1e6:.0f} MB (fp32), compute "
                     f"{w.compute_s * 1e3:.0f} ms per step (backward {w.backward_s * 1e3:.0f} ms)")
    notes.append(f"- inside a host: {intra.name}, {intra.beta_Bps / 1e9:.0f} GB/s bus bandwidth, {intra.alpha_s * 1e6:.0f} us per step; "
                 f"{defaults['per_host']} workers per host")
    for link in defaults["inter"].values():
        notes.append(f"- between hosts: {link.name} per host ({link.beta_Bps / 1e9:.1f} GB/s, {link.alpha_s * 1e6:.0f} us per step)")
    notes.append(f"- DDP buckets: 1 MB first, then {defaults['bucket_mb']:g} MB, all-reduced one at a time as the backward "
                 "produces them (evenly over the backward); efficiency = compute / (compute + exposed communication)")
    notes.append("- not modelled: stragglers, congestion from other jobs, NCCL's tree algorithm, compute slowed by "
                 "communication kernels, compression's own cost")
    return "\n".join(lines + notes) + "\n"


# --- the command ---------------------------------------------------------------------------------------
def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="cost model: calibrate links, validate against benchmarks, extrapolate to 1,024 workers",
        description="An alpha-beta cost model of data-parallel training (ringtrain/bench/plan.py) and of model-parallel layouts (plan_layouts.py).")
    actions = plan.add_subparsers(dest="action", required=True, metavar="ACTION")
    cal = actions.add_parser("calibrate", help="measure alpha and beta of Gloo and shm here (about a minute)")
    cal.add_argument("--nproc", type=int, default=2)
    cal.add_argument("--algorithms", default="torch,shm")
    cal.add_argument("--from-bench", metavar="COLLECTIVES_JSON", help="fit an existing `bench collectives` result instead")
    cal.add_argument("--out", default="bench-out/plan/links.json")
    cal.set_defaults(handler=_calibrate)
    val = actions.add_parser("validate", help="predict a `bench train` result's step times from its compute times")
    val.add_argument("bench_json", help="train_bench.json from `ringtrain bench train`")
    val.add_argument("--params", required=True, help="the model's parameter count, e.g. 11.69M")
    val.add_argument("--links", default="bench-out/plan/links.json")
    val.add_argument("--bucket-mb", type=float, default=25.0)
    val.set_defaults(handler=_validate)
    hosts = actions.add_parser("validate-hosts", help="predict a `bench collectives` run across hosts from stated links")
    hosts.add_argument("collectives_json", help="collectives.json of a run across hosts")
    hosts.add_argument("--hosts", type=int, required=True)
    hosts.add_argument("--per-host", type=int, required=True)
    hosts.add_argument("--inter-mbps", type=float, required=True,
                       help="the link between hosts in MB/s as measured by a plain TCP stream (e.g. 118 through a 1 Gbit/s cap)")
    hosts.add_argument("--inter-alpha-us", type=float, default=100.0, help="seconds per message step between hosts, in us")
    hosts.add_argument("--links", default="bench-out/plan/links.json", help="this machine's calibration: its shm link is the intra-host one")
    hosts.set_defaults(handler=_validate_hosts)
    table = actions.add_parser("table", help="predicted scaling efficiency, 8 to 1,024 workers (stated hardware)")
    table.add_argument("--out", default="bench-out/plan", help="folder for plan_table.md / .json")
    table.set_defaults(handler=_table)
    diloco = actions.add_parser("diloco", help="predict DiLoCo's step time against DDP's from H, fragments and the links")
    diloco.add_argument("--params", required=True, help="the model's parameter count, e.g. 0.47M")
    diloco.add_argument("--compute-ms", type=float, required=True,
                        help="one worker's step without communication (forward + backward + optimizer), in ms")
    diloco.add_argument("--backward-share", type=float, default=0.6,
                        help="the backward's share of the compute, which DDP's buckets overlap (default 0.6)")
    diloco.add_argument("--hosts", type=int, default=2)
    diloco.add_argument("--per-host", type=int, default=1)
    diloco.add_argument("--inter-mbps", type=float, required=True, help="the link between hosts in MB/s (12.5 at 100 Mbit/s)")
    diloco.add_argument("--inter-alpha-us", type=float, default=100.0)
    diloco.add_argument("--intra-gbps", type=float, default=5.0, help="inside a host, GB/s (default 5: shared memory)")
    diloco.add_argument("--intra-alpha-us", type=float, default=5.0)
    diloco.add_argument("--algorithm", choices=("flat", "hierarchical"), default="hierarchical")
    diloco.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's buckets, for its row")
    diloco.add_argument("--sync-every", default="10,50,100", help="H values, comma-separated")
    diloco.add_argument("--fragments", default="1", help="F values, comma-separated")
    diloco.add_argument("--delay", default="0", help="delay values, comma-separated")
    diloco.add_argument("--dtype", default="fp32", help="fp32, bf16, int8, int4, comma-separated")
    diloco.set_defaults(handler=_diloco)
    from ringtrain.bench.plan_layouts import add_layouts_parsers

    add_layouts_parsers(actions)


def _count(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    try:
        return float(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else float(text)
    except (ValueError, IndexError):
        raise PlanError(f"--params {text!r}: give a number such as 11.69M or 25600000") from None


def _calibrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.from_bench:
        links = links_from_bench(_read_rows(args.from_bench, "ringtrain bench collectives"), args.nproc)
        write_links(out, links, {"measured": f"fitted to {args.from_bench} at {args.nproc} ranks"})
    else:
        links = calibrate(out, args.nproc, args.algorithms)
    for name, link in links.items():
        print(f"{name}: alpha {link.alpha_s * 1e6:.1f} us per step, beta {link.beta_Bps / 1e9:.2f} GB/s")
    print(f"links: {out}")
    return 0


def _read_rows(path: str, made_by: str) -> list[dict]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"{path}: not a `{made_by}` result ({err})") from None
    if not isinstance(rows, list):
        raise PlanError(f"{path}: not a `{made_by}` result (expected a list of rows)")
    return rows


def _validate(args: argparse.Namespace) -> int:
    rows = _read_rows(args.bench_json, "ringtrain bench train")
    cases = validate(rows, _count(args.params) * 4, read_links(args.links), args.bucket_mb * 1e6)
    if not cases:
        raise PlanError(f"{args.bench_json}: no ringtrain case at 2+ workers with a link in {args.links}")
    print("| case | workers | link | measured step | predicted | error | measured exposed | predicted exposed |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for c in cases:
        print(f"| {c['case']} | {c['workers']} | {c['link']} | {c['measured_step_ms']:.1f} ms | {c['predicted_step_ms']:.1f} ms "
              f"| {c['step_error']:+.1%} | {c['measured_exposed_ms']:.1f} ms | {c['predicted_exposed_ms']:.1f} ms |")
    return 0


def _validate_hosts(args: argparse.Namespace) -> int:
    rows = _read_rows(args.collectives_json, "ringtrain bench collectives")
    links = read_links(args.links)
    if "shm" not in links:
        raise PlanError(f"--links {args.links} has no shm link; calibrate with --algorithms torch,shm")
    inter = Link(args.inter_alpha_us * 1e-6, args.inter_mbps * 1e6, f"{args.inter_mbps:g} MB/s")
    cases = validate_collectives(rows, Topology(args.hosts, args.per_host), links["shm"], inter)
    if not cases:
        raise PlanError(f"{args.collectives_json}: no all-reduce at {args.hosts * args.per_host} ranks")
    print("| algorithm | model | size | measured | predicted | error |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for c in cases:
        print(f"| {c['algorithm']} | {c['model']} | {c['bytes'] / 2**20:g} MB | {c['measured_ms']:.1f} ms "
              f"| {c['predicted_ms']:.1f} ms | {c['error']:+.1%} |")
    return 0


def _table(args: argparse.Namespace) -> int:
    rows = extrapolate()
    text = table_markdown(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_table.md").write_text(text)
    (out / "plan_table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    print(f"written: {out / 'plan_table.md'}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 10,50") from None
    if not values or any(v < 0 for v in values):
        raise PlanError(f"{flag} {text!r}: give whole numbers of at least 0 separated by commas, e.g. 10,50")
    return values


def _diloco(args: argparse.Namespace) -> int:
    if args.compute_ms <= 0 or not 0 < args.backward_share <= 1 or args.inter_mbps <= 0 or args.intra_gbps <= 0:
        raise PlanError("--compute-ms, --inter-mbps and --intra-gbps must be positive and --backward-share in (0, 1]")
    if args.hosts < 1 or args.per_host < 1:
        raise PlanError("--hosts and --per-host must be at least 1")
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in VALUE_BYTES]
    if unknown or not dtypes:
        raise PlanError(f"--dtype {args.dtype!r}: use fp32, bf16, int8 or int4, comma-separated")
    sync_every = _ints(args.sync_every, "--sync-every")
    fragments = _ints(args.fragments, "--fragments")
    if 0 in sync_every or 0 in fragments:
        raise PlanError("--sync-every and --fragments must be at least 1")
    compute = args.compute_ms / 1e3
    work = Workload(_count(args.params) * 4, compute * (1 - args.backward_share), compute * args.backward_share)
    topo = Topology(args.hosts, args.per_host)
    intra = Link(args.intra_alpha_us * 1e-6, args.intra_gbps * 1e9, f"{args.intra_gbps:g} GB/s")
    inter = Link(args.inter_alpha_us * 1e-6, args.inter_mbps * 1e6, f"{args.inter_mbps:g} MB/s")
    rows = diloco_rows(work, topo, intra, inter, args.algorithm, args.bucket_mb * 1e6, sync_every, fragments,
                       _ints(args.delay, "--delay"), dtypes)
    if len(rows) == 1:
        raise PlanError("no DiLoCo case fits: each H must be divisible by F and each delay below H / F")
    print(f"{args.hosts} host(s) x {args.per_host}, {args.inter_mbps:g} MB/s between hosts, "
          f"{_count(args.params):,.0f} parameters, {args.compute_ms:g} ms of compute a step")
    print("| case | step | exposed comm | efficiency | bytes per worker per step | vs DDP |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['step_ms']:.1f} ms | {r['exposed_ms']:.2f} ms | {r['efficiency']:.0%} "
              f"| {r['bytes_per_step'] / 1e3:,.1f} KB | {r['speedup']:.2f}x |")
    print("time per step; how many more samples a DiLoCo case needs to reach DDP's loss is measured, not modelled")
    return 0
