"""Reading a config: TOML, ``--set`` overrides, and pydantic's errors turned into one line."""

from __future__ import annotations

import copy
import difflib
import math
import os
import tomllib
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from ringtrain.config.schema import Config
from ringtrain.errors import ConfigError

__all__ = ["load_config", "load_config_dict", "parse_override", "check_overrides", "check_override_degrees"]


def load_config(path: str | Path, overrides: list[str] = (), run_dir: str | None = None) -> Config:
    """Read ``path``, apply ``--set`` overrides and an explicit run directory, and validate.

    Raises ConfigError with a one-line message for anything a user could get wrong.
    """
    path = Path(path)
    return load_config_dict(_read_toml(path), overrides, run_dir, source=str(path), name=path.stem)


def load_config_dict(raw: dict[str, Any], overrides: Sequence[str] = (), run_dir: str | None = None,
                     source: str = "the config", name: str = "run") -> Config:
    """Validate a config given as a dict of sections (``ringtrain.fit(config={...})``), with the same
    overrides, run directory rule (default ``runs/<name>``) and one-line errors as a TOML file."""
    raw = copy.deepcopy(raw)
    origins: dict[tuple[str, ...], str] = {}
    for override in overrides:
        keys, value = parse_override(override)
        _set_nested(raw, keys, value)
        origins[keys] = f"--set {override}"
    if run_dir is not None:
        raw["run_dir"] = run_dir
    raw.setdefault("run_dir", str(Path("runs") / name))
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err.errors(), source, origins)) from None


def check_overrides(overrides: Sequence[str]) -> None:
    """What ``ringtrain run`` can check of ``--set`` overrides before any worker starts, without the script's
    config: each names a field and gives it a value of the field's type and range. Rules across fields wait
    for the script's config (every worker checks the whole config)."""
    raw: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    for override in overrides:
        keys, value = parse_override(override)
        _set_nested(raw, keys, value)
        origins[keys] = f"--set {override}"
    try:
        Config.model_validate(raw)
    except ValidationError as err:
        own = [e for e in err.errors() if any(_loc(e)[: len(keys)] == keys for keys in origins)]
        if own:
            raise ConfigError(_describe(own, "the overrides", origins)) from None


LAYOUT_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
"""[parallel]'s degrees: they multiply to the number of workers (an unset or -1 one takes the rest)."""


def check_override_degrees(overrides: Sequence[str], min_world_size: int, max_world_size: int) -> None:
    """What ``ringtrain run`` knows of the layout before the script's config: the [parallel] degrees the
    overrides set. The degrees multiply to the world size, the script's own (or the rest) times these, so the
    product of these must divide every number of workers the job may run with; one line otherwise, before any
    worker starts (``ringtrain train`` checks the whole layout there)."""
    given: dict[str, int] = {}
    for override in overrides:
        keys, value = parse_override(override)
        if (len(keys) == 2 and keys[0] == "parallel" and keys[1] in LAYOUT_DEGREES and type(value) is int
                and value > 0):
            given[keys[1]] = value
    product = math.prod(given.values())
    for world_size in range(min_world_size, max_world_size + 1):
        if world_size % product:
            named = " x ".join(f"{name} ({degree})" for name, degree in given.items())
            within = ("" if min_world_size == max_world_size else
                      f" (the job runs with {min_world_size} to {max_world_size} workers; this is at {world_size})")
            raise ConfigError(f"[parallel] {named} set by --set: {product} does not divide world_size ({world_size}), "
                              f"and the layout's degrees multiply to it{within}; run a multiple of {product} workers "
                              "(--nproc), or change the degrees")


def parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    """``'train.lr=0.1'`` -> ``(('train', 'lr'), 0.1)``; the value is read as a TOML value, else a string."""
    key, sep, text = override.partition("=")
    keys = tuple(part.strip() for part in key.split("."))
    if not sep or not all(keys):
        raise ConfigError(f"bad override {override!r}: write it as section.field=value, e.g. train.lr=0.05")
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as mlp or gloo
    return keys, value


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass a TOML file such as configs/digits_mlp.toml")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    except UnicodeDecodeError as err:  # TOML is UTF-8: a binary file, or text saved in another encoding
        line = err.object.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at line {line}); "
                          "save the config as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None


def _set_nested(raw: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _loc(error: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(part) for part in error["loc"] if not isinstance(part, int))


def _describe(errors: list[dict[str, Any]], source: str, origins: dict[tuple[str, ...], str]) -> str:
    """One line for the first problem (and a count of the others)."""
    first = errors[0]
    loc = _loc(first)
    where = next((origins[k] for k in origins if loc[: len(k)] == k), source)
    dotted = ".".join(loc)
    if first["type"] == "extra_forbidden":
        message = f"unknown key '{dotted}' in {where}{_did_you_mean(loc)}"
    elif not loc:  # a whole-model validator
        message = f"{where}: {_plain(first['msg'])}"
    else:
        shown = first["input"]
        value = "" if isinstance(shown, dict) else f" = {_toml_repr(shown)}"
        message = f"{dotted}{value} in {where}: {_plain(first['msg'])}"
    more = len(errors) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _did_you_mean(loc: tuple[str, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    prefix = ".".join(loc[:-1])
    keys = [field.alias or name for name, field in model.model_fields.items()]
    matches = _closest(loc[-1], keys)
    if not matches:
        known = ", ".join(keys)
        return f"; known keys{' in [' + prefix + ']' if prefix else ''}: {known}"
    return f"; did you mean '{'.'.join((*loc[:-1], matches[0]))}'?"


def _closest(word: str, known: list[str]) -> list[str]:
    """Known keys that ``word`` is a likely typo of: an abbreviation or extension first, then look-alikes."""
    extended = [k for k in known if len(k) >= 2 and (word.startswith(k) or k.startswith(word))]
    if extended:
        return [max(extended, key=lambda k: (len(os.path.commonprefix([k, word])), -len(k)))]
    return difflib.get_close_matches(word, known, n=1, cutoff=0.6)


def _plain(message: str) -> str:
    return message.replace("Value error, ", "")


def _toml_repr(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value)
