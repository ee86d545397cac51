"""``ringtrain bench train``: training throughput, scaling efficiency, exposed communication and overhead.

For every (workers, strategy, accumulation) it runs the real `ringtrain train` for a fixed number of steps
(per-worker batch fixed: weak scaling), and a bare PyTorch DDP loop (`bench/bare_ddp.py`) on the same
model, data, optimizer and sample order, one after the other in the same run. From the runs' metrics:

- median step time (of ``interval``-step means), samples/s;
- weak-scaling efficiency ``thr_n / (n · thr_1)``;
- exposed-communication fraction of the step, peak memory, the mean step-time breakdown;
- ringtrain's overhead: median step time of ringtrain DDP / bare DDP, and whether their final weights are
  bit-identical.

    ringtrain bench train configs/bench_resnet18.toml --nproc 1,2 --strategies ddp,ddp:shm --accum 1,4 --out bench-out/train
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ringtrain.group.init import interface_for_address
from ringtrain.errors import RingtrainError
from ringtrain.launch import LOOPBACK

__all__ = ["TrainCase", "parse_strategies", "run_train_bench", "LAYOUTS"]

# Phases of the step breakdown, as the loop books them (time/<phase>_s).
_PHASES = ("data", "forward_backward", "tp_comm", "cp_comm", "pipeline_wait", "comm_exposed", "optimizer", "monitor")


@dataclass(frozen=True)
class TrainCase:
    runner: str
    """'ringtrain' or 'bare' (the plain PyTorch DDP reference)."""
    world_size: int
    grad_accum_steps: int
    strategy: str = "ddp"
    algorithm: str = "torch"

    @property
    def name(self) -> str:
        what = "bare-ddp" if self.runner == "bare" else f"{self.strategy}-{self.algorithm}"
        return f"{what}-n{self.world_size}-accum{self.grad_accum_steps}"

    @property
    def label(self) -> str:
        if self.runner == "bare":
            return "bare DDP"
        return self.strategy if self.algorithm == "torch" else f"{self.strategy}:{self.algorithm}"


@dataclass
class TrainResult:
    case: TrainCase
    median_step_s: float
    samples_per_s: float
    global_batch_size: int
    breakdown_s: dict[str, float] = field(default_factory=dict)
    comm_exposed_fraction: float = 0.0
    monitor_fraction: float = 0.0
    """Share of the step spent in ringtrain's monitoring (progress bar, metric records, their collective)."""
    peak_rss_mb: float = 0.0
    model_state_mb: float = 0.0
    """Parameters, gradients, optimizer state and strategy buffers of the largest rank (``model_state_mb``)."""
    scaling_efficiency: float | None = None
    overhead_vs_bare: float | None = None
    bit_identical_to_bare: bool | None = None

    def row(self) -> dict[str, Any]:
        row = {**asdict(self.case), "name": self.case.name, "label": self.case.label}
        row.update({k: v for k, v in asdict(self).items() if k != "case"})
        return row


LAYOUTS = {"tp": ("ddp", "tp", -1), "tp+sp": ("ddp", "tp", -1), "fsdp+tp": ("fsdp", "tp", 2), "pp": ("ddp", "pp", -1),
           "ddp+pp": ("ddp", "pp", 2)}
"""Model-parallel cases by name: (comm.strategy, the split dimension, its degree; -1: every worker of the run).
'tp': one tensor-parallel group ('tp+sp': with sequence parallelism); 'fsdp+tp': tensor-parallel pairs, FSDP2
across them; 'pp': one pipeline;
'ddp+pp': two-stage pipelines, their gradients averaged. The ranks of one tp group or pipeline read the same
samples, so a step's batch is local x accumulation x the data-parallel ranks (the workers / the degree). Every
other case runs unsplit (tp = pp = 1, whatever the config says)."""


def split_degree(case: TrainCase) -> int:
    """The case's tensor- or pipeline-parallel degree (1: data parallel only)."""
    if case.runner != "ringtrain" or case.strategy not in LAYOUTS:
        return 1
    degree = LAYOUTS[case.strategy][2]
    return case.world_size if degree == -1 else min(degree, case.world_size)


