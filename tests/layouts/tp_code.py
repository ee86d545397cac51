"""Tensor and pipeline parallelism through fit(), as a user's script: a Hugging Face Llama built from a config (its
own plan), Hugging Face GPT-2 (ringtrain's plan for its Conv1D layers), a model of the user's own with the plan
passed to fit(tp_plan=...), and the mistakes (a model with no plan, a plan path that names nothing); the Llama cut
into pipeline stages by the package's split (fit(pp_split=ringtrain.hf.decoder_stages)), and splits that do not fit. Run as ``ringtrain run tests/layouts/tp_code.py -- --case CASE --config
JSON`` (tests/layouts/test_tensor_parallel_fit.py)."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ringtrain
from ringtrain.hf import decoder_stages

VOCAB, LENGTH = 48, 16


class Tokens(Dataset):
    """Sequences of a few repeating patterns (learnable), as (ids[:-1], ids[1:])."""

    def __init__(self, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (count,), generator=g)
        strides = torch.randint(1, 4, (count,), generator=g)
        self.items = [(start + stride * torch.arange(LENGTH + 1)) % VOCAB for start, stride in zip(starts, strides)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        ids = self.items[index]
        return ids[:-1], ids[1:]


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager"))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # No dropout: a split run is compared with one worker's, step by step.
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class Mixer(nn.Module):
    """A user's own model: embeddings, then residual MLP blocks (``blocks.N.up`` / ``blocks.N.down``)."""

    def __init__(self, width: int = 32, hidden: int = 96, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(width), "up": nn.Linear(width, hidden),
                                                   "down": nn.Linear(hidden, width)}) for _ in range(depth))
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["down"](F.gelu(block["up"](block["norm"](x))))
        return self.out(x)


MIXER_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def llama4() -> nn.Module:
    """llama() with four decoder layers: two a stage at pp = 2, one at pp 2 x stages_per_rank 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager"))


def copying_split(model: nn.Module, stages: int) -> list[nn.Module]:
    """A split that copies the model's layers instead of using them (a mistake ringtrain names)."""
    import copy

    return [copy.deepcopy(stage) for stage in decoder_stages(model, stages)]


def leaving_split(model: nn.Module, stages: int) -> list[nn.Module]:
    """A split whose last stage forgets the final norm (a mistake ringtrain names)."""
    made = decoder_stages(model, stages)
    made[-1].norm = None
    made[-1].forward = lambda x: made[-1].head(x)
    return made


def token_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


CASES = {  # case: (model, tp_plan, pp_split)
    "llama": (llama, None, None),
    "mixer": (Mixer, MIXER_PLAN, None),
    "mixer_whole": (Mixer, None, None),  # the oracle: one worker, no plan
    "gpt2": (gpt2, None, None),
    "typo": (Mixer, {"blocks.*.upp": "colwise", "blocks.*.down": "rowwise"}, None),
    "llama4": (llama4, None, None),  # the pipeline's oracle: one worker
    "llama4_pp": (llama4, None, decoder_stages),  # the package's split for Hugging Face decoders
    "llama4_copying": (llama4, None, copying_split),
    "llama4_leaving": (llama4, None, leaving_split),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--loss", default="token_loss", help="token_loss (this script's own) or a built-in's name")
    args = parser.parse_args()
    model, plan, split = CASES[args.case]
    loss = token_loss if args.loss == "token_loss" else args.loss
    ringtrain.fit(model, Tokens(96, seed=0), Tokens(32, seed=1), loss=loss, config=json.loads(args.config),
                  tp_plan=plan, pp_split=split)


if __name__ == "__main__":
    main()
