"""Compressed exchange of fp32 vectors: bf16, int8 and int4 packets, and their exact byte counts.

DiLoCo's outer step exchanges pseudo-gradients; across slow links their size is the cost, so they travel
compressed (Streaming DiLoCo, arXiv 2501.18512, sends 4 bits; INTELLECT-1 8). A sum of quantized values is
not a quantized value, so compressed vectors are not all-reduced: every rank's packet is all-gathered
(``comm.all_gather``, any algorithm) and each rank decodes them in rank order and sums in fp32 -- the same
bytes and the same operations everywhere, so every rank gets the same bits.

    >>> packet = encode(x, "int8")                  # uint8, packet_bytes(x.numel(), "int8") long
    >>> y = decode(packet, "int8", x.numel())       # fp32; |x - y| <= absmax of x's block / 254

Formats (little-endian, as the host's memory): ``bf16`` is the values rounded to bfloat16 (2 bytes each).
``int8`` and ``int4`` cut the vector into blocks of ``BLOCK`` values, each with its fp32 scale (the block's
largest magnitude over 127, or over 7): first every block's scale, then the values rounded to the nearest
multiple of it, one byte each (int8), or two to a byte (int4: q + 8 in each nibble, the even index low).
Rounding is to nearest, ties to even; what is lost is the caller's to keep (error feedback).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "BLOCK", "packet_bytes", "encode", "decode"]

DTYPES = ("bf16", "int8", "int4")
BLOCK = 256
"""Values per fp32 scale (int8, int4): 1.6% more bytes for int8, 3.1% for int4."""
_LEVELS = {"int8": 127, "int4": 7}


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def packet_bytes(numel: int, dtype: str) -> int:
    """Bytes one encoded vector of ``numel`` values takes."""
    if dtype == "bf16":
        return 2 * numel
    if dtype == "int8":
        return 4 * _blocks(numel) + numel
    if dtype == "int4":
        return 4 * _blocks(numel) + -(-numel // 2)
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def encode(x: torch.Tensor, dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 1-D fp32 ``x`` as a uint8 packet (into ``out`` when given, which must be long enough)."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"encode needs a 1-D float32 tensor, got {x.dim()}-D {x.dtype}")
    size = packet_bytes(x.numel(), dtype)
    packet = torch.empty(size, dtype=torch.uint8, device=x.device) if out is None else out[:size]
    if dtype == "bf16":
        packet.view(torch.bfloat16).copy_(x)
        return packet
    levels, blocks = _LEVELS[dtype], _blocks(x.numel())
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    padded = padded.view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe[:, None]).clamp_(-levels, levels).to(torch.int8).view(-1)[: x.numel()]
    packet[: 4 * blocks].view(torch.float32).copy_(scales)
    body = packet[4 * blocks :]
    if dtype == "int8":
        body.view(torch.int8).copy_(q)
        return packet
    nibbles = (q + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    pairs = nibbles.view(-1, 2)
    body.copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    return packet


def decode(packet: torch.Tensor, dtype: str, numel: int) -> torch.Tensor:
    """The fp32 values of an ``encode``d packet of ``numel`` values."""
    if dtype == "bf16":
        return packet[: 2 * numel].view(torch.bfloat16).to(torch.float32)
    blocks = _blocks(numel)
    scales = packet[: 4 * blocks].view(torch.float32)
    body = packet[4 * blocks : packet_bytes(numel, dtype)]
    if dtype == "int8":
        q = body.view(torch.int8).to(torch.float32)
    else:
        q = torch.stack([body & 0x0F, body >> 4], dim=1).view(-1)[:numel].to(torch.float32) - 8
    full = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=packet.device)
    full[:numel] = q
    return (full.view(blocks, BLOCK) * scales[:, None]).view(-1)[:numel]
