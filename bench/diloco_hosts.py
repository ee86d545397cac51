"""Time to loss across slow links: DDP, PowerSGD, hierarchical, LocalSGD, DiLoCo and streaming DiLoCo on test hosts.

    sudo .venv/bin/python bench/diloco_hosts.py --layouts 2x1,2x2 --rate 100mbit --steps 300 --every 25 \\
        --cases ddp,powersgd,shm,localsgd:25,diloco:25,streaming:25 --out bench-out/diloco-hosts

Each case is a real ``ringtrain train`` of the byte-level Transformer LM (``configs/debug_lm.toml`` at
``--d-model``; the global batch fixed at ``--per-worker`` sequences x workers, so every case sees the same
samples in the same number of steps) on test hosts (``ringtrain/testing/hosts.py``: network namespaces on this machine,
the link between them capped with ``tc tbf`` at ``--rate``). A checkpoint every ``--every`` steps (a multiple
of every H) holds the model; afterwards each one is scored here, in one process, on the same validation split
(the global parameters of a DiLoCo checkpoint: the model the outer steps made). The training time to a
checkpoint is the sum of the logged step times up to it (checkpoint saves and evaluations excluded).

Cases: ``ddp`` (Gloo's all-reduce every step), ``powersgd`` (DDP's PowerSGD hook, rank ``--powersgd-rank``),
``shm`` (shared memory inside a host, a ring between the hosts' leaders), ``localsgd:H`` (DiLoCo with outer lr
1 and no momentum), ``diloco:H`` (outer Nesterov SGD at ``--outer-lr`` / ``--outer-momentum``, or this case's
own: ``diloco:H:LR:MOMENTUM``, an outer-settings sweep in one run), and
``streaming:H`` (``--fragments`` fragments, a delay of one step, ``--stream-dtype`` packets). DiLoCo cases take
``diloco.inner = auto``: on 2x2 each host's two workers are one replica (DDP over shm inside it).

The table (``OUT/table.md``, rows in ``OUT/results.json``): final validation loss at equal samples and its
ratio to DDP's, the training time to come within 3% of DDP's final validation loss and DDP's time to it over
the case's, bytes each worker sent between hosts, the median step time and compute utilisation (the step
breakdown's forward/backward and optimizer share of it, median over logged intervals). Needs root.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringtrain.testing.hosts import Hosts  # noqa: E402 - the repository's own test hosts

PORT = 29510
CONFIG = "configs/debug_lm.toml"
WITHIN = 0.03
"""A case reaches DDP's loss when its validation loss is within this fraction of DDP's final one."""


def case_settings(case: str, args: argparse.Namespace) -> list[str]:
    kind, _, h = case.partition(":")
    h, *outer_args = h.split(":")  # diloco:H:LR:MOMENTUM / streaming:H:LR:MOMENTUM: this case's outer settings
    if kind == "ddp":
        return ["comm.strategy=ddp", "comm.algorithm=torch"]
    if kind == "powersgd":
        return ["comm.strategy=ddp", "comm.algorithm=powersgd", "comm.powersgd_start_iter=2",
                f"comm.powersgd_rank={args.powersgd_rank}"]
    if kind == "shm":
        return ["comm.strategy=ddp", "comm.algorithm=shm"]
    if kind not in ("localsgd", "diloco", "streaming") or not h.isdigit():
        raise SystemExit(f"--cases: unknown case {case!r}; use ddp, powersgd, shm, localsgd:H, diloco:H, streaming:H")
    if len(outer_args) not in (0, 2) or kind == "localsgd" and outer_args:
        raise SystemExit(f"--cases: {case!r}: give both outer settings, {kind}:H:LR:MOMENTUM (localsgd has none)")
    common = ["comm.strategy=diloco", "comm.algorithm=shm", f"diloco.sync_every={h}"]
    if kind == "localsgd":
        return [*common, "diloco.outer_lr=1.0", "diloco.outer_momentum=0.0"]
    outer_lr, momentum = outer_args if len(outer_args) == 2 else (args.outer_lr, args.outer_momentum)
    outer = [f"diloco.outer_lr={outer_lr}", f"diloco.outer_momentum={momentum}"]
    if kind == "diloco":
        return [*common, *outer]
    return [*common, *outer, f"diloco.fragments={args.fragments}", "diloco.delay=1",
            f"diloco.dtype={args.stream_dtype}"]


def run_case(case: str, layout: str, args: argparse.Namespace, out: Path) -> dict:
    hosts_n, per_host = (int(x) for x in layout.split("x"))
    workers = hosts_n * per_host
    kind, *h_outer = case.split(":")
    name = f"{layout}-{kind}" + "".join(f"{tag}{v}" for tag, v in zip(("H", "-lr", "-m"), h_outer))
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    settings = [f"train.max_steps={args.steps}", f"monitor.log_every_steps={args.every}", "monitor.progress=false",
                f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=1000",
                f"train.local_batch_size={args.per_worker}", f"train.global_batch_size={args.per_worker * workers}",
                f"model.d_model={args.d_model}", "train.auto_micro_batch=false", "train.max_tokens=100000",
                "data.test_fraction=0.05", "dist.pin_cpu=false", *case_settings(case, args)]
    base = [sys.executable, "-m", "ringtrain", "train", str(REPO / CONFIG), "--nproc", str(per_host),
            "--run-dir", str(run_dir)]
    for setting in settings:
        base += ["--set", setting]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with Hosts.up(hosts_n, args.rate) as hosts:
        procs = []
        try:
            for i in range(hosts_n):
                command = [*base, "--nnodes", str(hosts_n), "--node-rank", str(i), "--rdzv-endpoint",
                           f"{hosts.addr(0)}:{PORT}", "--local-addr", hosts.addr(i)]
                procs.append(hosts.popen(i, command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True))
            errors = [proc.communicate(timeout=args.timeout)[1] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        lines = [line for err in errors for line in err.splitlines() if "ringtrain: error" in line]
        raise SystemExit(f"{name}: exit codes {[p.returncode for p in procs]}: {lines[-1] if lines else errors[0][-2000:]}")
    row = score(run_dir, {"name": name, "case": case, "layout": layout, "workers": workers, "rate": args.rate,
                          "steps": args.steps, "samples": args.steps * args.per_worker * workers})
    return {**row, "wall_s": time.monotonic() - started}


def score(run_dir: Path, row: dict, known: dict[int, float] | None = None) -> dict:
    """The row of a finished run: the validation loss of each checkpoint (``known``: step -> loss already
    scored) against the training time to it, the median step time, the bytes. The time of a step is its
    logged time less its checkpoint save's (a DiLoCo checkpoint gathers every worker's own state over the
    link: the bench's cost, not training's)."""
    known = known or {}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("type") == "train"]
    done = json.loads((run_dir / "summary.json").read_text())
    curve, elapsed, last = [], 0.0, 0
    for record in train:  # each record: the mean step time of the steps since the one before
        elapsed += _training_s(record) * (record["step"] - last)
        last = record["step"]
        checkpoint = run_dir / "checkpoints" / f"step_{record['step']:08d}.pt"
        if checkpoint.exists():
            loss = known.get(record["step"])
            curve.append({"step": record["step"], "train_s": elapsed,
                          "val_loss": loss if loss is not None else validation_loss(run_dir, checkpoint)})
    steady = train[1:] or train
    return {**row, "curve": curve, "step_time_s": statistics.median(_training_s(r) for r in steady),
            "compute_share": statistics.median(_compute_s(r) / _training_s(r) for r in steady),
            "comm_bytes_per_worker": done.get("comm_bytes_per_worker"), "diloco_replicas": done.get("diloco_replicas"),
            "outer_payload_bytes": train[-1].get("outer_payload_bytes")}


def _training_s(record: dict) -> float:
    return record["step_time_s"] - record.get("time/checkpoint_s", 0.0)


def _compute_s(record: dict) -> float:
    """The step's own compute (the step breakdown's forward/backward and optimizer phases): compute utilisation
    is its share of the training step, the rest being the link (exposed communication, an outer sync) and data."""
    return record.get("time/forward_backward_s", 0.0) + record.get("time/optimizer_s", 0.0)


_SCORER: dict = {}


def validation_loss(run_dir: Path, checkpoint: Path) -> float:
    """The checkpoint's model (a DiLoCo one's global parameters) on the run's validation split, in one process."""
    import torch
    import torch.distributed as dist

    from ringtrain.config import load_config
    from ringtrain.train.evaluate import evaluate
    from ringtrain.train.user_parts import UserParts

    if not dist.is_initialized():  # evaluate() sums over a group: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    key = str(run_dir)
    if key not in _SCORER:
        config = load_config(run_dir / "config.toml")
        parts = UserParts.from_config(config)
        data = parts.data_split()
        loader = torch.utils.data.DataLoader(data.test, batch_size=32, collate_fn=data.collate_fn)
        _SCORER.clear()
        _SCORER[key] = (parts, config, loader)
    parts, config, loader = _SCORER[key]
    state = torch.load(checkpoint, weights_only=True)
    model = parts.build_model(config.train.seed)
    weights = state["model"]
    outer = state.get("outer")
    if outer:  # DiLoCo: rank 0's own parameters differ from the global ones between outer steps
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        weights = {**weights, **dict(zip(names, outer["global_params"], strict=True))}
    model.load_state_dict(weights)
    return float(evaluate(model, loader, parts.task, torch.device("cpu"))["loss"])


