"""Hugging Face decoder models under ringtrain's layouts: ``decoder_stages``, the pipeline split ``fit`` takes.

    import ringtrain
    from ringtrain.hf import decoder_stages
    from transformers import LlamaConfig, LlamaForCausalLM

    ringtrain.fit(lambda: LlamaForCausalLM(LlamaConfig(...)), train_data, eval_data,
                  config={"parallel": {"pp": 2}}, pp_split=decoder_stages)

Any ``*ForCausalLM`` laid out as Llama is (``model.model.embed_tokens``, ``.layers``, ``.norm``, ``.rotary_emb``
and ``model.lm_head``: Llama, Mistral, Qwen2, Qwen3, Gemma, ...). Each stage holds the model's own modules (not
copies), so checkpoints name every tensor as the unsplit model does and load into any layout. Needs
``transformers`` (the ``examples`` extra); importing this module does not.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["decoder_stages", "DecoderStage"]

_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class DecoderStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder: its decoder layers ``[start, stop)``, the token embeddings
    before them on the first stage, the final norm and ``lm_head`` after them on the last. The causal mask and
    the rotary position embeddings are made here as the model's own ``forward`` makes them (no padding mask:
    the batch's sequences are whole). Takes token ids (first stage) or hidden states; returns hidden states, or
    the logits (last stage)."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.embed = model.model.embed_tokens if first else None
        self.rotary = model.model.rotary_emb
        self.layers = nn.ModuleList(model.model.layers[start:stop])
        self.norm, self.head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self.embed is not None:
            x = self.embed(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = self.rotary(x, position_ids=positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            if isinstance(x, tuple):  # older transformers: (hidden_states, ...)
                x = x[0]
        return self.head(self.norm(x)) if self.head is not None else x


def decoder_stages(model: nn.Module, stages: int) -> list[nn.Module]:
    """``fit(pp_split=decoder_stages)``: a Hugging Face decoder's layers cut into ``stages`` runs as even as they
    go (the earlier stages take one more where they do not divide: 5 layers over 2 stages are 3 + 2), one
    ``DecoderStage`` each.

        stages = decoder_stages(LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, ...)), 2)   # layers 0-1, 2-3
    """
    missing = [path for path in _PARTS if _get(model, path) is None]
    if missing:
        raise ConfigError(f"ringtrain.hf.decoder_stages splits a Hugging Face decoder laid out as Llama's "
                          f"(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head); "
                          f"{type(model).__name__} has no {', '.join(missing)}; pass fit(pp_split=...) a split of "
                          "your own")
    layers = len(model.model.layers)
    if not 0 < stages <= layers:
        raise ConfigError(f"ringtrain.hf.decoder_stages: {layers} decoder layers cannot make {stages} pipeline "
                          f"stages (each needs at least one layer); lower parallel.pp (x stages_per_rank) to at "
                          f"most {layers}")
    per, extra = divmod(layers, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + per + (1 if i < extra else 0))
    return [DecoderStage(model, bounds[i], bounds[i + 1], first=i == 0, last=i == stages - 1) for i in range(stages)]


def _get(model: nn.Module, path: str):
    for name in path.split("."):
        model = getattr(model, name, None)
        if model is None:
            return None
    return model
