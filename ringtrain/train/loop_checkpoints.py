"""The trainer's checkpoints: what one holds (named once, in ``checkpoint_parts``), resuming, saving, and the stop
that saves. A mixin of ``Trainer`` (train/loop.py); saving and loading go through the checkpoint front
(checkpoint/front.py), which ringtrain.Session uses too."""

from __future__ import annotations

import signal
from pathlib import Path


from ringtrain.checkpoint.front import CheckpointFront, Found, Stateful, load_parts
from ringtrain.checkpoint.manager import checkpoint_step
from ringtrain.group.watch import first_line
from ringtrain.errors import CheckpointError
from ringtrain.testing import faults
from ringtrain.train.guards import Stopped
from ringtrain.train.resume import ResumePlan, check_same_choice, resume_record
from ringtrain.train.stateful import CommState, ModelState, OptimizerState, RunInfo, ScheduleState, ShardedTensors

__all__ = ["CheckpointSeams"]


class CheckpointSeams:
    # --- what a checkpoint holds: named once, for saves, loads and the heal's transfer ------------------
    def checkpoint_parts(self, local: bool = False) -> dict[str, Stateful]:
        """The stateful parts a checkpoint holds, in load order (the run's facts first: the optimizer's class is
        checked before its state is loaded; the schedule after the step it is positioned at). No generator state:
        randomness is derived from (seed, epoch, sample) and (seed, step, rank) (``data/seeding.py``).
        ``local``: the model and optimizer as this process holds them, outside any group (a heal's transfer)."""
        parts = self.parts
        strategy = None if local else parts.strategy
        self._run_info = RunInfo(self.config, parts.optimizer, self.ctx.world_size)
        return {"run": self._run_info, "model": ModelState(strategy, self.model),
                "optimizer": OptimizerState(strategy, parts.optimizer), "sampler": parts.sampler,
                "train_state": self.state, "schedule": ScheduleState(parts.scheduler, self.state),
                "precision": self.precision, "micro_batch": self.batcher,
                "comm": CommState(strategy, self.ctx.rank, self.ctx.world_size, self._warn),
                **({"best": parts.best} if parts.best.enabled else {}),  # [train] keep_best's best so far
                **({} if local else parts.strategy.stateful_parts())}  # DiLoCo's outer state

    def state_dict(self) -> dict:
        """The full (unsharded) checkpoint of this step, as a full checkpoint file holds it (every rank calls it:
        sharded strategies gather)."""
        return {name: part.state_dict() for name, part in self.checkpoint_parts().items()}

    def load_state_dict(self, state: dict) -> None:
        """Load a full checkpoint's dict (``state_dict``'s form) into every part."""
        load_parts(self.checkpoint_parts(), state)

    def _tensors(self) -> ShardedTensors:
        return ShardedTensors(self.parts.strategy, self.model, self.parts.optimizer, self.ctx.rank,
                              self.ctx.world_size, self._warn)

    def _checkpoint_front(self) -> CheckpointFront:
        ckpt = self.config.checkpoint
        return CheckpointFront(Path(self.config.run_dir) / ckpt.dir, self.ctx.rank, self.ctx.world_size, ckpt.keep_last,
                               sharded=ckpt.sharded, background=ckpt.async_, fence=self.healing.check_fence,
                               new_group=self.healing.new_group)

    def resume(self, plan: ResumePlan) -> Path | None:
        """Called once before training on every start: continue from the checkpoint the plan picks (the run's
        newest that verifies, else --resume-from's; every rank picks the same), or return None to start fresh.
        Called again after a heal at start-up (heal/supervisor.py ``start``): the start is counted once, and the
        notices are those of the last call."""
        if self._notices_at_resume is None:
            self.previous = self.parts.job_store.begin_attempt()
            self._notices_at_resume = len(self.notices)
        del self.notices[self._notices_at_resume:]
        faults.point("train.resume")
        found = self.checkpoints.newest(self._warn) if plan.resume else None
        if found is None and plan.resume and plan.source is not None:
            found = Found(plan.source, checkpoint_step(plan.source) or 0, sharded=False)
        check_same_choice(-1 if found is None else found.step)
        if found is None:
            if plan.required:
                raise CheckpointError(f"--resume: no valid checkpoint in {self.checkpoints.directory}; run without "
                                      "--resume to start afresh")
            if self.previous.last_step is not None:  # a restart before the first checkpoint: start over
                self.notices.append(resume_record(None, 0, self.ctx.world_size, self.previous))
            return None
        self.load_checkpoint(found)
        record = resume_record(found.path, self.state.step, self.ctx.world_size, self.previous)
        record["lr"] = self.parts.scheduler.get_last_lr()[0]
        self.notices.append(record)
        return found.path

    _notices_at_resume: int | None = None

    def load_checkpoint(self, found: Found) -> None:
        """Load ``found`` into every part; a checkpoint that does not fit is one line (with the config fields
        that changed since it was saved)."""
        parts = self.checkpoint_parts()
        try:
            self.checkpoints.load(found, parts, self._tensors())
        except (RuntimeError, ValueError, KeyError, CheckpointError) as err:
            changed = self._run_info.changes
            differs = f"; its config differs: {'; '.join(changed)}" if changed else ""
            raise CheckpointError(f"checkpoint {found.path} does not fit this job ({first_line(str(err))}){differs}") from None
        if self._run_info.changes:
            lr = self.parts.scheduler.get_last_lr()[0]
            self._warn(f"resuming {found.path.name} with a changed config: {'; '.join(self._run_info.changes)}; the "
                       f"optimizer's hyperparameters and lr schedule follow it: lr {lr:.6g} at step {self.state.step}")

    def _warn(self, message: str) -> None:
        # Kept until fit() starts the loggers; rank 0's console shows them, metrics.jsonl records them.
        self.notices.append({"type": "warning", "message": message})

    def save_checkpoint(self) -> None:
        """Checkpoint the step reached now (every rank calls it; the writer writes)."""
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        self.healing.check_fence()  # a worker cut off from the group writes nothing
        self._finish_save()  # at most one background save in flight
        self._pending_save = self.checkpoints.save(self.state.step, self.checkpoint_parts(), self._tensors(),
                                                   config_sha256=self.config.digest())
        if not self.config.checkpoint.async_:
            self._finish_save()
        self._saved_step = self.state.step

    def _finish_save(self) -> None:
        """Wait for the sharded save in flight (if any) and record it: one 'checkpoint' record per save."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        report = pending.result(timeout=self.config.dist.timeout_s + 600)
        self.logger.log({"type": "checkpoint", "step": report.step, "path": Path(report.path).name, "sharded": True,
                         "async": self.config.checkpoint.async_, "blocked_s": report.blocked_s,
                         "background_s": report.background_s, "bytes": report.bytes})

    def _stop(self) -> None:
        """A rank got SIGTERM or SIGINT: every rank checkpoints this step and exits; nothing is lost."""
        if self._saved_step != self.state.step:
            self._save_checkpoint()
        self._finish_save()  # committed before we say so
        # A peer's signal stopped us; our own agent usually sends us one too (it restarts every worker). Wait
        # for it briefly, so the agent sees a worker it stopped, not one that failed on its own.
        own = self.stop_signal.wait(timeout_s=5.0)
        name = self.checkpoints.path_for(self.state.step).name
        number = self.stop_signal.signal_number or signal.SIGTERM
        who = "this worker" if own else "a peer"
        raise Stopped(f"stopped at step {self.state.step} after saving {name} ({signal.Signals(number).name} to "
                      f"{who}); training continues from there (--resume)", signal_number=number)
