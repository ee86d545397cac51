"""A Hugging Face GPT-2 learns Python from the bytes of the standard library, trained by ringtrain.fit.

    ringtrain run examples/gpt2_stdlib.py --nproc 2                              # the whole stdlib
    ringtrain run examples/gpt2_stdlib.py --nproc 2 -- --files 'asyncio/*.py' --steps 150   # CI-sized

The model is built from its config (nothing is downloaded); tokens are bytes (vocabulary 256).
"""

import argparse
import math
import os
import sysconfig
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to fetch: no weights, no tokenizer

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import ringtrain

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SKIP_FOLDERS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


def read_corpus(pattern: str) -> tuple[bytes, bytes]:
    """The stdlib files matching pattern (test suites left out), split about 90/10 by a hash of the path."""
    train, val = [], []
    for path in sorted(STDLIB.glob(pattern)):
        relative = path.relative_to(STDLIB)
        if path.is_file() and not SKIP_FOLDERS & set(relative.parts[:-1]):
            # A hash of the path, not the listing order, decides: no file is on both sides.
            (val if zlib.crc32(str(relative).encode()) % 10 == 0 else train).append(path.read_bytes())
    return b"".join(train), b"".join(val)


def unigram_entropy(data: bytes) -> float:
    """Nats per byte of the best model that ignores context: the loss to beat."""
    counts = torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), minlength=256)
    p = counts[counts > 0].double() / len(data)
    return float(-(p * p.log()).sum())


class NextByte(Dataset):
    """Consecutive windows of seq_len + 1 bytes: the model reads w[:-1], the targets are w[1:]."""

    def __init__(self, data: bytes, seq_len: int):
        self.data, self.seq_len = torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        window = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return {"input_ids": window[:-1]}, window[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="**/*.py", help="glob under the stdlib folder (default: all .py)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    train_bytes, val_bytes = read_corpus(args.files)
    entropy = unigram_entropy(train_bytes)
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4,
        bos_token_id=None, eos_token_id=None,  # GPT-2's defaults (50256) lie outside a byte vocabulary
    )
    summary = ringtrain.fit(
        model=lambda: GPT2LMHeadModel(config),
        train_data=NextByte(train_bytes, args.seq_len),
        eval_data=NextByte(val_bytes, args.seq_len),
        loss="cross_entropy",  # logits (batch, time, 256) against next-byte targets, mean per target byte
        config={
            "train": {
                "epochs": 1000, "max_steps": args.steps, "global_batch_size": 32, "local_batch_size": 16,
                "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 20,
                "grad_clip_norm": 1.0,
            },
            "monitor": {"eval_every_epochs": 0},
        },
    )
    if int(os.environ.get("RANK", 0)) == 0:
        val_loss = summary["eval"]["loss"]
        print(f"val loss {val_loss:.3f} nats/byte (perplexity {math.exp(val_loss):.2f}) after {summary['steps']} "
              f"steps, {summary['wall_s']:.0f} s; unigram entropy {entropy:.3f} nats/byte "
              f"({len(train_bytes):,} train bytes, {len(val_bytes):,} val bytes)")


if __name__ == "__main__":
    main()
