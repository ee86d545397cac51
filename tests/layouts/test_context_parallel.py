"""Context parallelism through the trainer (``[parallel] cp``, ringtrain/parallel/context_split.py) on the
in-process harness, beyond the composition table's cp cells (cp 2 alone and beside 2 data-parallel ranks of every
strategy that composes with it: tests/layouts/test_composition_*.py): the built-in transformer's sequence split
over cp ranks trains as one worker does on the same batches (fp32: every step's loss rtol 1e-5, every parameter
1e-5) at cp 3, whose sequences are padded to a multiple of 2 cp, beside tensor
parallelism (cp 2 x tp 2, FSDP2 averaging over the cp ranks; with sequence parallelism too: cp splits the sequence
first, sp each cp rank's part over its tp ranks), beside FSDP2's HSDP (replicas of dp_shard x cp
shard groups; beside tp too, at 8 ranks) and inside pipeline stages, FSDP2-sharded (fsdp 2 x pp 2 x cp 2) or split
over tp with sequence parallelism (pp 2 x cp 2 x tp 2 + sp), 8 ranks each (the composition table holds pp 2 x cp 2
alone); the cp ranks read the same samples (the ledger holds
each sample once per step), the ring's waits are the step's cp_comm phase, and a checkpoint saved at cp 2 x dp 2
or cp 2 x tp 2 resumes at one worker on the uninterrupted run's parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ringtrain.data.ledger import check_ledger
from tests.distributed import run_distributed
from ringtrain.train.resume import ResumePlan
from tests.runs import losses, records
from tests.trainers import build_test_trainer, params_of, train_run

pytestmark = pytest.mark.ranks

CONFIG = "configs/debug_lm.toml"
STEPS = 4
BASE = [f"train.max_steps={STEPS}", "train.precision='fp32'", "train.auto_micro_batch=false", "model.dropout=0.0",
        "monitor.log_every_steps=1", "data.ledger=true"]


def train(rank: int, world_size: int, overrides: list[str], run_dir: str):
    trainer = build_test_trainer(rank, world_size, CONFIG, [*BASE, *overrides], run_dir)
    strategy, norms = trainer.parts.strategy, []
    clip = strategy.clip_grad_norm_

    def recording_clip(model, optimizer, max_norm):  # the clip's global norm, every step (SGD: taken, not applied)
        norm = clip(model, optimizer, max_norm)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        return norm

    strategy.clip_grad_norm_ = recording_clip
    trainer.fit()
    Path(run_dir, f"norms-{rank}.json").write_text(json.dumps(norms))
    full = trainer.parts.strategy.full_named_parameters(trainer.model)
    return {name: value.detach().numpy().copy() for name, value in full.items()}


SGD = ["train.optimizer='sgd'", "train.momentum=0.0", "train.lr=0.5", "train.grad_clip_norm=1e9"]
"""Plain SGD without clipping: the update is linear in the gradient, so a gradient off by the cp degree (the
sum over the cp ranks taken as their average) shows; AdamW's update hardly changes with the gradient's scale."""


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The one-worker reference run of each optimizer, made when first asked for."""
    made = {}

    def reference(optimizer: list[str]):
        key = tuple(optimizer)
        if key not in made:
            run_dir = tmp_path_factory.mktemp("one")
            params = run_distributed(train, 1, optimizer, str(run_dir), timeout_s=300)[0]
            made[key] = list(losses(run_dir).values()), params
            reference.run_dirs[key] = run_dir
        return made[key]

    reference.run_dirs = {}
    return reference


