"""Streaming DiLoCo through `ringtrain train --nproc 2` (issue 24): two fragments in turn, a delay of 2 steps
(the exchange an asynchronous op under comm.algorithm torch), int8 pseudo-gradients with error feedback. A
checkpoint taken while a fragment's exchange is in flight resumes to the uninterrupted run's bits, outer steps
and bytes; the bytes are the analytic count of exchanges times each fragment's packet; every sample once."""

from __future__ import annotations

import json

import pytest
import torch

from ringtrain.comm import codec
from tests.conftest import run_cli, run_main

pytestmark = pytest.mark.job

CONFIG = "configs/debug_mlp.toml"
# H = 8, F = 2: fragment 0 exchanges after steps 2, 10, 18 and steps after 4, 12; fragment 1 exchanges after
# 6, 14 and steps after 8, 16. Step 20, the last, syncs both at once (fragment 0's exchange from step 18,
# still in flight, is superseded). The checkpoint at step 6 holds fragment 1's exchange in flight.
SETS = ["--set", "comm.strategy='diloco'", "--set", "diloco.sync_every=8", "--set", "diloco.fragments=2",
        "--set", "diloco.delay=2", "--set", "diloco.dtype='int8'", "--set", "train.max_steps=20",
        "--set", "checkpoint.every_steps=6", "--set", "checkpoint.keep_last=5", "--set", "data.ledger=true"]


def test_a_checkpoint_with_an_exchange_in_flight_resumes_bit_for_bit_and_the_bytes_are_the_analytic_count(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli("train", CONFIG, "--nproc", "2", "--run-dir", str(run_dir), *SETS, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted = json.loads((run_dir / "summary.json").read_text())
    assert len(set(uninterrupted["param_sha256"])) == 1  # one model on both ranks at the end

    model = torch.load(run_dir / "checkpoints" / "step_00000006.pt", weights_only=True)["model"]
    sizes = [t.numel() for t in model.values()]  # the MLP's tensors in model order
    # Fragments cut at the tensor nearest half the values (ringtrain/parallel/diloco.py split_fragments).
    cut = min(range(1, len(sizes)), key=lambda i: abs(sum(sizes[:i]) - sum(sizes) / 2))
    f0, f1 = sum(sizes[:cut]), sum(sizes[cut:])
    exchanges = 4 * codec.packet_bytes(f0, "int8") + 3 * codec.packet_bytes(f1, "int8")
    assert uninterrupted["comm_bytes_per_worker"] == exchanges
    assert uninterrupted["outer_steps"] == 6  # 3 outer steps of each fragment
    assert uninterrupted["outer_payload_bytes"] == codec.packet_bytes(f0, "int8") + codec.packet_bytes(f1, "int8")

    for step in (12, 18, 20):  # --resume continues from step 6
        for path in (run_dir / "checkpoints").glob(f"step_{step:08d}*"):
            path.unlink()
    resumed_run = run_cli("train", CONFIG, "--nproc", "2", "--run-dir", str(run_dir), "--resume", *SETS, timeout=300)
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    assert "resumed from step_00000006.pt (step 6)" in resumed_run.stderr
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["param_sha256"] == uninterrupted["param_sha256"]
    assert (resumed["outer_steps"], resumed["comm_bytes_per_worker"]) == (6, exchanges)
    ledger = run_main("ledger", str(run_dir))
    assert ledger.returncode == 0 and "every sample exactly once per epoch" in ledger.stdout, ledger.stdout + ledger.stderr
