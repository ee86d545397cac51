"""Context parallelism through fit() for a Hugging Face model (issue 40): the Llama of tests/layouts/tp_code.py, built
from a config with SDPA attention, trained by `ringtrain run` at cp 2 (its attention swapped for ring attention
through transformers' attention interface, its position ids the chunks' global ones, its logits gathered back)
against one worker on the same batches in fp32: every step's loss rtol 1e-5, the evaluation, every parameter of
the last checkpoint within 1e-5; and a model cp cannot split is one line before step 1. (This small Llama's
positions hardly move its loss at initialisation: the fp64 test of its logits and gradients with wide weights,
tests/layouts/test_context_parallel.py, is the one that fails when the positions are left local.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_clis
from tests.runs import losses, records, summary

pytestmark = pytest.mark.job

STEPS = 4
SCRIPT = "tests/layouts/tp_code.py"
CONFIG = {"train": {"precision": "fp32", "max_steps": STEPS, "global_batch_size": 16, "local_batch_size": 8,
                    "lr": 0.01}, "monitor": {"log_every_steps": 1}, "checkpoint": {"every_steps": STEPS}}


def fit_run(run_dir: Path, case: str, nproc: int, **sections) -> list[str]:
    return ["run", SCRIPT, "--nproc", str(nproc), "--run-dir", str(run_dir), "--", "--case", case,
            "--config", json.dumps({**CONFIG, **sections})]


def test_a_huggingface_llama_split_over_cp_2_trains_as_one_worker(tmp_path):
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    results = run_clis(fit_run(one, "llama", 1), fit_run(cp2, "llama", 2, parallel={"cp": 2}), timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    mine, reference = losses(cp2), losses(one)
    assert sorted(mine) == list(range(1, STEPS + 1))
    for step in mine:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), step
    evaluated, expected = records(cp2, "eval")[-1], records(one, "eval")[-1]
    assert evaluated["count"] == expected["count"] and evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    split, whole = (torch.load(d / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"] for d in (cp2, one))
    assert split.keys() == whole.keys()
    assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 1e-5
    assert len(set(summary(cp2)["param_sha256"])) == 1
    assert all(r["time/cp_comm_s"] > 0 for r in records(cp2, "train"))


def test_a_model_context_parallelism_cannot_split_is_one_line(tmp_path):
    [result] = run_clis(fit_run(tmp_path / "run", "mixer_whole", 2, parallel={"cp": 2}), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "context parallelism splits" in line]
    assert lines and "Traceback" not in result.stderr
