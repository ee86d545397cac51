"""The reference for `ringtrain bench train`: a bare PyTorch DDP loop, no ringtrain trainer.

Same model, data, optimizer and sample order as `ringtrain train CONFIG` (it borrows only ringtrain's
model and dataset builders, or a factory config's parts and loss, and the process settings its workers use: one compute thread, pinned, and
the allocator's thresholds), written as plainly as torch allows, so the benchmark can report ringtrain's
overhead as a ratio of median step times and check that both produce bit-identical weights.

    torchrun --standalone --nproc-per-node 2 -m ringtrain.bench.bare_ddp CONFIG --steps 40 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from ringtrain.config import load_config
from ringtrain.data import build_datasets
from ringtrain.data.sampler import grad_accum_steps_for_window
from ringtrain.host.allocator import keep_freed_memory
from ringtrain.models import build_model
from ringtrain.train.user_parts import UserParts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=int, default=10, help="steps per timing interval")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    train = config.train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The process settings ringtrain's workers use, so the comparison is of the training code alone.
    if config.dist.pin_cpu:  # the compute thread only
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[int(os.environ["LOCAL_RANK"]) % os.cpu_count()]})
    if config.dist.keep_freed_memory:
        keep_freed_memory()

    if config.user_parts:  # a factory config: the user's model, data and loss, as ringtrain builds them
        user = UserParts.from_config(config)
        dataset, collate, loss_sum = user.train_data, user.collate_fn or default_collate, user.task.loss_sum
        module = user.build_model(train.seed)
    else:
        torch.manual_seed(train.seed)
        data = build_datasets(config.data)
        dataset, collate = data.train, default_collate
        module = build_model(config.model, data)

        def loss_sum(outputs, targets):
            return torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")

    model = DDP(module, bucket_cap_mb=config.comm.bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum,
                                weight_decay=train.weight_decay)

    step_times, interval_start = [], time.perf_counter()
    step, epoch, cursor = 0, 0, 0
    order = np.random.default_rng([train.seed, epoch]).permutation(len(dataset))
    while step < args.steps:
        window = order[cursor : cursor + train.global_batch_size]
        inputs, targets = collate([dataset[i] for i in window[rank::world_size].tolist()])
        # ringtrain's rule: as many as the largest share needs (a short last window of an epoch needs fewer).
        count = grad_accum_steps_for_window(len(window), world_size, train.local_batch_size)
        micro = list(zip(torch.tensor_split(inputs, count), torch.tensor_split(targets, count)))
        for index, (x, y) in enumerate(micro):
            # Forward and backward both inside no_sync: DDP decides in forward whether backward syncs.
            with model.no_sync() if index < len(micro) - 1 else contextlib.nullcontext():
                loss = loss_sum(model(x), y) * (world_size / len(window))
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, cursor = step + 1, cursor + len(window)
        if cursor >= len(order):
            epoch, cursor = epoch + 1, 0
            order = np.random.default_rng([train.seed, epoch]).permutation(len(dataset))
        if step % args.interval == 0:
            now = time.perf_counter()
            step_times.append((now - interval_start) / args.interval)
            interval_start = now

    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), out / "final_model.pt")
        result = {"world_size": world_size, "steps": step, "interval_step_times_s": step_times,
                  "median_step_s": statistics.median(step_times)}
        (out / "result.json").write_text(json.dumps(result, indent=2))
    # DDP holds the group from inside reference cycles: collect them before the group goes, or a Gloo
    # thread frees a tensor during interpreter shutdown and the process aborts (as ringtrain's group.py).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
