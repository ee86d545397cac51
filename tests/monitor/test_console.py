"""What a person reads while a run goes on and when it ends: the console's lines and the summary table, and
`ringtrain config`'s listing of every field."""

from __future__ import annotations

import re

import pytest

from ringtrain.monitor.loggers import ConsoleLogger
from tests.conftest import run_main

pytestmark = pytest.mark.unit

# The summary of the default job (configs/digits_mlp.toml, 2 workers) as the loop writes it.
SUMMARY = {
    "world_size": 2, "steps": 920, "epochs": 40.0, "wall_s": 2.794, "samples_per_s": 820.1, "final_loss": 0.0015046,
    "eval": {"accuracy": 0.9777777, "loss": 0.10603}, "micro_batch_size": 32, "restarts": 0, "heals": 0,
    "steps_lost": 0, "skipped_steps": 0, "param_sha256": ["8057615ddf48" + "0" * 52] * 2, "model_state_mb": 0.58166,
}
EVAL = {"type": "eval", "step": 230, "epoch": 10, "accuracy": 0.9777777, "loss": 0.10603, "count": 360}


def table_rows(text: str) -> dict[str, str]:
    """The summary table's rows, key -> value as printed."""
    rows = [re.split(r"\s*│\s*", line.strip("│ ")) for line in text.splitlines() if line.startswith("│")]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def test_the_summary_shows_counts_as_integers_and_other_numbers_with_four_significant_digits(capsys):
    ConsoleLogger(progress=False).finish(SUMMARY)
    rows = table_rows(capsys.readouterr().out)
    assert rows["samples_per_s"] == "820.1", rows  # not 820.1000
    assert rows["steps"] == "920" and rows["world_size"] == "2" and rows["restarts"] == "0"
    assert rows["wall_s"] == "2.794" and rows["final_loss"] == "0.001505" and rows["eval.loss"] == "0.1060"
    assert rows["eval.accuracy"] == "0.9778" and rows["epochs"] == "40.00" and rows["model_state_mb"] == "0.5817"
    assert rows["param_sha256"] == "8057615ddf48… on all 2 ranks"
    ConsoleLogger(progress=False).finish({"samples_per_s": 20575.3, "steps": 20575, "wall_s": 999.96})
    rows = table_rows(capsys.readouterr().out)
    assert rows == {"samples_per_s": "20,575", "steps": "20,575", "wall_s": "1,000"}, rows


@pytest.mark.parametrize("progress", [False, True], ids=["plain", "under-the-progress-bar"])
def test_an_evaluation_is_one_line_on_the_console(capsys, progress):
    logger = ConsoleLogger(progress=progress)
    logger.start(total_steps=920, start_step=0, steps_per_epoch=23)
    logger.log(EVAL)
    logger.log({"type": "train", "step": 230, "epoch": 10, "loss": 0.01, "samples_per_s": 9000.0})
    logger.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval")]
    assert lines == ["eval at step 230 (epoch 10): accuracy 0.9778, loss 0.1060"], lines


def test_an_evaluation_line_holds_every_number_but_the_count_and_no_list(capsys):
    logger = ConsoleLogger(progress=False)
    logger.log({"type": "eval", "step": 60, "epoch": 1, "loss": 2.351, "ppl": 10.5, "count": 40960,
                "per_class": [0.5, 0.25], "r2": 0.409})
    assert capsys.readouterr().err == "eval at step 60 (epoch 1): loss 2.351, ppl 10.50, r2 0.4090\n"


def test_config_lists_a_default_factory_by_its_value():
    result = run_main("config")
    assert result.returncode == 0, result.stderr
    assert "PydanticUndefined" not in result.stdout
    assert "\nmodel.args = {}\n" in result.stdout and "\ndata.args = {}\n" in result.stdout
