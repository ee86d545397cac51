"""Tensor parallelism through `ringtrain train` (``[parallel] tp``): what only the launcher can show, a layout it
refuses in one line before any worker starts. The parity proofs (tp = 2 alone, with shm, activation checkpointing
and sequence parallelism; FSDP2 x tp, HSDP and whole replicas beside tp; each sample dealt once per data-parallel
rank; full and sharded checkpoints crossing layouts) run in-process: tests/layouts/test_composition_*.py. The CLI
path of a tensor-parallel layout, with its ledger across a real job: tests/heal/test_heal_replicas.py (dp 2 x tp 2
under `ringtrain train --heal`); tp inside a pipeline's stages on 8 ranks, in the harness:
tests/layouts/test_tensor_pipeline_parallel.py."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.job


def test_a_layout_tensor_parallelism_cannot_run_is_one_line_before_any_worker(tmp_path):
    result = run_cli("train", "configs/debug_lm.toml", "--nproc", "2", "--min-nproc", "1", "--heal",
                     "--run-dir", str(tmp_path / "run"), "--set", "parallel.tp=-1", "--set", "train.auto_micro_batch=false")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and ("--min-nproc 1 with a model split over 2 ranks (tp x cp x pp): a split model heals by "
                                "whole replicas of 2 workers; set --min-nproc to a multiple of 2") in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
