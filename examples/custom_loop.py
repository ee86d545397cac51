"""A hand-written training loop on ringtrain's building blocks: an MLP learns scikit-learn's digits.

    torchrun --nproc-per-node 2 examples/custom_loop.py --max-steps 40    # stops after step 40, checkpointed
    torchrun --nproc-per-node 2 examples/custom_loop.py --resume          # goes on from the newest valid one
    ringtrain ledger runs/custom_loop                                      # every sample once per epoch
"""

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

import ringtrain

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run-dir", type=Path, default=Path("runs/custom_loop"))
parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--max-steps", type=int, default=0, help="stop after this step (0: train every epoch)")
args = parser.parse_args()
BATCH, ACCUM, CHECKPOINT_EVERY = 64, 2, 10  # samples per step (all ranks), micro-batches per rank and step

images, labels = load_digits(return_X_y=True)  # 1,797 8x8 images, bundled with scikit-learn
split = train_test_split((images / 16).astype("float32"), labels, test_size=0.2, random_state=0, stratify=labels)
x_train, x_test, y_train, y_test = map(torch.from_numpy, split)
train_set = TensorDataset(x_train, y_train)

with ringtrain.init_distributed(ringtrain.DistEnv.from_environ(), ringtrain.DistConfig()) as ctx:
    torch.manual_seed(0)  # the same initial weights on every rank
    strategy = ringtrain.DDPStrategy(ctx.device)
    model = strategy.wrap(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = ringtrain.ResumableSampler(len(train_set), BATCH, seed=0)  # the epoch's order and a cursor
    loader = ringtrain.build_train_loader(train_set, sampler, ctx.rank, ctx.world_size)  # a StepBatch a step
    state = ringtrain.TrainState()  # step, epoch, samples seen
    stateful = {"model": strategy.unwrap(model), "optimizer": optimizer, "sampler": sampler, "train_state": state}
    checkpoints = ringtrain.CheckpointManager(args.run_dir / "checkpoints", is_writer=ctx.rank == 0)
    if args.resume:  # the newest checkpoint that matches its sha256 manifest (a warning names broken newer ones)
        _, saved = checkpoints.load_latest() or sys.exit(f"--resume: no valid checkpoint in {checkpoints.directory}")
        for name, part in stateful.items():
            part.load_state_dict(saved[name])
    elif checkpoints.latest():
        sys.exit(f"{args.run_dir} holds checkpoints: add --resume, or pass another --run-dir")
    total_steps = min(args.max_steps or 10**9, args.epochs * sampler.steps_per_epoch)
    start_step, timer, clock = state.step, strategy.comm_timer, ringtrain.StepClock()
    logger = ringtrain.RunDirLogger(args.run_dir) if ctx.rank == 0 else ringtrain.NullLogger()  # metrics.jsonl
    ledger = ringtrain.Ledger(args.run_dir / "ledger.jsonl", len(train_set), is_writer=ctx.rank == 0)
    logger.start(total_steps, start_step, sampler.steps_per_epoch)
    ledger.start(start_step)  # cut back to the resumed step: steps done again appear once

    with ringtrain.StepGuard(ctx.rank, ctx.world_size, ctx.device) as guard:  # skip NaN steps; stop on SIGTERM
        while state.step < total_steps:  # an epoch per pass: the loader goes on from the sampler's cursor
            for batch in itertools.islice(loader, total_steps - state.step):  # this rank's share of a step
                window = sampler.next_window_size()  # samples in this step, all ranks together
                loss_sum, micro = torch.zeros(()), batch.micro_batches(ACCUM)
                for i, (inputs, targets) in enumerate(micro):
                    # One all-reduce, in the last backward; sums / window: DDP's mean over ranks = the batch's mean
                    with strategy.no_sync(model) if i < len(micro) - 1 else contextlib.nullcontext():
                        loss = nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
                        (loss * ctx.world_size / window).backward()
                    loss_sum += loss.detach()
                verdict = guard.agree(guard.check(loss_sum, model.parameters()))  # the same on every rank
                if not verdict.skip:
                    optimizer.step()
                optimizer.zero_grad()
                ledger.record(state.step + 1, state.epoch, batch.indices.tolist(), skipped=verdict.skip)
                state.step += 1
                state.samples_seen += sampler.advance()  # commit: the cursor moves past this window
                guard.count(verdict, state, state.step)  # too many bad steps in a row: an error
                clock.end_step(window)
                if sampler.epoch_finished:
                    state.epoch += 1
                    sampler.set_epoch(state.epoch)
                logger.log({"type": "train", "step": state.step, "loss": loss_sum.item() / max(1, len(batch)),
                            "grad_syncs": timer.syncs, "grad_buckets": timer.buckets, **clock.flush()})
                if state.step % CHECKPOINT_EVERY == 0 or state.step == total_steps or verdict.stop:
                    checkpoints.save(state.step, {name: part.state_dict() for name, part in stateful.items()})
                if verdict.stop:
                    sys.exit(f"stopped after step {state.step}, checkpointed: continue with --resume")

    accuracy = (strategy.unwrap(model)(x_test).argmax(1) == y_test).float().mean().item()
    logger.finish({"steps": state.step, "test_accuracy": accuracy})
    if ctx.rank == 0:
        print(f"step {state.step} (epoch {state.samples_seen / len(train_set):.2f}): test accuracy {accuracy:.3f} "
              f"on {len(y_test)} images; {timer.syncs} gradient all-reduces in {state.step - start_step} steps")
