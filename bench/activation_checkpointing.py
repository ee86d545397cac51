"""Activation checkpointing on the built-in LM: memory kept for backward, peak memory and step time, per mode.

    .venv/bin/python bench/activation_checkpointing.py configs/text_lm.toml --steps 4 --rounds 2 --out bench-out/ac

For each of none / full / selective, a fresh process (so that its peak RSS is its own) builds the config's
Transformer (``--set`` scales it, as for ``ringtrain train``), applies ``[train] activation_checkpointing`` as
``build_trainer`` does, and trains on random tokens of ``data.seq_len`` (``train.local_batch_size`` sequences,
the config's precision, AdamW) for a warm-up step and ``--steps`` timed ones, one compute thread; ``--rounds``
times, the order of the modes rotated each round. It reports:

- ``saved_mb``: what autograd keeps for backward over one forward (``monitor.memory.saved_for_backward``:
  deterministic, the number the mode changes);
- ``peak_step_mb``: peak RSS during the steps above the RSS before them (the activations' high-water mark as
  the OS sees it; the allocator's caching makes it noisier than saved_mb);
- ``median_step_s``: forward + backward + optimizer step (wall time: noisy on a shared machine).

It prints a table and writes ``OUT/results.json``. Random tokens: the cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("none", "full", "selective")


def measure(config_path: str, overrides: list[str], mode: str, steps: int) -> dict:
    """One mode in this process (the child's work)."""
    import psutil
    import torch

    from ringtrain.config import load_config
    from ringtrain.models.transformer import TransformerLM
    from ringtrain.monitor.memory import saved_for_backward
    from ringtrain.parallel.activation_checkpoint import apply_ac

    torch.set_num_threads(1)
    config = load_config(config_path, [*overrides, f"train.activation_checkpointing='{mode}'"])
    model_cfg, train = config.model, config.train
    torch.manual_seed(train.seed)
    seq_len = config.data.seq_len
    model = TransformerLM(256, seq_len, model_cfg.n_layers, model_cfg.n_heads, model_cfg.d_model, model_cfg.dropout)
    blocks = apply_ac(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (train.local_batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.precision == "bf16")

    def step() -> int:
        with saved_for_backward() as saved, autocast:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return saved.bytes

    rss_before = psutil.Process().memory_info().rss
    saved_bytes = step()  # warm-up: first-touch allocations, bf16 kernels
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "blocks": len(blocks), "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "tokens_per_step": inputs.numel(), "saved_mb": round(saved_bytes / 2**20, 1),
            "peak_step_mb": round((peak - rss_before) / 2**20, 1), "median_step_s": round(statistics.median(times), 4),
            "step_s": [round(t, 4) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/text_lm.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of one process per mode, the order rotated each round (a burst of load on a "
                             "shared machine then falls on every mode); the median is over every round's steps")
    parser.add_argument("--out", default="bench-out/ac")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.config, args.overrides, args.child, args.steps)))
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            command = [sys.executable, __file__, args.config, "--steps", str(args.steps), "--child", mode]
            for override in args.overrides:
                command += ["--set", override]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = []
    for mode, rounds in runs.items():
        steps = [t for r in rounds for t in r["step_s"]]
        # saved_mb is the same every round (deterministic); peak RSS: the largest round's.
        results.append({**rounds[0], "peak_step_mb": max(r["peak_step_mb"] for r in rounds),
                        "median_step_s": round(statistics.median(steps), 4), "step_s": steps})
    none = results[0]
    print(f"# {args.config} {' '.join('--set ' + o for o in args.overrides)}: {none['params_m']}M parameters, "
          f"{none['tokens_per_step']} tokens per step, {args.rounds} rounds x {args.steps} timed steps; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'mode':>10} {'blocks':>6} {'saved MB':>9} {'x none':>7} {'peak step MB':>13} {'x none':>7} "
          f"{'median step s':>14} {'x none':>7}")
    for r in results:
        print(f"{r['mode']:>10} {r['blocks']:>6} {r['saved_mb']:>9.1f} {r['saved_mb'] / none['saved_mb']:>7.2f} "
              f"{r['peak_step_mb']:>13.1f} {r['peak_step_mb'] / none['peak_step_mb']:>7.2f} "
              f"{r['median_step_s']:>14.3f} {r['median_step_s'] / none['median_step_s']:>7.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                  "steps": args.steps, "rounds": args.rounds,
                                                  "results": results}, indent=2) + "\n")
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