CASES = {  # cp 2 alone and beside 2 data-parallel ranks of every strategy: the composition table
    "cp3-padded": (3, ["parallel.cp=3"]),
    "cp2-tp2-sgd": (4, ["parallel.cp=2", "parallel.tp=2", "comm.strategy='fsdp'", *SGD]),
    "cp2-tp2-sp-sgd": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "comm.strategy='fsdp'",
                           *SGD]),
    "hsdp2x1-cp2-sgd": (4, ["parallel.cp=2", "parallel.dp_replicate=2", "comm.strategy='fsdp'", *SGD]),
    # HSDP beside tp and cp (8 ranks): replicas of 2-rank shard groups (dp_shard 1 x cp 2), each rank a tp half.
    # FSDP2 shards each pipeline stage over its dp x cp ranks (8 ranks).
    "fsdp2-pp2-cp2-sgd": (8, ["parallel.cp=2", "parallel.pp=2", "comm.strategy='fsdp'", *SGD]),
    # cp beside tp with sequence parallelism inside 1F1B pipeline stages (8 ranks).
    "pp2-cp2-tp2-sp-sgd": (8, ["parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                               *SGD]),
    "hsdp2x1-cp2-tp2-sgd": (8, ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.tp=2", "comm.strategy='fsdp'",
                                *SGD]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_sequence_split_over_cp_ranks_trains_as_one_worker(case, one_worker, tmp_path):
    world_size, overrides = CASES[case]
    results = run_distributed(train, world_size, overrides, str(tmp_path), timeout_s=600)
    reference_losses, reference = one_worker([o for o in overrides if o in SGD])
    assert len(losses(tmp_path)) == STEPS
    np.testing.assert_allclose(list(losses(tmp_path).values()), reference_losses, rtol=1e-5)
    for params in results:  # every rank ends on the one worker's parameters
        for name, value in reference.items():
            np.testing.assert_allclose(params[name], value, atol=1e-5, err_msg=name)
    check_ledger(tmp_path / "ledger.jsonl")  # the cp peers' shared samples counted once
    steps = records(tmp_path, "train")
    assert all(r["time/cp_comm_s"] > 0 for r in steps), steps[0]
    if case == "pp2-cp2-tp2-sp-sgd":  # the pipeline's clip norm over tp and cp ranks: the one worker's, every rank
        expected = json.loads((one_worker.run_dirs[tuple(o for o in overrides if o in SGD)] / "norms-0.json").read_text())
        for rank in range(world_size):
            norms = json.loads((tmp_path / f"norms-{rank}.json").read_text())
            np.testing.assert_allclose(norms, expected, rtol=1e-5, err_msg=f"rank {rank}'s gradient norms")
    if case == "hsdp2x1-cp2-tp2-sgd":  # HSDP: a rank holds half its tp part (shard groups of 2), not a quarter
        whole_mb = 2 * 4 * sum(value.size for value in reference.values()) / 2**20  # fp32 parameters and gradients
        held = json.loads((tmp_path / "summary.json").read_text())["model_state_mb"] / whole_mb
        assert 0.2 < held < 0.35, held


def resume_at_one_worker(rank: int, world_size: int, overrides: list[str], run_dir: str):
    trainer = build_test_trainer(rank, world_size, CONFIG, overrides, run_dir)
    trainer.resume(ResumePlan(resume=True, required=True))
    start = trainer.state.step
    trainer.fit()
    return start, params_of(trainer)


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.cp=2", "parallel.tp=2", "comm.strategy='fsdp'"]],
                         ids=["cp2-dp2", "cp2-tp2"])
def test_a_checkpoint_saved_split_over_cp_resumes_at_one_worker(layout, tmp_path, one_worker):
    split = tmp_path / "split"
    settings = [*BASE, "checkpoint.every_steps=2"]
    run_distributed(train_run, 4, CONFIG, [*settings, *layout], str(split), False, timeout_s=600)
    # Back to step 2, at one worker: the split run's step-2 checkpoint is the newest left.
    (split / "checkpoints" / f"step_{STEPS:08d}.pt").unlink()
    (split / "summary.json").unlink()
    start, params = run_distributed(resume_at_one_worker, 1, settings, str(split), timeout_s=300)[0]
    assert start == 2
    for name, value in one_worker([])[1].items():  # the one worker's uninterrupted run
        np.testing.assert_allclose(params[name], value, atol=1e-5, err_msg=name)


def llama_step(rank: int, world_size: int) -> tuple:
    """A Hugging Face Llama (SDPA attention, grouped-query heads, rotary positions; weights drawn wide so that
    attention and positions matter) on 30-token sequences (padded to a multiple of 2 cp), fp64: its logits and
    its parameters' gradients of the mean cross-entropy, split over the ranks' cp group when world_size > 1 (the
    gradients summed over it, as the data-parallel strategy's average times the loss scale makes them)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringtrain.parallel.context_split import split_context

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         initializer_range=0.5)).double()
    tokens = torch.randint(0, 48, (2, 31), generator=torch.Generator().manual_seed(1))
    if world_size > 1:
        split_context(model, dist.group.WORLD)
    logits = model(tokens[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    if world_size > 1:
        for grad in grads.values():
            dist.all_reduce(grad)
    return logits.detach().numpy(), {name: grad.numpy() for name, grad in grads.items()}


@pytest.mark.parametrize("cp", [2, 3])
def test_a_huggingface_llama_split_over_cp_ranks_computes_the_unsplit_logits_and_gradients(cp):
    [(logits, grads)] = run_distributed(llama_step, 1, timeout_s=120)
    for split_logits, split_grads in run_distributed(llama_step, cp, timeout_s=300):
        np.testing.assert_allclose(split_logits, logits, rtol=1e-9, atol=1e-9)
        for name, grad in grads.items():
            np.testing.assert_allclose(split_grads[name], grad, rtol=1e-8, atol=1e-10, err_msg=name)
