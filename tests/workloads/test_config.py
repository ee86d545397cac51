"""Config: typed and documented; every bad input is one line naming the field, before any worker starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringtrain.cli import main
from ringtrain.config import (
    Config,
    grad_accum_steps_for,
    load_config,
    parse_override,
    validate_for_world_size,
    validate_for_world_sizes,
)
from ringtrain.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "configs" / "digits_mlp.toml"


def test_default_config_loads_with_run_dir_from_its_name():
    config = load_config(DEFAULT)
    assert config.model.name == "mlp"
    assert config.run_dir == str(Path("runs") / "digits_mlp")
    validate_for_world_size(config, 2)


def test_overrides_are_typed_toml_values():
    config = load_config(DEFAULT, ["train.lr=0.05", "model.hidden_sizes=[32, 16]", "dist.backend=gloo"])
    assert config.train.lr == 0.05
    assert config.model.hidden_sizes == [32, 16]
    assert config.dist.backend == "gloo"


def test_every_field_has_a_docstring():
    def walk(model):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Config.__mro__[1]):
                yield from walk(annotation)
            else:
                yield name, field.description

    missing = [name for name, doc in walk(Config) if not doc]
    assert not missing, f"fields without a docstring: {missing}"


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config(DEFAULT, ["train.max_steps=7"])
    path = tmp_path / "resolved.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config
    assert load_config(path).digest() == config.digest()


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="section.field=value"):
        parse_override("train.lr")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


# (TOML text or None for the default file, --set overrides, extra flags, words the one-line error must contain)
BAD_CONFIGS = [
    ("[train]\nlrate = 0.1\n", [], [], ["train.lrate", "did you mean 'train.lr'"]),
    ("[trian]\nlr = 0.1\n", [], [], ["trian", "did you mean 'train'"]),
    ("[train]\nepochs = \"3\"\n", [], [], ["train.epochs", "'3'", "integer"]),
    ("[train]\nlocal_batch_size = 0\n", [], [], ["train.local_batch_size", "greater than 0"]),
    ("[train]\nglobal_batch_size = -4\n", [], [], ["train.global_batch_size", "greater than 0"]),
    ("[train]\nlr = nan\n", [], [], ["train.lr", "nan", "finite"]),
    ("[train]\nglobal_batch_size = 1\n", [], [],
     ["global_batch_size (1)", "below world_size (2)", "try global_batch_size = 2"]),
    ("[train]\nglobal_batch_size = 64\nlocal_batch_size = 16\ngrad_accum_steps = 3\n", [], [],
     ["grad_accum_steps (3)", "set it to 2"]),
    ("[model]\nname = \"transformer9\"\n", [], [], ["model.name", "'transformer9'", "'mlp'"]),
    ("[dist]\ntimeout_s = 0\n", [], [], ["dist.timeout_s", "greater than 0"]),
    ("[checkpoint]\nkeep_last = 0\n", [], [], ["checkpoint.keep_last", "greater than 0"]),
    ("[checkpoint]\ndir = \"../../elsewhere\"\n", [], [], ["checkpoint", "inside the run directory"]),
    ("[data]\ntest_fraction = 1.5\n", [], [], ["data.test_fraction", "less than 1"]),
    ("[train\nlr = 1\n", [], [], ["not valid TOML"]),
    (None, ["train.lrr=0.1"], [], ["--set train.lrr=0.1", "did you mean 'train.lr'"]),
    (None, ["train.epochs=many"], [], ["train.epochs", "'many'", "--set train.epochs=many"]),
    (None, [], ["--nproc", "0"], ["--nproc", "at least 1"]),
    (None, [], ["--nnodes", "2:1"], ["--nnodes", "MIN <= MAX"]),
    (None, [], ["--nnodes", "2"], ["--rdzv-endpoint"]),
    (None, [], ["--rdzv-endpoint", "localhost"], ["--rdzv-endpoint", "HOST:PORT"]),
    # Fault tolerance (chaos 12): elastic ranges, resume flags, guards, rendezvous timing.
    (None, [], ["--min-nproc", "3"], ["--min-nproc (3)", "--nproc (2)", "cannot exceed"]),
    (None, [], ["--min-nproc", "0"], ["--min-nproc (0)", "between 1"]),
    ("[train]\nglobal_batch_size = 2\n", [], ["--nproc", "3", "--min-nproc", "2"],
     ["global_batch_size (2)", "world_size (3)", "try global_batch_size = 6", "every world_size from 2 to 3"]),
    ("[train]\nglobal_batch_size = 96\nlocal_batch_size = 32\ngrad_accum_steps = 2\n", [],
     ["--nproc", "3", "--min-nproc", "2"], ["grad_accum_steps (2)", "world_size (3)", "set it to 1"]),
    ("[train]\nmax_consecutive_nonfinite_steps = 0\n", [], [], ["train.max_consecutive_nonfinite_steps", "greater than 0"]),
    (None, [], ["--rdzv-conf", "last_call_timeout=0"], ["--rdzv-conf", "last_call_timeout", "at least 1"]),
    (None, [], ["--rdzv-conf", "keep_alive_max_attempt=2"], ["keep_alive_max_attempt=2", "use 3 or more"]),
    (None, [], ["--rdzv-conf", "lastcall=5"], ["unknown key 'lastcall'", "last_call_timeout"]),
    (None, [], ["--resume-from", "/nonexistent/step_00000010.pt"], ["--resume-from", "no such checkpoint file"]),
    (None, [], ["--resume", "--resume-from", "x.pt"], ["--resume", "--resume-from", "not both"]),
    ("[data]\nledger = \"yes\"\n", [], [], ["data.ledger", "'yes'", "boolean"]),
]


@pytest.fixture(scope="module")
def rejected():
    """Counts the table's rows rejected as they should be, for the tally printed at the end."""
    tally = []
    yield tally
    print(f"\ninvalid-config table: {sum(tally)}/{len(BAD_CONFIGS)} rejected before any worker started, naming the field")


