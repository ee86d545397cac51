"""Trackers can neither block nor fail the training, and no credential reaches a file, a record, a tracker or a
log line (issue 39, row 5). In-process, with stand-in trackers: one that blocks (a server that does not answer),
one that raises; the closing flush has a bound; one warning line per tracker at most."""

from __future__ import annotations

import json
import threading
import time
import tomllib

import pytest

from ringtrain.config import Config
from ringtrain.monitor.loggers import ConsoleLogger, Logger, MultiLogger, RunDirLogger
from ringtrain.redact import is_secret_name, redact
from ringtrain.monitor.trackers import Guarded, flat_params

pytestmark = pytest.mark.unit

TOKEN = "s3cretTOKEN"
URI = f"http://alice:{TOKEN}@127.0.0.1:9"


class Recording(Logger):
    """A tracker that keeps what it is given; ``block`` holds its start until released; ``raise_on`` makes that
    call raise; ``delay_s``: each call takes that long (a slow but working server)."""

    def __init__(self, block: threading.Event | None = None, raise_on: str | None = None, delay_s: float = 0.0):
        self.calls: list[tuple] = []
        self.block, self.raise_on, self.delay_s = block, raise_on, delay_s
        self.entered = threading.Event()

    def _record(self, method: str, *args) -> None:
        time.sleep(self.delay_s)
        self.calls.append((method, *args))
        if method == self.raise_on:
            raise ConnectionError(f"cannot reach {URI}: Connection refused")

    def start(self, total_steps, start_step, steps_per_epoch):
        self.entered.set()
        if self.block is not None:
            self.block.wait()
        self._record("start", total_steps)

    def log(self, record):
        self._record("log", record)

    def finish(self, summary):
        self._record("finish", summary)

    def close(self):
        self._record("close")


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_a_tracker_that_does_not_answer_never_holds_the_training_up(capsys):
    """Its thread is stuck in start for good: every call still returns (a blocking call would hang this test),
    the calls beyond the queue are dropped and counted, and the flush gives up once nothing completes."""
    release = threading.Event()
    tracker = Recording(block=release)
    guarded = Guarded("slow", tracker, queue_size=4, stall_s=0.5)
    try:
        guarded.start(100, 0, 10)
        assert tracker.entered.wait(timeout=60)  # its thread is in start, which does not return
        for step in range(50):
            guarded.log({"type": "train", "step": step, "loss": 1.0})
        assert guarded.dropped == 50 - 4  # the queue holds 4
        guarded.finish({"steps": 50})  # returns though the tracker never will
        guarded.close()
        assert not release.is_set() and [call[0] for call in tracker.calls] == []
        assert [line for line in _warnings(capsys.readouterr().err)] == [
            "ringtrain: warning: tracker 'slow' is left behind: no call of it completed for 0.5 s (still in its start; "
            "a server that does not answer?); 46 of its calls were dropped (its queue was full); the run's own "
            "records are complete"]
    finally:
        release.set()


def test_a_slow_tracker_that_makes_progress_is_waited_for(capsys):
    """Each call takes longer than the stall bound would allow for the whole flush, but calls complete: a
    healthy tracker on a busy machine (MLflow creating its database) is not left behind."""
    tracker = Recording(delay_s=0.2)
    guarded = Guarded("busy", tracker, stall_s=1.0)
    guarded.start(10, 0, 10)
    for step in range(8):  # 8 x 0.2 s: longer than the stall bound in all, never stalled
        guarded.log({"type": "train", "step": step})
    guarded.finish({"steps": 8})
    guarded.close()
    assert [call[0] for call in tracker.calls] == ["start", *["log"] * 8, "finish", "close"]
    assert capsys.readouterr().err == ""


def test_a_tracker_that_raises_is_one_warning_and_is_dropped(capsys):
    tracker = Recording(raise_on="log")
    guarded = Guarded("flaky", tracker)
    guarded.start(10, 0, 10)
    for step in range(3):
        guarded.log({"type": "train", "step": step, "loss": 1.0})
    guarded.finish({"steps": 3})
    guarded.close()
    assert [call[0] for call in tracker.calls] == ["start", "log"]  # dropped after the first failure
    assert _warnings(capsys.readouterr().err) == [
        "ringtrain: warning: tracker 'flaky' failed and is off for this run (ConnectionError: cannot reach "
        "http://***@127.0.0.1:9: Connection refused); training goes on"]


