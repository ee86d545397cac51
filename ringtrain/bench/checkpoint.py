"""``ringtrain bench checkpoint``: how long a sharded save blocks training, synchronous against background.

The config's model (FSDP2-sharded across the workers; one worker keeps it whole) and its AdamW
state are saved with ``ShardedCheckpointer`` (checkpoint/sharded.py), alternately synchronously and in the
background, ``--repeat`` times each; the medians and their ratio are written to ``OUT/checkpoint_bench.json``.

    ringtrain bench checkpoint configs/text_lm.toml --nproc 2 --repeat 5 --out bench-out/checkpoint
"""

from __future__ import annotations

import argparse
import json
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ringtrain.errors import RingtrainError

__all__ = ["run_checkpoint_bench"]


def run_checkpoint_bench(config: str, nproc: int, repeat: int, out: Path) -> dict:
    """Launch the workers (torch's launcher), return rank 0's result."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "ringtrain.bench.checkpoint", config, "--repeat", str(repeat), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RingtrainError(f"checkpoint bench failed: {lines[-1] if lines else done.returncode}")
    return json.loads((out / "checkpoint_bench.json").read_text())


def _worker(config_path: str, repeat: int, out: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ringtrain.checkpoint.sharded import ShardedCheckpointer
    from ringtrain.config import DistConfig, load_config
    from ringtrain.data import build_datasets
    from ringtrain.group.env import DistEnv
    from ringtrain.group.init import init_distributed
    from ringtrain.models import build_model

    config = load_config(config_path)
    with init_distributed(DistEnv.from_environ(), DistConfig(backend="gloo", flight_recorder=0)) as ctx:
        torch.manual_seed(0)
        model = build_model(config.model, build_datasets(config.data))
        if ctx.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # One unit: every parameter sharded across the workers, which is all a checkpoint sees.
            fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model_sd, optim_sd = get_state_dict(model, optimizer)  # allocates AdamW's moments
        state = {"model": model_sd, "optimizer": optim_sd}
        folder = out / "checkpoints"  # the same folder for every rank; removed at the end
        out.mkdir(parents=True, exist_ok=True)
        try:
            ckpt = ShardedCheckpointer(folder, ctx.rank, ctx.world_size, keep_last=2)
            ckpt.save(0, state).result()  # warm-up: DCP's first plan, the folder, the page cache
            sync, blocked, background, nbytes = [], [], [], 0
            for i in range(repeat):
                report = ckpt.save(2 * i + 1, state).result()
                sync.append(report.blocked_s)
                nbytes = report.bytes
                start = time.perf_counter()
                pending = ckpt.save(2 * i + 2, state, async_save=True)
                blocked.append(time.perf_counter() - start)
                background.append(pending.result(timeout=600).background_s)
        finally:
            torch.distributed.barrier()
            if ctx.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
        params = sum(p.numel() for p in model.parameters())
        if ctx.rank == 0:
            result = {
                "config": config_path, "world_size": ctx.world_size, "repeat": repeat,
                "parameters_local": params, "bytes_rank0": nbytes,
                "sync_save_s": statistics.median(sync), "async_blocked_s": statistics.median(blocked),
                "async_background_s": statistics.median(background),
                "blocked_ratio": statistics.median(blocked) / statistics.median(sync),
                "sync_all_s": sync, "async_blocked_all_s": blocked,
            }
            (out / "checkpoint_bench.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _worker(args.config, args.repeat, Path(args.out))


if __name__ == "__main__":
    main()
