"""The workloads' models, tasks and precision, on their own."""

from __future__ import annotations

import pytest
import torch

from ringtrain.data.images import SyntheticImages
from ringtrain.models.resnet import build_resnet
from ringtrain.models.transformer import TransformerLM
from ringtrain.monitor.metrics import model_flops_utilization
from ringtrain.train.precision import Precision
from ringtrain.train.tasks import builtin_task

pytestmark = pytest.mark.unit


def test_transformer_is_causal_and_ties_its_embeddings():
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=256, seq_len=32, n_layers=2, n_heads=2, d_model=32).eval()
    tokens = torch.randint(0, 256, (2, 20))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 20, 256)
    torch.testing.assert_close(a[:, :12], b[:, :12])  # the past cannot see the future
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    assert model.head.weight is model.token_embedding.weight
    assert not list(model.buffers()), "a buffer would make DDP broadcast in forward"


def test_transformer_flops_per_token_follow_the_palm_formula():
    model = TransformerLM(vocab_size=256, seq_len=128, n_layers=3, n_heads=4, d_model=64)
    n = sum(p.numel() for p in model.parameters()) - 128 * 64  # position embedding excluded
    assert model.num_params() == n
    assert model.flops_per_token() == 6 * n + 12 * 3 * 4 * 16 * 128
    assert model_flops_utilization(1000.0, 1e9, workers=2, peak_tflops=1.0) == pytest.approx(0.5)


@pytest.mark.parametrize("small_stem,size,final_px", [(True, 32, 4), (False, 64, 2)])
def test_resnet_stems(small_stem, size, final_px):
    model = build_resnet("resnet18", num_classes=7, in_channels=1, small_input_stem=small_stem).eval()
    assert model.conv1.in_channels == 1
    features = torch.nn.Sequential(*list(model.children())[:-2])
    assert features(torch.zeros(2, 1, size, size)).shape == (2, 512, final_px, final_px)
    assert model(torch.zeros(2, 1, size, size)).shape == (2, 7)


def test_classification_reports_top1_and_top5():
    outputs = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0], [0.0, 1, 2, 3, 4, 5, 6], [0.0, 0, 0, 0, 0, 0, 9]])
    targets = torch.tensor([0, 0, 6])  # right; outside the top 5; right
    metrics = builtin_task("digits").eval_metrics(builtin_task("digits").eval_sums(outputs, targets))
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["top5_accuracy"] == pytest.approx(2 / 3)
    outputs[1, 0] = 4.5  # now fifth
    metrics = builtin_task("digits").eval_metrics(builtin_task("digits").eval_sums(outputs, targets))
    assert metrics["top5_accuracy"] == 1.0 and metrics["count"] == 3


def test_language_model_loss_counts_real_tokens_only():
    task = builtin_task("text")
    logits = torch.zeros(2, 4, 256)  # uniform: log 256 nats per token
    targets = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100]])
    assert task.count_items(targets) == 4
    assert task.loss_sum(logits, targets).item() == pytest.approx(4 * torch.log(torch.tensor(256.0)).item())
    metrics = task.eval_metrics(task.eval_sums(logits, targets))
    assert metrics["ppl"] == pytest.approx(256.0) and metrics["count"] == 4


def test_synthetic_images_are_fixed_by_index_and_labelled_round_robin():
    data = SyntheticImages(size=20, image_size=8, num_classes=4, seed=1)
    image, label = data[6]
    assert image.shape == (3, 8, 8) and label == 2
    assert torch.equal(data[6][0], image)
    assert not torch.equal(data[7][0], image)


def test_precision_autocasts_and_scales_only_fp16():
    bf16 = Precision("bf16", torch.device("cpu"))
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert bf16.scaler is None and bf16.state_dict() == {}
    fp32 = Precision("fp32", torch.device("cpu"))
    with fp32.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    loss = torch.tensor(2.0)
    assert fp32.scale(loss) is loss


def test_fp16_scaler_unscales_skips_overflow_and_round_trips():
    # The config allows fp16 on CUDA only; torch's GradScaler works the same on CPU, so its use is tested here.
    precision = Precision("fp16", torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    precision.scale((weight * 2).sum()).backward()
    assert weight.grad[0] == 2 * 65536.0
    precision.unscale_(optimizer)
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    precision.step(optimizer)
    assert torch.equal(weight.detach(), torch.full((3,), -1.0))
    weight.grad = torch.tensor([float("inf"), 0.0, 0.0])
    precision.unscale_(optimizer)
    precision.step(optimizer)  # overflow: the step is skipped and the scale halves
    assert torch.equal(weight.detach(), torch.full((3,), -1.0))
    restored = Precision("fp16", torch.device("cpu"))
    restored.load_state_dict(precision.state_dict())
    assert restored.scaler.get_scale() == 32768.0
