"""[monitor] trackers: MLflow (a local sqlite store under the run directory) and W&B (offline) get what
metrics.jsonl has, from rank 0 (MLflow: the settings that applied as parameters; the config, summary and final
model as artifacts; nothing on the console); a tracker that cannot start is one warning line and the run still succeeds."""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest
import torch

from ringtrain.config import Config
from ringtrain.monitor.sinks import TensorBoardLogger
from ringtrain.monitor.trackers import Guarded, build_trackers
from tests.conftest import REPO, run_cli
from tests.runs import records as _records

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

JOB = ["configs/debug_mlp.toml", "--nproc", "2", "--set", "train.epochs=1", "--set", "monitor.log_every_steps=2"]


@pytest.mark.job
def test_mlflow_and_wandb_get_what_metrics_jsonl_has(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli("train", *JOB, "--run-dir", str(run_dir), "--set", 'monitor.trackers=["mlflow", "wandb"]')
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())

    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    run_id = (run_dir / "trackers" / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.1" and run.data.params["model.hidden_sizes"] == "[32, 32]"
    # The settings that applied: not another model's or strategy's defaults (issue 41).
    for unused in ("model.d_model", "model.n_layers", "diloco.outer_lr", "comm.powersgd_rank", "data.seq_len"):
        assert unused not in run.data.params, unused
    # The config, the summary and the final model (exported from the last checkpoint) as artifacts.
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"config.toml", "summary.json", "model/model.safetensors"} <= artifacts, artifacts
    from safetensors.torch import load_file

    exported = load_file(client.download_artifacts(run_id, "model/model.safetensors", str(tmp_path)))
    final = torch.load(run_dir / "checkpoints" / f"step_{summary['steps']:08d}.pt", weights_only=True)["model"]
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    # No MLflow (or alembic) INFO lines on the console.
    assert "INFO" not in done.stderr + done.stdout, done.stderr
    train = _records(run_dir, "train")
    assert len(train) >= 10
    for key in ("loss", "lr", "samples_per_s", "time/forward_backward_s", "time/comm_s"):
        logged = [(m.step, m.value) for m in client.get_metric_history(run_id, f"train/{key}")]
        assert sorted(logged) == [(r["step"], r[key]) for r in train if key in r], key
    [evaluation] = _records(run_dir, "eval")
    assert run.data.metrics["eval/accuracy"] == evaluation["accuracy"]
    assert run.data.metrics["summary/final_loss"] == summary["final_loss"]
    assert run.data.metrics["summary/eval/accuracy"] == summary["eval"]["accuracy"]
    assert json.loads(run.data.tags["summary/param_sha256"]) == summary["param_sha256"]
    assert not (REPO / "mlruns").exists(), "MLflow wrote outside the run directory"
    assert run.data.metrics["breakdown/step_s"] > 0 and run.data.metrics["breakdown/forward_backward_s"] > 0

    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    [log] = list(offline.glob("run-*.wandb"))
    data = log.read_bytes()
    # The run's records (what `wandb sync` uploads): the summary's digest, and the last training loss.
    assert summary["param_sha256"][0].encode() in data
    assert json.dumps(train[-1]["loss"]).encode() in data and b"breakdown/step_s" in data


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (checked: a connection is refused)."""
    for port in (9, *range(47001, 47100)):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED:
                return port
    raise AssertionError("no closed port on 127.0.0.1")


@pytest.mark.job
def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path):
    """MLflow at a server that refuses (its URI holds a token), W&B not importable (a stand-in package that raises
    on import): the run finishes with one warning each, and the token is in no file of the run directory and not
    in the output (issue 39, row 5). Before, rank 0 sat in MLflow's HTTP retries and rank 1's all-reduce timed
    out (exit 1); MLflow is told here not to retry, so its failure comes at once (a server that never answers is
    tests/monitor/test_tracker_guard.py's stand-in)."""
    fake = tmp_path / "site"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise ImportError('No module named wandb (test stand-in)')\n")
    run_dir = tmp_path / "run"
    token = "s3cretTOKEN"
    uri = f"http://alice:{token}@127.0.0.1:{_closed_port()}"
    done = run_cli("train", *JOB, "--run-dir", str(run_dir), "--set", 'monitor.trackers=["mlflow", "wandb"]',
                   "--set", f'monitor.mlflow_tracking_uri="{uri}"', "--set", "dist.timeout_s=30",
                   env={"PYTHONPATH": os.pathsep.join([str(fake), str(REPO)]), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert done.returncode == 0, done.stderr
    warnings = sorted(line for line in done.stderr.splitlines() if "warning" in line)
    assert len(warnings) == 2, done.stderr
    assert warnings[0].startswith("ringtrain: warning: tracker 'mlflow' failed and is off for this run ("), warnings
    assert warnings[1].startswith("ringtrain: warning: tracker 'wandb' failed and is off for this run (ImportError: "
                                  "No module named wandb (test stand-in)); training goes on"), warnings
    assert "Traceback" not in done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 23
    assert token not in done.stdout + done.stderr
    leaked = [str(path) for path in run_dir.rglob("*") if path.is_file() and token.encode() in path.read_bytes()]
    assert leaked == []
    assert "http://***@127.0.0.1:" in (run_dir / "config.toml").read_text()


@pytest.mark.unit
def test_the_old_tensorboard_field_is_the_tensorboard_tracker(tmp_path):
    pytest.importorskip("tensorboard")
    for monitor in ({"tensorboard": True}, {"trackers": ["tensorboard"]}):
        trackers = build_trackers(Config.model_validate({"monitor": monitor}), tmp_path)
        assert [type(t) for t in trackers] == [TensorBoardLogger], monitor
        trackers[0].close()
    both = build_trackers(Config.model_validate({"monitor": {"trackers": ["wandb", "mlflow"]}}), tmp_path)
    assert [t.name for t in both if isinstance(t, Guarded)] == ["mlflow", "wandb"]
    with pytest.raises(ValueError, match="names mlflow more than once"):
        Config.model_validate({"monitor": {"trackers": ["mlflow", "mlflow"]}})


@pytest.mark.unit
def test_mlflow_gets_the_settings_that_applied():
    """A fit() run (a model and data factory) under DDP: no built-in model's or dataset's fields, no DiLoCo; the
    built-in transformer's own fields, DiLoCo's under diloco, PowerSGD's under powersgd (issue 41)."""
    from ringtrain.monitor.trackers import applied_params

    fit_like = applied_params(Config.model_validate({"model": {"factory": "m:f"}, "data": {"factory": "m:d"},
                                                     "train": {"optimizer": "adamw"}}))
    assert "model.factory" in fit_like and "train.lr" in fit_like and "comm.strategy" in fit_like
    for unused in ("model.name", "model.hidden_sizes", "model.d_model", "data.dataset", "data.image_size",
                   "diloco.outer_lr", "train.momentum", "train.keep_best_mode", "comm.powersgd_rank"):
        assert unused not in fit_like, unused
    lm = applied_params(Config.model_validate({"model": {"name": "transformer"}, "data": {"dataset": "text"},
                                               "comm": {"strategy": "diloco"}}))
    for used in ("model.d_model", "model.n_layers", "data.seq_len", "diloco.outer_lr", "train.momentum"):
        assert used in lm, used
    assert "comm.powersgd_rank" in applied_params(Config.model_validate({"comm": {"algorithm": "powersgd"}}))
    assert "model.hidden_sizes" not in lm and "data.image_size" not in lm
