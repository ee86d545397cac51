"""A decoder-only Transformer language model (GPT-2 shaped, after nanoGPT's model.py).

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual), learned
position embeddings, and an output layer tied to the token embedding. Bytes are the tokens (vocabulary 256).

    model = TransformerLM(vocab_size=256, seq_len=256, n_layers=4, n_heads=4, d_model=256)
    logits = model(tokens)                     # (batch, time) int64 -> (batch, time, vocab) logits
    model.flops_per_token()                    # 6N + 12*L*H*Q*T, for MFU

The model holds no buffers (the causal mask is SDPA's ``is_causal``): DDP then has nothing to broadcast in
forward, and a zero-row batch runs through it with every parameter receiving a (zero) gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TransformerLM"]


class CausalSelfAttention(nn.Module):
    attention = None
    """A function (q, k, v) -> y of [batch, heads, time, head_dim] tensors in place of causal SDPA, if set:
    ring attention under context parallelism (parallel/context.py's apply_context_parallel)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time = x.shape[:2]
        # (B, T, 3C) -> three (B, H, T, C/H) tensors. H from the width: under tensor parallelism this rank's
        # qkv holds its own heads only (q_r | k_r | v_r: parallel/tensor.py).
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(batch, time, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.attention is not None:
            y = self.attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, heads * self.head_dim)))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.ff(self.norm_ff(x))


class TransformerLM(nn.Module):
    def __init__(
        self, vocab_size: int, seq_len: int, n_layers: int, n_heads: int, d_model: int, dropout: float = 0.0
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.seq_len = seq_len
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.d_model = d_model
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # Tied: the output layer scores tokens with their input embeddings (fewer parameters, better small models).
        self.head.weight = self.token_embedding.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * layers),
        # so the stream's variance does not grow with depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.ff.down):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layers))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the tokens' positions in their sequence (default 0, 1, ...; under context parallelism
        this rank's part's global ones)."""
        time = tokens.shape[1]
        if time > self.seq_len:
            raise ValueError(f"sequence of {time} tokens is longer than the model's seq_len ({self.seq_len})")
        if positions is None:
            positions = torch.arange(time, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, by default without the position embedding (nanoGPT's count for FLOPs; the token
        embedding stays in because, tied, it is also the output layer's matmul)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.position_embedding.weight.numel() if non_embedding else total

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward): 6N for the weights, 12*L*H*Q*T for attention
        (PaLM appendix B), at the full context T = seq_len."""
        head_dim = self.d_model // self.n_heads
        return 6 * self.num_params() + 12 * self.n_layers * self.n_heads * head_dim * self.seq_len
