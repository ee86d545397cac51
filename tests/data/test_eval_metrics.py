"""Evaluation results that mean something: top-5 accuracy only where it can miss (more than 5 classes), and a
model's own loss (a Hugging Face model given `labels`) either used, when asked (`loss="model"`), or named once
as ignored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import SequenceClassifierOutput

from ringtrain.errors import ConfigError
from ringtrain.train.tasks import build_task, builtin_task

pytestmark = pytest.mark.unit


def user_cross_entropy():
    return build_task("cross_entropy", "mean", None, example_target=torch.tensor(0))


def metrics_of(task, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    return task.eval_metrics(task.eval_sums(logits, targets))


@pytest.mark.parametrize("classes", [2, 5, 6, 10])
@pytest.mark.parametrize("make_task", [lambda: builtin_task("digits"), user_cross_entropy], ids=["built-in", "fit"])
def test_top5_accuracy_is_reported_only_with_more_than_five_classes(make_task, classes):
    generator = torch.Generator().manual_seed(classes)
    logits = torch.randn(40, classes, generator=generator)
    targets = torch.randint(classes, (40,), generator=generator)
    metrics = metrics_of(make_task(), logits, targets)
    assert metrics["accuracy"] == pytest.approx((logits.argmax(1) == targets).double().mean().item())
    if classes <= 5:
        assert "top5_accuracy" not in metrics, metrics  # every target is in the top 5: always 100%
    else:
        expected = (logits.topk(5, dim=1).indices == targets[:, None]).any(1).double().mean().item()
        assert metrics["top5_accuracy"] == pytest.approx(expected) and metrics["top5_accuracy"] < 1.0


def test_the_top5_count_travels_with_the_sums_so_a_rank_with_no_eval_batch_agrees():
    """Sums of two ranks' batches, one of them empty (the all-reduce adds zeros): top-5 is still reported."""
    task = builtin_task("digits")
    logits, targets = torch.randn(8, 10), torch.randint(10, (8,))
    busy = task.eval_sums(logits, targets)
    assert "top5_accuracy" in task.eval_metrics(busy + torch.zeros_like(busy))


def hf_outputs(logits: torch.Tensor, labels: torch.Tensor | None) -> SequenceClassifierOutput:
    """What a Hugging Face classifier returns: its own loss (the batch mean) when given labels."""
    loss = None if labels is None else F.cross_entropy(logits, labels)
    return SequenceClassifierOutput(loss=loss, logits=logits)


def test_a_model_loss_that_is_ignored_is_named_once():
    task, warnings = user_cross_entropy(), []
    task.warn = warnings.append
    logits, targets = torch.randn(6, 10), torch.randint(10, (6,))
    for _ in range(3):
        loss = task.loss_sum(hf_outputs(logits, targets), targets)
    assert loss == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item())  # the targets' loss
    assert len(warnings) == 1, warnings
    assert "ignores it" in warnings[0] and "drop 'labels'" in warnings[0] and "loss='model'" in warnings[0]
    task.loss_sum(hf_outputs(logits, None), targets)  # no labels, no loss computed: nothing to say
    assert len(warnings) == 1


def test_no_warning_when_the_model_computes_no_loss():
    task, warnings = user_cross_entropy(), []
    task.warn = warnings.append
    logits, targets = torch.randn(6, 10), torch.randint(10, (6,))
    task.loss_sum(hf_outputs(logits, None), targets)
    task.loss_sum(logits, targets)
    assert warnings == []


@pytest.mark.parametrize(("reduction", "weight"), [("mean", 6), ("sum", 1)])
def test_loss_model_trains_on_the_models_own_loss_with_its_reduction(reduction, weight):
    task, warnings = build_task("model", reduction, None, example_target=torch.tensor(0)), []
    task.warn = warnings.append
    logits, targets = torch.randn(6, 10), torch.randint(10, (6,))
    own = SequenceClassifierOutput(loss=torch.tensor(0.25), logits=logits)  # not the targets' cross-entropy
    assert task.loss_sum(own, targets) == pytest.approx(weight * 0.25) and warnings == []
    # mean: weighted by the micro-batch's samples; sum: divided by the step's items (targets not -100).
    assert task.items_are_samples == (reduction == "mean") and task.count_items(targets) == 6
    assert task.eval_metrics(task.eval_sums(own, targets))["loss"] == pytest.approx(weight * 0.25 / 6)


def test_loss_model_without_a_model_loss_is_one_line():
    task = build_task("model", "mean", None, example_target=torch.tensor(0))
    with pytest.raises(ConfigError) as caught:
        task.loss_sum(hf_outputs(torch.randn(4, 10), None), torch.zeros(4, dtype=torch.long))
    message = str(caught.value)
    assert "\n" not in message and "without a .loss tensor" in message and "labels" in message, message
