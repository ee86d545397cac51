"""GradientStep's books: the tensor-parallel waits booked as a step's ``tp_comm`` are the ones inside its passes,
not those of what ran before it (the last step's clip, an evaluation), pipelined or not. Before 2026-12-07 the
pipelined step booked them too, and on a loaded machine a step's tp_comm exceeded the step."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ringtrain.monitor.metrics import StepClock
from ringtrain.train.step import GradientStep

pytestmark = pytest.mark.unit

BEFORE_S, INSIDE_S = 5.0, 0.01


class _Strategy:
    """Waits of 5 s accumulated before the step, 0.01 s inside its passes."""

    splits_model = True
    reduces_every_micro_batch = False

    def __init__(self, pipelined: bool):
        self.pipelined = pipelined
        self._waits = [BEFORE_S]
        self.comm_timer = SimpleNamespace(backward_done=lambda: 0.0)

    def collective_wait_s(self) -> float:
        return self._waits.pop(0) if self._waits else 0.0

    def pipeline_step(self, micro_batches, loss_fn, autocast) -> float:
        self._waits.append(INSIDE_S)
        return 0.0

    def synchronize_gradients(self) -> None:
        pass

    def loss_context(self):
        return contextlib.nullcontext()

    def share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


class _Model(torch.nn.Module):
    def __init__(self, strategy: _Strategy):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.strategy = strategy

    def forward(self, inputs):
        self.strategy._waits.append(INSIDE_S)  # the split layers' collectives, waited for inside the pass
        return inputs * self.weight


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "plain"])
def test_a_steps_tp_comm_is_the_waits_inside_its_passes(pipelined):
    strategy = _Strategy(pipelined)
    model = _Model(strategy)
    plan = SimpleNamespace(micro_batches=[(torch.ones(2, 1), torch.zeros(2, 1))], global_items=2)
    batcher = SimpleNamespace(plan=lambda batch, window: plan, recoverable=False, after_forward=lambda *a, **k: None,
                              check_budget=lambda: None)
    task = SimpleNamespace(loss_sum=lambda outputs, targets: ((outputs - targets) ** 2).sum())
    precision = SimpleNamespace(scale=lambda loss: loss, autocast=contextlib.nullcontext)
    parts = SimpleNamespace(model=model, module=model, batcher=batcher, task=task, strategy=strategy,
                            precision=precision)
    clock = StepClock()
    GradientStep(parts, clock, 1, torch.device("cpu")).run(batch=None, window=2, step=1, on_shrink=lambda r: None)
    assert clock.phase_totals["tp_comm"] == pytest.approx(INSIDE_S), dict(clock.phase_totals)
