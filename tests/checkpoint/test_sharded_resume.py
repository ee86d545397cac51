"""The trainer with sharded checkpoints (`[checkpoint] sharded` / `async`): a stopped and resumed run equals
the run that never stopped, bit for bit; a background save leaves one 'checkpoint' record per save and is
committed before the run ends; a sharded checkpoint resumes at another world size with the parameters it
saved; zero1/zero3 resume bit for bit from their own per-rank stretches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringtrain.checkpoint.sharded import committed, verify
from ringtrain.config import load_config
from ringtrain.train.resume import ResumePlan
from tests.distributed import run_distributed
from tests.runs import losses as _losses, records as _records
from tests.trainers import build_test_trainer, params_of, train_run

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"
PLAN = ["train.max_steps=12", "checkpoint.every_steps=4", "monitor.log_every_steps=1", "train.optimizer='adamw'",
        "train.lr=0.01"]


def train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool, stop_at: int | None = None):
    trainer = build_test_trainer(rank, world_size, DEBUG, [*PLAN, *overrides], run_dir)
    if stop_at is not None:
        trainer.total_steps = stop_at
    trainer.resume(ResumePlan(resume=resume, required=resume))
    resumed_at = trainer.state.step
    loaded = params_of(trainer)
    summary = trainer.fit()
    return {"summary": summary, "params": params_of(trainer), "resumed_at": resumed_at, "loaded": loaded}


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["sharded", "async"])
def test_a_sharded_resume_is_bit_exact(tmp_path, mode):
    flags = ["checkpoint.sharded=true"] if mode == "sharded" else ["checkpoint.async=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ref = run_distributed(train, 2, str(straight), flags, False)
    run_distributed(train, 2, str(split), flags, False, 6)  # stops after step 6, saving step 6
    got = run_distributed(train, 2, str(split), flags, True)
    assert got[0]["resumed_at"] == 6
    assert _losses(split) == _losses(straight)
    for rank in (0, 1):
        differing = [n for n in ref[rank]["params"] if not np.array_equal(ref[rank]["params"][n], got[rank]["params"][n])]
        assert not differing, f"rank {rank}: parameters differ after the sharded resume: {differing}"
    saves = _records(split, "checkpoint")
    assert [r["step"] for r in saves] == [4, 6, 8, 12], saves  # the first run: 4 and 6; the resumed one: 8 and 12
    assert all(r["sharded"] and r["async"] == (mode == "async") and r["bytes"] > 0 for r in saves)
    assert all((r["background_s"] > 0) == (mode == "async") for r in saves)
    kept = committed(split / "checkpoints")
    assert [p.name for p in kept] == ["step_00000006.dcp", "step_00000008.dcp", "step_00000012.dcp"]  # keep_last = 3
    for path in kept:
        verify(path)
    assert not list((split / "checkpoints").glob("*.pt")), "a sharded run wrote a full checkpoint"
    print(f"{mode}: stop at 6, resume: 12 losses and every parameter bit-identical; saves {[(r['step'], round(r['blocked_s'], 4)) for r in saves]}")


@pytest.mark.ranks
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path):
    """Saved by 2 workers, resumed by 1 (and the reverse): the parameters loaded are those saved."""
    two_to_one = tmp_path / "two"
    saved = run_distributed(train, 2, str(two_to_one), ["checkpoint.sharded=true"], False, 4)
    resumed = run_distributed(train, 1, str(two_to_one), ["checkpoint.sharded=true", "train.global_batch_size=16",
                                                          "train.local_batch_size=16"], True, 8)
    assert resumed[0]["resumed_at"] == 4
    for name, value in saved[0]["params"].items():
        assert np.array_equal(resumed[0]["loaded"][name], value), name
    one_to_two = tmp_path / "one"
    saved = run_distributed(train, 1, str(one_to_two), ["checkpoint.sharded=true"], False, 4)
    resumed = run_distributed(train, 2, str(one_to_two), ["checkpoint.sharded=true"], True, 8)
    for rank in (0, 1):
        for name, value in saved[0]["params"].items():
            assert np.array_equal(resumed[rank]["loaded"][name], value), (rank, name)


def zero_train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool, stop_at: int | None = None):
    """``full_params``, with the full optimizer state at the end too (gathered from the shards)."""
    result = full_params(rank, world_size, run_dir, overrides, resume, stop_at, optimizer_state=True)
    return {"state": result["final"], "resumed_at": result["loaded_at"]}


@pytest.mark.ranks
@pytest.mark.parametrize("strategy,mode", [("zero1", "sharded"), ("zero3", "async")])
def test_a_zero_sharded_resume_is_bit_exact(tmp_path, strategy, mode):
    """Each rank saves its own stretches; stopped at 6 and resumed, parameters and optimizer state (AdamW's
    moments and step) at step 12 equal the uninterrupted run's bit for bit."""
    flags = [f"comm.strategy={strategy}", "comm.bucket_mb=0.004",
             "checkpoint.sharded=true" if mode == "sharded" else "checkpoint.async=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ref = run_distributed(zero_train, 2, str(straight), flags, False)
    run_distributed(zero_train, 2, str(split), flags, False, 6)
    got = run_distributed(zero_train, 2, str(split), flags, True)
    assert got[0]["resumed_at"] == 6
    assert _losses(split) == _losses(straight)
    for rank in (0, 1):
        assert set(got[rank]["state"]) == set(ref[rank]["state"]) and any(k.endswith("exp_avg") for k in ref[rank]["state"])
        differing = [k for k, v in ref[rank]["state"].items() if not np.array_equal(v, got[rank]["state"][k])]
        assert not differing, f"rank {rank}: differs after the {strategy} sharded resume: {differing}"
    saves = _records(split, "checkpoint")
    assert [r["step"] for r in saves] == [4, 6, 8, 12] and all(r["bytes"] > 0 for r in saves), saves
    assert not list((split / "checkpoints").glob("*.pt")), "a sharded run wrote a full checkpoint"


def full_params(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool, stop_at: int | None = None,
                optimizer_state: bool = False):
    """``train``, with the parameters gathered to full tensors (FSDP2 and zero3 hold shards); with
    ``optimizer_state`` the final state holds the full optimizer state too, as ``optim INDEX KEY``."""
    trainer = build_test_trainer(rank, world_size, DEBUG, [*PLAN, *overrides], run_dir)
    if stop_at is not None:
        trainer.total_steps = stop_at
    trainer.resume(ResumePlan(resume=resume, required=resume))
    loaded_at = trainer.state.step
    strategy = trainer.parts.strategy
    loaded = {n: t.numpy().copy() for n, t in strategy.full_named_parameters(trainer.model).items()}
    trainer.fit()
    final = {n: t.numpy().copy() for n, t in strategy.full_named_parameters(trainer.model).items()}
    if optimizer_state:
        for index, entry in strategy.optimizer_state_dict(trainer.parts.optimizer)["state"].items():
            final.update({f"optim {index} {k}": v.numpy().copy() for k, v in entry.items() if hasattr(v, "numpy")})
    return {"loaded": loaded, "final": final, "resumed_at": trainer.state.step, "loaded_at": loaded_at}


@pytest.mark.ranks
def test_fsdp_shards_saved_by_two_load_into_ddp_at_one(tmp_path):
    """FSDP2's DTensor shards (2 workers) -> DDP's full tensors (1 worker), through DCP's resharding."""
    run_dir = str(tmp_path / "run")
    saved = run_distributed(full_params, 2, run_dir, ["comm.strategy='fsdp'", "checkpoint.sharded=true"], False, 4)
    resumed = run_distributed(full_params, 1, run_dir, ["checkpoint.sharded=true", "train.global_batch_size=16",
                                                        "train.local_batch_size=16"], True, 6)
    assert set(resumed[0]["loaded"]) == set(saved[0]["final"])
    for name, value in saved[0]["final"].items():
        assert np.array_equal(resumed[0]["loaded"][name], value), name


@pytest.mark.job
def test_a_fresh_run_over_sharded_checkpoints_is_refused_and_resume_finds_them(tmp_path):
    from tests.conftest import run_cli, run_main

    run_dir = tmp_path / "run"
    args = ["train", str(DEBUG), "--nproc", "2", "--run-dir", str(run_dir), "--set", "checkpoint.async=true",
            "--set", "train.max_steps=4"]
    # The first run, made in the harness (the trainer `ringtrain train` builds) to save a launch.
    run_distributed(train_run, 2, str(DEBUG), ["checkpoint.async=true", "train.max_steps=4"], str(run_dir), False)
    again = run_main(*args)  # refused before any launch: ringtrain.cli.main in this process
    assert again.returncode != 0 and "already holds checkpoints (latest step_00000004.dcp)" in again.stderr
    resumed = run_cli(*args[:-1], "train.max_steps=6", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-1500:]
    assert "resumed from step_00000004.dcp (step 4)" in resumed.stderr + resumed.stdout


@pytest.mark.ranks
def test_export_gathers_a_sharded_checkpoint_into_one_safetensors_file(tmp_path):
    """FSDP2 shards of 2 workers -> one safetensors file equal to the full parameters at that step."""
    from safetensors.torch import load_file

    from tests.conftest import run_main

    run_dir = tmp_path / "run"
    saved = run_distributed(full_params, 2, str(run_dir), ["comm.strategy='fsdp'", "checkpoint.sharded=true"], False, 4)
    (run_dir / "config.toml").write_text(load_config(DEBUG, PLAN).to_toml())
    done = run_main("export", str(run_dir), "--out", str(tmp_path / "model.safetensors"))
    assert done.returncode == 0, done.stderr
    assert "from " in done.stdout and "step_00000004.dcp" in done.stdout
    exported = load_file(tmp_path / "model.safetensors")
    assert set(exported) == set(saved[0]["final"])
    for name, value in saved[0]["final"].items():
        assert np.array_equal(exported[name].numpy(), value), name
