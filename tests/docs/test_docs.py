"""The documentation (docs/*.md, the site's pages) and examples/README say what the code does: every command is
listed, every example described once, the install section installs a package, and the sample output of `make run`
has the summary's rows in the summary's formatting."""

from __future__ import annotations

import argparse
import re

import pytest

from ringtrain.cli import build_parser
from tests.conftest import REPO

pytestmark = pytest.mark.unit

DOCS = REPO / "docs"
CLI_PAGE = (DOCS / "cli.md").read_text()
GETTING_STARTED = (DOCS / "getting-started.md").read_text()


def section(text: str, heading: str) -> str:
    """The text under a Markdown heading, up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    following = re.search(rf"\n#{{1,{len(level)}}} ", text[start + len(heading) + 2:])
    return text[start:start + len(heading) + 2 + following.start()] if following else text[start:]


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every command the parser takes: ('train',), ('bench', 'checkpoint'), ..., parents before children."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*prefix, name)
                yield from commands(child, (*prefix, name))


def test_the_command_line_section_lists_every_command():
    listed = section("\n" + CLI_PAGE, "# The command line").split("```")[1]
    found = list(commands(build_parser()))
    assert ("plan", "table") in found and ("bench", "checkpoint") in found  # the walk reaches nested commands
    leaves = [command for command in found if not any(other[:-1] == command for other in found)]
    missing = [" ".join(command) for command in leaves if f"ringtrain {' '.join(command)} " not in listed]
    assert not missing, f"docs/cli.md's command list lacks: {missing}"


def test_examples_readme_describes_each_example_once():
    text = (REPO / "examples" / "README.md").read_text()
    headings = re.findall(r"^## `([\w.]+\.py)`", text, flags=re.MULTILINE)
    scripts = sorted(path.name for path in (REPO / "examples").glob("*.py"))
    assert sorted(headings) == scripts, f"headings {headings} for scripts {scripts}"


def test_the_docs_say_how_to_install_ringtrain_into_another_project():
    install = section(GETTING_STARTED, "## Use ringtrain in your own project")
    assert "make" not in install.split("```")[1], "the install commands are pip's, not this repository's make"
    assert "pip install torch==2.14.1" in install  # the tested torch first
    assert re.search(r"^pip install \.\./ringtrain\b", install, flags=re.MULTILINE)
    assert "git+" in install and "PyPI" in install


def test_the_sample_output_of_make_run_has_the_summarys_rows_as_the_console_prints_them():
    """The `make run` sample (docs/getting-started.md) against what the code prints now: the same rows in the same order, each
    value as the summary table formats it (a re-capture is due when the summary changes)."""
    from ringtrain.monitor.loggers import format_value

    quick = section(GETTING_STARTED, "## Quick start")
    sample = quick.split("```")[3]
    assert ".venv/bin/ringtrain train configs/digits_mlp.toml --nproc 2" in sample
    rows = [re.split(r"\s*│\s*", line.strip("│ ")) for line in sample.splitlines() if line.startswith("│")]
    keys = [row[0] for row in rows]
    assert keys == ["world_size", "steps", "epochs", "wall_s", "samples_per_s", "final_loss", "eval.accuracy",
                    "eval.top5_accuracy", "eval.loss", "micro_batch_size", "restarts", "heals", "steps_lost",
                    "skipped_steps", "param_sha256", "model_state_mb"], keys
    for key, shown in rows:
        if key != "param_sha256":
            value = float(shown.replace(",", ""))
            number = int(value) if key in ("world_size", "steps", "micro_batch_size", "restarts", "heals",
                                           "steps_lost", "skipped_steps") else value
            printed = format_value(number)
            assert printed == shown, f"{key}: the docs show {shown!r}, the console {printed!r}"
    evals = [line for line in sample.splitlines() if line.startswith("eval at step")]
    assert evals and evals[-1].startswith("eval at step 920 (epoch 40): accuracy "), evals
