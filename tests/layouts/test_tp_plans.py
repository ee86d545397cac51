"""The tensor-parallel plans ringtrain picks for Hugging Face models (ringtrain/parallel/tensor.py), without
processes: GPT-2's (Conv1D styles on its four layers per block, checked against its heads and its
cross-attention), Llama's declared one, and the fused q | k | v reorder that GPT-2's columns and the built-in
transformer's rows go through (and back)."""

from __future__ import annotations

import pytest
import torch

from ringtrain.errors import ConfigError
from ringtrain.parallel.tensor import _to_natural, _to_ranks, huggingface_plan

pytestmark = pytest.mark.unit


def _gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=24, n_layer=2, n_head=6, **overrides))


def test_gpt2_gets_conv1d_styles_on_its_four_layers_per_block():
    plan = huggingface_plan(_gpt2(), tp=2)
    assert {path: type(style).__name__ for path, style in plan.items()} == {
        "transformer.h.*.attn.c_attn": "Conv1DColwise", "transformer.h.*.attn.c_proj": "Conv1DRowwise",
        "transformer.h.*.mlp.c_fc": "Conv1DColwise", "transformer.h.*.mlp.c_proj": "Conv1DRowwise"}


@pytest.mark.parametrize("overrides, tp, words", [
    ({}, 4, "tp = 4 does not divide GPT2LMHeadModel's n_head (6)"),
    ({"add_cross_attention": True}, 2, "GPT2LMHeadModel has cross-attention"),
])
def test_a_gpt2_the_plan_cannot_split_is_one_line(overrides, tp, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        huggingface_plan(_gpt2(**overrides), tp=tp)


def test_llama_keeps_its_declared_plan_and_a_plain_module_has_none():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    plan = huggingface_plan(llama, tp=2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert huggingface_plan(torch.nn.Linear(2, 2), tp=2) is None


@pytest.mark.parametrize("dim", [0, 1])
def test_rank_order_gives_each_rank_its_own_q_k_v_and_goes_back(dim):
    tp, width = 2, 4  # q, k, v each 4 wide: rank r holds q_r | k_r | v_r, 2 wide each
    full = torch.arange(3 * width).repeat(5, 1)  # (5, 12): columns numbered
    full = full if dim == 1 else full.t().contiguous()
    ranked = _to_ranks(full, tp, dim)
    first = ranked.narrow(dim, 0, 3 * width // tp).flatten().unique().tolist()
    assert first == [0, 1, 4, 5, 8, 9]  # q_0, k_0, v_0
    assert torch.equal(_to_natural(ranked, tp, dim), full)


def test_sequence_parallelism_derives_a_plans_layouts_and_refuses_a_style_that_sets_its_own():
    """parallel/sequence_split.py: 'colwise' gathers the sequence before the split, 'rowwise' reduce-scatters into
    it (GPT-2's Conv1D styles keep their class); a ParallelStyle with layouts of its own is one line naming it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ringtrain.parallel.sequence_split import sequence_parallel_plan
    from ringtrain.parallel.tensor import Conv1DColwise

    derived = sequence_parallel_plan({"a.up": "colwise", "a.down": "rowwise", "a.qkv": Conv1DColwise()})
    assert isinstance(derived["a.up"], ColwiseParallel) and derived["a.up"].input_layouts == (Shard(1),)
    assert isinstance(derived["a.down"], RowwiseParallel) and derived["a.down"].output_layouts == (Shard(1),)
    assert type(derived["a.qkv"]) is Conv1DColwise and derived["a.qkv"].input_layouts == (Shard(1),)
    with pytest.raises(ConfigError, match=r"^\[parallel\] sequence_parallel = true: tp_plan\['a.out'\] is a "
                                          r"ColwiseParallel that sets its own input and output layouts.*leave "
                                          r"sequence_parallel unset$"):
        sequence_parallel_plan({"a.out": ColwiseParallel(output_layouts=Replicate())})