def parse_strategies(text: str) -> list[tuple[str, str]]:
    """'ddp,ddp:shm,manual' -> [('ddp', 'torch'), ('ddp', 'shm'), ('manual', 'torch')]."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        strategy, _, algorithm = item.partition(":")
        pairs.append((strategy, algorithm or "torch"))
    if not pairs:
        raise RingtrainError("--strategies is empty; name at least one, e.g. ddp or ddp:shm")
    return pairs


def run_train_bench(
    config: str,
    nprocs: list[int],
    strategies: list[tuple[str, str]],
    accums: list[int],
    out_dir: Path,
    steps: int = 40,
    interval: int = 5,
    repeat: int = 1,
    overrides: list[str] = (),
    bare: bool = True,
) -> list[TrainResult]:
    """Run every case one after another (never two at once: they would share the cores). With ``repeat``
    above 1 the cases take turns (bare, ringtrain..., bare, ringtrain...) so slow spells of a shared machine
    hit all of them alike; each case's intervals are pooled."""
    from ringtrain.config import load_config

    base = load_config(config, list(overrides))
    local = base.train.local_batch_size
    results = []
    for accum in accums:
        for nproc in nprocs:
            settings = [
                *overrides,
                f"train.global_batch_size={local * accum * nproc}",
                f"train.max_steps={steps}",
                # A constant lr and no mid-run evaluation or checkpoint: the bare loop has none of them.
                "train.lr_schedule=constant",
                "train.warmup_steps=0",
                "monitor.eval_every_epochs=0",
                f"monitor.log_every_steps={interval}",
                "monitor.progress=false",
                f"checkpoint.every_steps={steps + 1}",
            ]
            bare_case = TrainCase("bare", nproc, accum)
            cases = [TrainCase("ringtrain", nproc, accum, s, a) for s, a in strategies]
            bare_times: list[float] = []
            records: dict[TrainCase, list[dict]] = {case: [] for case in cases}
            for _ in range(repeat):
                if bare:
                    bare_times += _run_bare(config, bare_case, settings, out_dir, steps, interval)
                for case in cases:
                    records[case] += _run_ringtrain(config, case, settings, out_dir)
            reference = None
            if bare:
                reference = TrainResult(bare_case, statistics.median(bare_times), 0, local * accum * nproc)
                reference.samples_per_s = reference.global_batch_size / reference.median_step_s
                results.append(reference)
            for case in cases:
                result = _ringtrain_result(case, records[case], local * accum * nproc // split_degree(case))
                if reference is not None:
                    _compare_with_bare(result, reference, out_dir)
                results.append(result)
    _add_scaling_efficiency(results)
    return results


def _run_ringtrain(config: str, case: TrainCase, settings: list[str], out_dir: Path) -> list[dict]:
    """One run of `ringtrain train`; its training records after the first (warm-up) interval."""
    run_dir = _fresh_run_dir(out_dir, case)
    args = ["train", config, "--nproc", str(case.world_size), "--run-dir", str(run_dir)]
    strategy, layout = case.strategy, ["parallel.tp=1", "parallel.pp=1"]
    algorithm = case.algorithm
    if strategy in LAYOUTS:  # model parallel: the same samples for a tp group or pipeline, no micro-batch shrinking
        strategy, dimension, degree = LAYOUTS[strategy][0], LAYOUTS[strategy][1], split_degree(case)
        batch = next(int(s.partition("=")[2]) for s in settings if s.startswith("train.global_batch_size="))
        layout = [f"parallel.tp={degree if dimension == 'tp' else 1}", f"parallel.pp={degree if dimension == 'pp' else 1}",
                  "train.auto_micro_batch=false", f"train.global_batch_size={batch // degree}"]
        if case.strategy == "tp+sp" and degree > 1:
            layout.append("parallel.sequence_parallel=true")
        if dimension == "tp" and degree > 1 and algorithm != "torch":  # 'tp:shm': the tensor-parallel all-reduces
            layout.append(f"parallel.tp_algorithm={algorithm}")
            algorithm = "torch"
    for setting in [*settings, f"comm.strategy={strategy}", *layout] + (
        [f"comm.algorithm={algorithm}"] if algorithm != "torch" else []
    ):
        args += ["--set", setting]
    _run([sys.executable, "-m", "ringtrain", *args], case, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r.get("type") == "train"][1:]
    if not steady:
        raise RingtrainError(f"{case.name}: too few logged intervals; raise --steps")
    return steady


def _ringtrain_result(case: TrainCase, steady: list[dict], global_batch_size: int) -> TrainResult:
    step_s = statistics.median(r["step_time_s"] for r in steady)
    breakdown = {p: statistics.fmean(r.get(f"time/{p}_s", 0.0) for r in steady) for p in _PHASES}
    mean_step = statistics.fmean(r["step_time_s"] for r in steady)
    return TrainResult(
        case=case,
        median_step_s=step_s,
        samples_per_s=global_batch_size / step_s,
        global_batch_size=global_batch_size,
        breakdown_s=breakdown,
        comm_exposed_fraction=breakdown["comm_exposed"] / mean_step,
        monitor_fraction=breakdown["monitor"] / mean_step,
        peak_rss_mb=max(r.get("memory/peak_rss_mb", 0.0) for r in steady),
        model_state_mb=max(r.get("model_state_mb", 0.0) for r in steady),
    )


def _run_bare(config: str, case: TrainCase, settings: list[str], out_dir: Path, steps: int, interval: int) -> list[float]:
    """One run of the bare DDP loop; its interval step times after the first (warm-up) interval."""
    run_dir = _fresh_run_dir(out_dir, case)
    # Rendezvous, store and Gloo all on loopback, as ringtrain binds them: left to torchrun's
    # --standalone, Gloo binds to whatever the host name resolves to, which on some hosts is unreachable.
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(case.world_size),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:0", "--local-addr", LOOPBACK,
               "-m", "ringtrain.bench.bare_ddp", config, "--steps", str(steps), "--interval", str(interval),
               "--out", str(run_dir)]
    for setting in settings:
        command += ["--set", setting]
    _run(command, case, run_dir, {"GLOO_SOCKET_IFNAME": interface_for_address(LOOPBACK)})
    return json.loads((run_dir / "result.json").read_text())["interval_step_times_s"][1:]