@pytest.mark.parametrize("text,overrides,flags,expected", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_bad_input_is_one_line_exit_2_and_no_worker_starts(tmp_path, capsys, rejected, text, overrides, flags, expected):
    path = DEFAULT if text is None else _write(tmp_path, text)
    run_dir = tmp_path / "run"
    argv = ["train", str(path), "--nproc", "2", "--run-dir", str(run_dir), *flags]
    for override in overrides:
        argv += ["--set", override]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: "), err
    for words in expected:
        assert words in lines[0], f"{words!r} missing from: {lines[0]}"
    assert not run_dir.exists(), "the launcher must not have started (it creates the run directory)"
    rejected.append(1)


def test_missing_config_file_is_named(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert "nope.toml" in err and "not found" in err


def test_existing_run_needs_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000010.pt").write_bytes(b"x")
    assert main(["train", str(DEFAULT), "--nproc", "2", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "step_00000010.pt" in err


def test_config_command_prints_fields_and_resolved_config(capsys):
    assert main(["config"]) == 0
    fields = capsys.readouterr().out
    assert "train.global_batch_size" in fields and "Samples per optimizer step" in fields
    assert main(["config", str(DEFAULT), "--set", "train.lr=0.5"]) == 0
    assert "lr = 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("global_batch,local_batch,sizes", [
    (96, 32, (2, 3)),    # the issue's: 48 + 48 at 2 workers, 32 x 3 at 3
    (128, 32, (3, 3)),   # 43 + 43 + 42
    (100, 16, (1, 4)),
    (5, 32, (2, 5)),     # one sample per worker at 5
])
def test_a_global_batch_that_does_not_divide_is_valid_at_every_world_size_of_the_range(global_batch, local_batch, sizes):
    config = load_config(DEFAULT, [f"train.global_batch_size={global_batch}", f"train.local_batch_size={local_batch}"])
    validate_for_world_sizes(config, *sizes)
    for world_size in range(sizes[0], sizes[1] + 1):
        validate_for_world_size(config, world_size)  # what each worker checks
        assert grad_accum_steps_for(config.train, world_size) == -(-global_batch // (local_batch * world_size))


def test_grad_accum_steps_is_the_count_at_the_most_workers_and_derived_at_fewer():
    config = load_config(DEFAULT, ["train.global_batch_size=96", "train.local_batch_size=32", "train.grad_accum_steps=1"])
    validate_for_world_sizes(config, 2, 3)  # 1 micro-batch of 32 at 3 workers; 2 of 24 at 2, derived
    validate_for_world_size(config, 2)      # a worker of that job after it shrank to 2
    assert grad_accum_steps_for(config.train, 2) == 2
    with pytest.raises(ConfigError, match=r"grad_accum_steps \(1\) disagrees .* world_size \(2\)\)\) = 2; set it to 2"):
        validate_for_world_sizes(config, 1, 2)
    with pytest.raises(ConfigError, match=r"grad_accum_steps \(3\) is more micro-batches .* world_size \(2\)"):
        validate_for_world_size(config.model_copy(update={"train": config.train.model_copy(
            update={"grad_accum_steps": 3})}), 2)


@pytest.mark.parametrize("global_batch,local_batch,sizes", [(2, 32, (2, 3)), (1, 1, (1, 4)), (3, 2, (4, 8)),
                                                            (7, 1, (1, 12))])
def test_a_refused_global_batch_comes_with_one_that_works_at_every_world_size(global_batch, local_batch, sizes):
    config = load_config(DEFAULT, [f"train.global_batch_size={global_batch}", f"train.local_batch_size={local_batch}"])
    with pytest.raises(ConfigError) as refused:
        validate_for_world_sizes(config, *sizes)
    message = str(refused.value)
    assert f"global_batch_size ({global_batch})" in message and "\n" not in message
    suggested = int(re.search(r"try global_batch_size = (\d+)", message).group(1))
    validate_for_world_sizes(load_config(DEFAULT, [f"train.global_batch_size={suggested}",
                                                   f"train.local_batch_size={local_batch}"]), *sizes)
