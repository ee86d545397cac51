"""The trainer's records: the train record of each logging interval (the step-time breakdown, memory, the
slowest rank), the notices of a resume, and the summary. A mixin of ``Trainer`` (train/loop.py)."""

from __future__ import annotations

import math
import time
from typing import Any

from ringtrain.monitor.memory import memory_mb
from ringtrain.monitor.metrics import model_flops_utilization
from ringtrain.monitor.rank_stats import RankStats, gather_rank_stats
from ringtrain.train.guards import check_replicas

__all__ = ["RecordKeeping"]


class RecordKeeping:
    def _maybe_log(self) -> None:
        if self.state.step % self.config.monitor.log_every_steps and not self.finished:
            return
        # The interval ends here; the cost of this record is booked in the next one.
        timing = self.clock.flush()
        with self.clock.phase("monitor"):
            memory = memory_mb(self.ctx.device)
        loss_sum, items = self._step_loss
        busy_s = timing.get("time/data_s", 0.0) + timing.get("time/forward_backward_s", 0.0)
        # Every rank takes part in this collective; only rank 0's logger writes the record. A tensor-parallel
        # group's loss is counted once (its first rank's: the others computed the same one). It waits for
        # the slowest rank like the gradient all-reduce would, so it is booked as exposed communication.
        with self.clock.phase("comm_exposed"), self.watch.op("all_gather (metrics of every rank)", self.state.step):
            ranks = gather_rank_stats(loss_sum.item() if self.ctx.data_leader else 0.0, busy_s, memory["memory/peak_rss_mb"], self._state_mb)
        with self.clock.phase("monitor"):
            self._log_train_record(timing, memory, ranks, items)

    def _log_train_record(self, timing: dict, memory: dict, ranks: RankStats, items: int) -> None:
        self.last_loss = ranks.loss_sum / items
        record = {
            "type": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
            "loss": self.last_loss,
            **self.parts.task.train_metrics(self.last_loss),
            "lr": self.parts.scheduler.get_last_lr()[0],
            **timing,
            **self.comm_timer.flush(),
            "comm_fraction": timing.get("time/comm_exposed_s", 0.0) / timing["step_time_s"],
            **memory,
            "memory/peak_rss_mb": ranks.peak_rss_mb,
            "model_state_mb": ranks.model_state_mb,
            "straggler/rank": ranks.slowest_rank,
            "straggler/lag_s": ranks.lag_s,
            **self.parts.strategy.figures(),  # DiLoCo: outer steps, bytes each worker sent
        }
        record.update(self._utilization(record.get("tokens_per_s")))
        self.logger.log(record)

    def _log_notices(self) -> None:
        for record in self.notices:
            if record["type"] != "resume":
                self.logger.log(record)

    def _log_restart_once(self) -> None:
        """The resume record goes out after the first step, with the time it took to train again."""
        resumed = [r for r in self.notices if r["type"] == "resume"]
        if not resumed:
            return
        self.notices = [r for r in self.notices if r["type"] != "resume"]
        record = resumed[0]
        last = record.pop("last_step_time", None)
        if last is not None:
            record["restart_s"] = round(time.time() - last, 2)
            self.parts.job_store.add_steps_lost(record["steps_lost"])
        self.logger.log(record)

    def _steps_lost(self) -> int | None:
        """Steps redone after restarts over the whole job, from the job store; 0 for a lone process (nothing
        restarts it), None where no store outlives the workers (plain torchrun: unknown)."""
        lost = self.parts.job_store.steps_lost()
        return 0 if lost is None and not self.ctx.env.is_distributed else lost

    def _utilization(self, tokens_per_s: float | None) -> dict[str, float]:
        """MFU of a language model, when the config names the device's peak."""
        flops_per_token = getattr(self.module, "flops_per_token", None)
        peak_tflops = self.config.monitor.peak_tflops
        if tokens_per_s is None or flops_per_token is None or peak_tflops is None:
            return {}
        return {"mfu": model_flops_utilization(tokens_per_s, flops_per_token(), self.ctx.world_size, peak_tflops)}

    def _summary(self, wall_s: float, samples: int) -> dict[str, Any]:
        with self.watch.op("all_gather (parameter digests)", self.state.step):
            digests = check_replicas(self.parts.strategy.full_named_parameters(self.model), self.state.step)
            model_state_mb = gather_rank_stats(0.0, 0.0, 0.0, max(self._state_mb, self._model_state_mb())).model_state_mb
        summary = {
            "world_size": self.ctx.world_size,
            "steps": self.state.step,
            "epochs": round(self.state.samples_seen / self.parts.sampler.num_samples, 3),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(samples / wall_s, 1) if wall_s > 0 else 0.0,
            "final_loss": None if math.isnan(self.last_loss) else self.last_loss,
            "eval": {k: v for k, v in self.last_eval.items() if k != "count"},
            "micro_batch_size": self.batcher.micro_batch_size,
            "restarts": self.previous.starts - 1,
            "heals": self.healing.count,
            "steps_lost": self._steps_lost(),
            "skipped_steps": self.state.skipped_steps,
            "param_sha256": digests,
            "model_state_mb": model_state_mb,
            **self.parts.strategy.figures(),
        }
        if self.tokens_seen and wall_s > 0:
            summary["tokens_per_s"] = round(self.tokens_seen / wall_s, 1)
            summary.update(self._utilization(self.tokens_seen / wall_s))
        if self.parts.data_stats:
            summary["data"] = self.parts.data_stats
        if self.parts.checkpointed_blocks:
            summary["activation_checkpointing"] = {"mode": self.config.train.activation_checkpointing,
                                                   "blocks": self.parts.checkpointed_blocks}
        return summary
