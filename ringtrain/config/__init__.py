"""Typed, documented, validated configuration.

A run is described by a TOML file with one table per section (``[model]``, ``[data]``, ``[train]``,
``[dist]``, ``[comm]``, ``[checkpoint]``, ``[monitor]``), plus ``--set section.field=value`` overrides.
Every field is declared once (``schema.py``) with its type, default and a docstring; ``ringtrain config``
prints them.

Validation happens in the launching process, before any worker starts or any port opens. Errors are one
line that names the field, the value and the fix::

    unknown key 'train.lrate' in configs/x.toml; did you mean 'train.lr'?
    train.global_batch_size (2) is below world_size (3): ...; try global_batch_size = 6 (it works at every world_size from 2 to 3)

- ``schema.py``: the sections and their fields;
- ``checks.py``: rules that span fields, or depend on the world size or the backend;
- ``loading.py``: TOML, ``--set`` overrides, and pydantic's errors turned into one line.
"""

from ringtrain.config.checks import (
    grad_accum_steps_for,
    validate_for_backend,
    validate_for_world_size,
    validate_for_world_sizes,
)
from ringtrain.config.loading import check_override_degrees, check_overrides, load_config, load_config_dict, parse_override
from ringtrain.config.schema import (
    CheckpointConfig,
    CommConfig,
    DiLoCoConfig,
    Config,
    DataConfig,
    DistConfig,
    ModelConfig,
    MonitorConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "check_override_degrees",
    "CheckpointConfig",
    "CommConfig",
    "DiLoCoConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "ModelConfig",
    "MonitorConfig",
    "TaskConfig",
    "TrainConfig",
    "grad_accum_steps_for",
    "load_config",
    "load_config_dict",
    "parse_override",
    "check_overrides",
    "validate_for_backend",
    "validate_for_world_size",
    "validate_for_world_sizes",
]