def test_a_tracker_that_keeps_up_gets_every_call_in_order_and_no_warning(capsys):
    tracker = Recording()
    guarded = Guarded("fine", tracker, queue_size=4)
    guarded.start(10, 0, 10)
    for step in range(3):
        guarded.log({"type": "train", "step": step})
        time.sleep(0.01)
    guarded.finish({"steps": 3})
    guarded.close()
    assert [call[0] for call in tracker.calls] == ["start", "log", "log", "log", "finish", "close"]
    assert capsys.readouterr().err == ""


def test_no_credential_reaches_config_toml_records_summary_tracker_params_or_the_console(tmp_path, capsys):
    config = Config.model_validate({"monitor": {"trackers": [], "mlflow_tracking_uri": URI}, "run_dir": str(tmp_path)})
    tracker = Recording()
    logger = MultiLogger(ConsoleLogger(progress=False), RunDirLogger(tmp_path, config), Guarded("t", tracker))
    logger.start(10, 0, 10)
    logger.log({"type": "warning", "step": 1, "message": f"cannot reach {URI}; api_key={TOKEN}"})
    logger.log({"type": "train", "step": 2, "loss": 0.5, "note": f"hf_token: {TOKEN}"})
    logger.finish({"steps": 2, "final_loss": 0.5, "endpoint": URI})
    logger.close()
    out = capsys.readouterr()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert TOKEN not in path.read_text(errors="replace"), path
    assert TOKEN not in out.out + out.err and "http://***@127.0.0.1:9" in out.err
    assert TOKEN not in json.dumps([list(map(str, call)) for call in tracker.calls])
    assert TOKEN not in json.dumps(flat_params(config))
    assert flat_params(config)["monitor.mlflow_tracking_uri"] == "http://***@127.0.0.1:9"
    # config.toml still loads; the credential is for the user to give again.
    saved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert saved["monitor"]["mlflow_tracking_uri"] == "http://***@127.0.0.1:9"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["loss"] == 0.5 and records[1]["note"] == "hf_token: ***"


@pytest.mark.parametrize("given, redacted", [
    ("http://alice:s3cret@host:5000/x", "http://***@host:5000/x"),
    ("https://TOKEN@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("http://a:p@ss@host/", "http://***@host/"),
    ("sqlite:////shared/mlflow.db", "sqlite:////shared/mlflow.db"),
    ("http://host:5000/api?token=abc&page=2", "http://host:5000/api?token=***&page=2"),
    ("password=hunter2 user=bob", "password=*** user=bob"),
    ('{"api_key": "abc"}', '{"api_key": "***"}'),
    ("Authorization: Bearer abcdefghijk", "Authorization: *** ***"),
    ("uses hf_abcdefghijklmnopqrstu now", "uses *** now"),
    ("loss: 0.5, lr=0.1, step 3", "loss: 0.5, lr=0.1, step 3"),
    ({"hf_token": "x", "pad_token": "<pad>", "text_key": "text", "max_tokens": 5, "api_key": 7,
      "credentials": {"user": "u", "n": 1}, "args": ["a", "http://u:p@h"]},
     {"hf_token": "***", "pad_token": "<pad>", "text_key": "text", "max_tokens": 5, "api_key": 7,
      "credentials": {"user": "***", "n": 1}, "args": ["a", "http://***@h"]}),
    ({"loss": 0.25, "ok": True, "digest": ["ab" * 32]}, {"loss": 0.25, "ok": True, "digest": ["ab" * 32]}),
])
def test_redact(given, redacted):
    assert redact(given) == redacted
    assert redact(redacted) == redacted  # twice is once


def test_names_that_say_credential():
    assert [name for name in ("hf_token", "token", "api_key", "apiKey", "secretKey", "client_secret", "AUTH_TOKEN",
                              "monitor.password", "pad_token", "eos_token", "max_tokens", "tokenizer", "text_key",
                              "sort_key", "author", "mlflow_tracking_uri", "key") if is_secret_name(name)] == [
        "hf_token", "token", "api_key", "apiKey", "secretKey", "client_secret", "AUTH_TOKEN", "monitor.password"]
