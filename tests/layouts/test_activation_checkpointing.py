"""Activation checkpointing on 2 ranks: 'full' and 'selective' end on the same parameters as 'none', bit for bit
(recompute on CPU is deterministic), replicated (ddp), sharded (fsdp: FSDP2's fully_shard over checkpointed blocks;
zero3) and split into a pipeline's two stages (pp 2, ``configs/debug_pp.toml``: each stage recomputes its own blocks
inside the schedule). The summary says the blocks were checkpointed, so a run that ignored the setting cannot pass.
And under tensor parallelism (tp 2: each rank recomputes its half of every block, the split layers' all-reduces
included). Each run is the trainer `ringtrain train` builds, in the harness's ranks (tests/distributed.py; issue 45:
the setting is the workers' to apply, the launcher only passes the config on)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed
from tests.trainers import train_run

pytestmark = pytest.mark.ranks

MODES = ("none", "full", "selective")


LAYOUTS = {"ddp": ("configs/debug_lm.toml", "ddp", 2, ()), "fsdp": ("configs/debug_lm.toml", "fsdp", 2, ()),
           "zero3": ("configs/debug_lm.toml", "zero3", 2, ()), "pp": ("configs/debug_pp.toml", "ddp", 4, ()),
           "tp": ("configs/debug_lm.toml", "ddp", 2, ("parallel.tp=-1",))}
"""Layout -> config, comm.strategy, the model's blocks and what else it sets."""


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_checkpointed_runs_end_on_the_parameters_of_the_plain_run(tmp_path, strategy):
    config, comm, blocks, extra = LAYOUTS[strategy]
    for mode in MODES:
        overrides = ["train.max_steps=3", "train.auto_micro_batch=false", f"comm.strategy='{comm}'",
                     f"train.activation_checkpointing='{mode}'", *extra]
        run_distributed(train_run, 2, config, overrides, str(tmp_path / mode), False, timeout_s=240)
    summaries = {mode: json.loads((tmp_path / mode / "summary.json").read_text()) for mode in MODES}
    digests = {mode: summary["param_sha256"] for mode, summary in summaries.items()}
    print(f"{strategy}: {({mode: d[0][:12] for mode, d in digests.items()})}")
    assert len(digests["none"]) == 2 and len(set(digests["none"])) == 1
    assert digests["full"] == digests["none"] and digests["selective"] == digests["none"]
    assert summaries["none"]["steps"] == 3 and "activation_checkpointing" not in summaries["none"]
    for mode in ("full", "selective"):
        assert summaries[mode]["activation_checkpointing"] == {"mode": mode, "blocks": blocks}
