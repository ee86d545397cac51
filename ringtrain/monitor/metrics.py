"""Step timing: wall time per phase, averaged over a logging interval.

    clock = StepClock()
    with clock.phase("data"):
        batch = next(batches)
    ...
    clock.end_step(samples=64)
    record = clock.flush()   # {'step_time_s': ..., 'samples_per_s': ..., 'time/data_s': ...}
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StepClock", "model_flops_utilization"]


class StepClock:
    """Accumulates per-phase wall time and samples between two flushes.

        clock = StepClock()
        with clock.phase("forward_backward"):
            loss.backward()
        clock.end_step(samples=window)           # once per optimizer step
        if step % 10 == 0:
            logger.log({"type": "train", "step": step, **clock.flush()})   # step_time_s, samples_per_s, time/*_s
    """

    def __init__(self):
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.interval_start = now
        self.phase_totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.samples = 0
        self.tokens = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_totals[name] += time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-book ``seconds`` measured inside phase ``source`` as phase ``target`` (e.g. the part of
        backward that waited for communication)."""
        self.phase_totals[source] -= seconds
        self.phase_totals[target] += seconds

    def end_step(self, samples: int, tokens: int = 0) -> None:
        self.steps += 1
        self.samples += samples
        self.tokens += tokens

    def flush(self) -> dict[str, float]:
        """Means over the steps since the last flush, then start a new interval."""
        now = time.perf_counter()
        elapsed = now - self.interval_start
        steps = max(1, self.steps)
        record = {
            "step_time_s": elapsed / steps,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
        }
        if self.tokens:
            record["tokens_per_s"] = self.tokens / elapsed if elapsed > 0 else 0.0
        for name, total in self.phase_totals.items():
            record[f"time/{name}_s"] = total / steps
        self._reset(now)
        return record


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, workers: int, peak_tflops: float) -> float:
    """Share of the workers' peak FLOP/s that the model's own arithmetic used (PaLM's MFU): FLOPs per
    token (6N + 12*L*H*Q*T for a Transformer) times tokens/s over all workers, against workers x peak."""
    return tokens_per_s * flops_per_token / (workers * peak_tflops * 1e12)
