"""ringtrain.hf.decoder_stages: a Hugging Face decoder (Llama, built from a config, never downloaded) cut into
pipeline stages that hold the model's own modules and, run one after another, compute the model's own logits.
(Through fit at pp 2 against one worker: tests/layouts/test_pipeline_split_fit.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.hf import decoder_stages

pytestmark = pytest.mark.unit


def llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


@pytest.mark.parametrize("layers, stages, sizes", [(4, 2, [2, 2]), (5, 2, [3, 2]), (3, 3, [1, 1, 1])])
def test_the_stages_hold_the_models_own_modules_and_compute_its_logits(layers, stages, sizes):
    model = llama(layers)
    made = decoder_stages(model, stages)
    assert [len(stage.layers) for stage in made] == sizes
    # Every parameter of the model in exactly one stage, the same tensor (not a copy).
    owned = [id(p) for stage in made for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        x = ids
        for stage in made:
            x = stage(x)
        expected = model(ids).logits
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_a_model_that_does_not_split_is_one_line():
    with pytest.raises(ConfigError, match=r"Linear has no model.embed_tokens, model.layers, model.norm"):
        decoder_stages(nn.Linear(2, 2), 2)
    with pytest.raises(ConfigError, match=r"2 decoder layers cannot make 3 pipeline stages .* at most 2$"):
        decoder_stages(llama(2), 3)
