"""Context parallelism's activation memory and step time on the built-in LM: cp 1 against cp 2 (and 4).

    .venv/bin/python bench/context_parallel_memory.py configs/text_lm.toml --cp 1,2,4 --steps 4 --out bench-out/cp

For each cp, ``cp`` fresh processes (Gloo on loopback, one compute thread each) build the config's Transformer
(``--set`` scales it, as for ``ringtrain train``), split its sequence over the cp ranks as ``[parallel] cp`` does
(``parallel/context_split.py``: ring attention, each rank two load-balanced chunks, whole logits gathered back)
and train on the same random tokens (``train.local_batch_size`` sequences of ``data.seq_len``, the config's
precision, AdamW, the gradients summed over the cp ranks) for a warm-up step and ``--steps`` timed ones. Rank 0
reports:

- ``saved_mb``: what autograd keeps for backward over one forward and loss (``monitor.memory.saved_for_backward``:
  deterministic; the issue's bar is cp 2 <= 0.6 of cp 1);
- ``median_step_s``: forward + backward + the gradient sum + optimizer step (wall time: noisy on a shared
  machine, and cp ranks share its cores here);
- ``cp_comm_s``: the step's waits on the ring (``ContextCommTimer``).

It prints a table and writes ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def measure(rank: int, cp: int, port: int, config_path: str, overrides: list[str], steps: int, out) -> None:
    """One rank of a cp group (the child's work); rank 0 puts its figures on ``out``."""
    import torch
    import torch.distributed as dist

    from ringtrain.config import load_config
    from ringtrain.models.transformer import TransformerLM
    from ringtrain.monitor.memory import saved_for_backward
    from ringtrain.parallel.context_split import split_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    config = load_config(config_path, [*overrides, "model.dropout=0.0"])
    model_cfg, train = config.model, config.train
    torch.manual_seed(train.seed)
    seq_len = config.data.seq_len
    model = TransformerLM(256, seq_len, model_cfg.n_layers, model_cfg.n_heads, model_cfg.d_model, 0.0)
    if cp > 1:
        split_context(model, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (train.local_batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.precision == "bf16")
    timer = getattr(model, "cp_comm_timer", None)

    def step() -> int:
        with saved_for_backward() as saved, autocast:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        if cp > 1:  # each rank holds its tokens' share of the gradient
            for param in model.parameters():
                dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return saved.bytes

    saved_bytes = step()  # warm-up
    if timer is not None:
        timer.take_s()
    times, comm = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        comm.append(timer.take_s() if timer is not None else 0.0)
    if rank == 0:
        out.put({"cp": cp, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                 "tokens_per_step": inputs.numel(), "saved_mb": round(saved_bytes / 2**20, 1),
                 "median_step_s": round(statistics.median(times), 4), "cp_comm_s": round(statistics.median(comm), 4),
                 "step_s": [round(t, 4) for t in times]})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/text_lm.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--cp", default="1,2", help="the cp degrees, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per degree (after one warm-up)")
    parser.add_argument("--out", default="bench-out/cp")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    results = []
    for cp in (int(d) for d in args.cp.split(",")):
        out = context.Queue()
        mp.start_processes(measure, args=(cp, free_port(), args.config, args.overrides, args.steps, out), nprocs=cp,
                           start_method="spawn", join=True)
        results.append(out.get(timeout=60))
    base = results[0]
    print(f"# {args.config} {' '.join('--set ' + o for o in args.overrides)}: {base['params_m']}M parameters, "
          f"{base['tokens_per_step']} tokens per step, {args.steps} timed steps; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'cp':>3} {'saved MB':>9} {'x cp 1':>7} {'median step s':>14} {'x cp 1':>7} {'cp_comm s':>10}")
    for r in results:
        print(f"{r['cp']:>3} {r['saved_mb']:>9.1f} {r['saved_mb'] / base['saved_mb']:>7.2f} {r['median_step_s']:>14.3f} "
              f"{r['median_step_s'] / base['median_step_s']:>7.2f} {r['cp_comm_s']:>10.3f}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                      "steps": args.steps, "results": results}, indent=2) + "\n")
    print(f"wrote {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()
