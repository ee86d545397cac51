"""Session.backward's scale, seen in one plain-SGD step (issue 45): with SGD at lr 1 and no momentum the step moves
the weights by exactly the gradient, so the weights after step 1 of a 2-worker Session loop (2 micro-batches a
rank) must be the full batch's step, computed here in one process. AdamW, which the bit-exact resume tests use,
hardly sees a gradient's scale: a 2x error there moved a loss by 1e-5.

The dataset is exactly one global batch, so step 1's window is every sample, whatever order the sampler deals."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from tests.conftest import run_cli

pytestmark = pytest.mark.job

SAMPLES = 8
SCRIPT = """
import sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import ringtrain

torch.manual_seed(0)
inputs, targets = torch.randn({samples}, 5), torch.randint(0, 3, ({samples},))
model = nn.Linear(5, 3)
session = ringtrain.Session({{"train": {{"global_batch_size": {samples}, "local_batch_size": 2, "seed": 0}},
                              "monitor": {{"progress": False}}}}, run_dir=sys.argv[1])
loader = session.loader(TensorDataset(inputs, targets))
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
reduction = sys.argv[2]
for _ in session.epochs(1):
    for x, y in loader:
        session.backward(nn.functional.cross_entropy(model(x), y, reduction=reduction), reduction=reduction)
        optimizer.step()
if session.rank == 0:
    torch.save({{k: v.detach().clone() for k, v in session.module.state_dict().items()}}, sys.argv[3])
"""


def _full_batch_step() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, 5), torch.randint(0, 3, (SAMPLES,))
    model = nn.Linear(5, 3)
    nn.functional.cross_entropy(model(inputs), targets).backward()  # the mean over the whole window
    with torch.no_grad():
        return {name: p - p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_sgd_step_of_a_session_loop_is_the_full_batchs(tmp_path, reduction):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT.format(samples=SAMPLES))
    out = tmp_path / "weights.pt"
    done = run_cli("run", str(script), "--nproc", "2", "--", str(tmp_path / "run"), reduction, str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    trained = torch.load(out, weights_only=True)
    for name, expected in _full_batch_step().items():
        torch.testing.assert_close(trained[name], expected, rtol=1e-5, atol=1e-6, msg=f"{name} ({reduction})")