def table(rows: list[dict]) -> str:
    lines = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        ddp = next((r for r in mine if r["case"] == "ddp"), None)
        if ddp is None:
            continue
        target = ddp["curve"][-1]["val_loss"] * (1 + WITHIN)
        ddp_time = _time_to(ddp, target)
        # DDP's bytes: Gloo's ring sends 2 (w - 1) / w of the fp32 gradient a step (a DiLoCo fp32 payload's size).
        fp32 = next((r["outer_payload_bytes"] for r in mine if r.get("outer_payload_bytes")
                     and r["case"].split(":")[0] in ("localsgd", "diloco")), None)
        if fp32 and not ddp.get("comm_bytes_per_worker"):
            ddp["comm_bytes_per_worker"] = ddp["steps"] * fp32 * 2 * (ddp["workers"] - 1) / ddp["workers"]
        lines += [f"### {layout} at {mine[0]['rate']} ({mine[0]['workers']} workers, {mine[0]['samples']:,} "
                  f"sequences in {mine[0]['steps']} steps)", "",
                  f"Target: within {WITHIN:.0%} of DDP's final validation loss ({ddp['curve'][-1]['val_loss']:.4f}): "
                  f"{target:.4f}.", "",
                  "| case | final val loss | vs DDP | time to target | speed-up | bytes/worker | step | compute |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in mine:
            final = r["curve"][-1]["val_loss"]
            reach = _time_to(r, target)
            speed = f"{ddp_time / reach:.2f}x" if reach and ddp_time else "-"
            sent = r["comm_bytes_per_worker"]
            lines.append(f"| {r['case']} | {final:.4f} | {final / ddp['curve'][-1]['val_loss'] - 1:+.1%} | "
                         f"{f'{reach:.1f} s' if reach else 'not reached'} | {speed} | "
                         f"{f'{sent / 1e6:.1f} MB' if sent else '-'} | {r['step_time_s'] * 1e3:.0f} ms | "
                         f"{r['compute_share']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def _time_to(row: dict, target: float) -> float | None:
    for point in row["curve"]:
        if point["val_loss"] <= target:
            return point["train_s"]
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2x1,2x2", help="HOSTSxWORKERS, at least 2 hosts")
    parser.add_argument("--rate", default="100mbit", help="the link cap between hosts (tc's units)")
    parser.add_argument("--cases", default="ddp,powersgd,shm,localsgd:25,diloco:25,streaming:25")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="steps between checkpoints (a multiple of every H)")
    parser.add_argument("--per-worker", type=int, default=8, help="sequences per worker per step")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fragments", type=int, default=5)
    parser.add_argument("--stream-dtype", default="int4")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--out", default="bench-out/diloco-hosts")
    parser.add_argument("--rescore", action="store_true", help="run nothing: score OUT's runs again and rewrite "
                        "the table (validation losses already scored are kept)")
    args = parser.parse_args()
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    for case in split(args.cases):
        h = case.partition(":")[2].partition(":")[0]
        if h and (args.every % int(h) and int(h) % args.every):
            parser.error(f"--every {args.every} and H = {h}: one must divide the other (checkpoints at outer steps)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    if args.rescore:
        rows = [score(out / "runs" / r["name"], {k: v for k, v in r.items()
                                                  if k not in ("curve", "step_time_s", "compute_share")},
                      {p["step"]: p["val_loss"] for p in r["curve"]}) for r in rows]
        results.write_text(json.dumps(rows, indent=1) + "\n")
        (out / "table.md").write_text(table(rows))
        print(table(rows))
        return 0
    for layout in split(args.layouts):
        for case in split(args.cases):
            row = run_case(case, layout, args, out)
            final = row["curve"][-1]
            print(f"{row['name']}: val loss {final['val_loss']:.4f} after {final['train_s']:.1f} s of training "
                  f"(step {row['step_time_s'] * 1e3:.0f} ms; {row['wall_s']:.0f} s in all)", flush=True)
            rows = [r for r in rows if r["name"] != row["name"]] + [row]
            results.write_text(json.dumps(rows, indent=1) + "\n")
            (out / "table.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
