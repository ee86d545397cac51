"""Activation checkpointing (ringtrain/parallel/activation_checkpoint.py) in one process: what it keeps for
backward (counted with saved_tensors_hooks: a measurement, deterministic), and that it changes no number."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.models.mlp import MLP
from ringtrain.models.resnet import build_resnet
from ringtrain.models.transformer import TransformerLM
from ringtrain.monitor.memory import saved_for_backward
from ringtrain.parallel.activation_checkpoint import ac_blocks, apply_ac

pytestmark = pytest.mark.unit


def _lm() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(vocab_size=256, seq_len=128, n_layers=3, n_heads=2, d_model=64, dropout=0.1)


def _step(model, tokens: torch.Tensor, module: nn.Module | None = None):
    """Saved bytes of one forward, and the gradients of its backward (dropout on: its masks must replay).
    ``model``: the module, or a function of the tokens giving the logits from ``module``."""
    module = module if module is not None else model
    torch.manual_seed(1)
    with saved_for_backward() as saved:
        logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return saved.bytes, {name: p.grad for name, p in module.named_parameters()}


def test_full_keeps_less_than_selective_keeps_less_than_none_and_every_gradient_is_the_same():
    base, tokens = _lm(), torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(2))
    saved, grads = {}, {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        blocks = apply_ac(model, mode)
        assert len(blocks) == (0 if mode == "none" else 3)
        saved[mode], grads[mode] = _step(model, tokens)
    mb = {mode: round(b / 2**20, 2) for mode, b in saved.items()}
    print(f"saved for backward, MB: {mb}")
    assert saved["full"] < saved["selective"] < saved["none"], mb
    # Full keeps each block's input only: well under a quarter of what the unchecked model keeps here.
    assert saved["full"] < 0.25 * saved["none"], mb
    for mode in ("full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()  # the composable checkpoint renames nothing
        for name, grad in grads["none"].items():
            assert torch.equal(grads[mode][name], grad), f"{mode}: {name} differs"


def test_the_blocks_are_the_lm_layers_the_resnet_stages_and_the_mlp_body():
    lm = _lm()
    assert ac_blocks(lm) == list(lm.blocks)
    resnet = build_resnet("resnet18", num_classes=10, in_channels=1, small_input_stem=True)
    assert ac_blocks(resnet) == [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    mlp = MLP(64, [32, 16], 10)
    assert ac_blocks(mlp) == [mlp.layers]


def test_a_resnet_trains_to_the_same_gradients_with_full_checkpointing():
    torch.manual_seed(0)
    base = build_resnet("resnet18", num_classes=10, in_channels=1, small_input_stem=True)
    images = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("none", "full"):
        model = copy.deepcopy(base)
        apply_ac(model, mode)
        with saved_for_backward() as saved:
            loss = model(images).square().mean()
        loss.backward()
        results[mode] = saved.bytes, [p.grad for p in model.parameters()]
    assert results["full"][0] < results["none"][0]
    assert all(torch.equal(a, b) for a, b in zip(results["full"][1], results["none"][1]))


def test_a_model_without_blocks_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError, match="no nn.ModuleList.*activation_checkpointing = 'none'"):
        apply_ac(nn.Linear(4, 4), "full")
    assert apply_ac(nn.Linear(4, 4), "none") == []


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_huggingface_llama_keeps_less_and_trains_to_the_same_gradients_in_every_mode(attention):
    """A Hugging Face decoder (built from a config) writes each layer's keys and values into its generation cache
    (on by default): the recompute must not write them again (selective failed with 'aten.slice.Tensor ... not
    found in storage', eager attention with a size mismatch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation=attention))
    assert base.config.use_cache
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    saved, grads = {}, {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        assert len(apply_ac(model, mode)) == (0 if mode == "none" else 2)
        saved[mode], grads[mode] = _step(lambda x, model=model: model(x).logits, tokens, model)
    print(f"{attention}: saved for backward {saved}")
    assert saved["full"] < saved["selective"] < saved["none"]
    for mode in ("full", "selective"):
        assert all(torch.equal(grads[mode][name], grads["none"][name]) for name in grads["none"]), mode
