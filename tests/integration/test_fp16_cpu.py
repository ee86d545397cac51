"""fp16 with torch's GradScaler on CPU workers, through `ringtrain train` as a user runs it.

torch's GradScaler scales CPU gradients as it does CUDA ones, so fp16 is no longer refused over Gloo: the
replicated strategy (DDP) and the sharded ones (zero2, FSDP2: each rank unscales its own gradient shard, the
overflow verdict rides on the step agreement) train to the same parameters, bit for bit, without accumulation.
"""

from __future__ import annotations

import json
import math

from tests.conftest import run_cli


def _train(tmp_path, strategy: str) -> dict:
    run_dir = tmp_path / strategy
    result = run_cli("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir),
                     "--set", "train.precision=fp16", "--set", f"comm.strategy={strategy}",
                     "--set", "train.local_batch_size=32", "--set", "train.auto_micro_batch=false")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("type") == "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"losses": losses, **summary}


def test_fp16_trains_on_cpu_with_ddp_zero2_and_fsdp_to_the_same_parameters(tmp_path):
    ddp, zero2, fsdp = _train(tmp_path, "ddp"), _train(tmp_path, "zero2"), _train(tmp_path, "fsdp")
    print(f"fp16 on CPU: ddp loss {ddp['losses'][0]:.3f} -> {ddp['final_loss']:.3f}, "
          f"zero2 -> {zero2['final_loss']:.3f}, fsdp -> {fsdp['final_loss']:.3f}; param_sha256 {ddp['param_sha256'][0][:12]} / {zero2['param_sha256'][0][:12]}")
    assert math.isfinite(ddp["final_loss"]) and ddp["final_loss"] < ddp["losses"][0]
    assert ddp["param_sha256"] == zero2["param_sha256"] == fsdp["param_sha256"]
    assert ddp["steps"] == zero2["steps"] == fsdp["steps"] > 0