def _compare_with_bare(result: TrainResult, bare: TrainResult, out_dir: Path) -> None:
    result.overhead_vs_bare = result.median_step_s / bare.median_step_s
    if result.case.strategy != "ddp" or result.case.algorithm != "torch":
        return  # other algorithms round differently; only plain DDP must match bit for bit
    from ringtrain.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(out_dir / "runs" / result.case.name / "checkpoints", is_writer=False)
    ours = manager.load(manager.latest())["model"]
    theirs = torch.load(out_dir / "runs" / bare.case.name / "final_model.pt", weights_only=True)
    result.bit_identical_to_bare = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _add_scaling_efficiency(results: list[TrainResult]) -> None:
    for result in results:
        case = result.case
        single = [r for r in results if r.case == TrainCase(case.runner, 1, case.grad_accum_steps, case.strategy, case.algorithm)]
        if single and single[0].samples_per_s:
            result.scaling_efficiency = result.samples_per_s / (case.world_size * single[0].samples_per_s)


def _fresh_run_dir(out_dir: Path, case: TrainCase) -> Path:
    """The case's scratch run directory under OUT/runs, emptied: a re-run replaces the last one."""
    run_dir = out_dir / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def _run(command: list[str], case: TrainCase, run_dir: Path, extra_env: dict[str, str] | None = None) -> None:
    """Run one case to completion; its stderr is kept in RUN_DIR/bench_stderr.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "bench_stderr.log"
    log.write_text(done.stderr)
    if done.returncode != 0:
        raise RingtrainError(f"bench case {case.name} failed: {_cause(done.stderr)} (full output: {log})")


def _cause(stderr: str) -> str:
    """The line of a failed run's stderr that says why: ringtrain's own error, else a worker's exception,
    else the exit code torchrun reports (its report ends in a banner of '=', so the last line says nothing)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    ours = [line.removeprefix("ringtrain: error: ") for line in lines if line.startswith("ringtrain: error:")]
    if ours:
        return ours[-1]
    raised = [line for line in lines if ("Error:" in line or "Exception:" in line) and "ChildFailedError" not in line]
    if raised:
        return raised[-1]
    exits = [line for line in lines if line.startswith("exitcode")]
    if exits:
        return f"a worker exited: {' '.join(exits[0].split())}"
    return lines[-1] if lines else "(no output)"
