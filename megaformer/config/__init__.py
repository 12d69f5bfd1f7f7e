"""Typed, validated configuration: one YAML file, one namespace.

A config has the sections ``model``, ``parallel``, ``data``, ``train``, ``eval``, ``checkpoint``,
``log`` and a pass-through ``deepspeed`` dict; each section is a dataclass in the module named after
it. Every key is declared with its type (a choice as ``Literal[...]``), default and documentation
(``doc`` in the field metadata); ``megaformer train --help-config`` and docs/configuration.md are
generated from these declarations (:mod:`.reference`), so they cannot drift.

Loading (:mod:`.loading`) goes YAML (:mod:`.yaml_safe`: safe loader, no anchors/aliases, bounded
size) -> dotted overrides (:mod:`.overrides`, ``train.steps=50``) -> type checks per key -> the
static cross-key checks (:mod:`.checks`, one module per concern). Any problem raises
:class:`~megaformer.errors.ConfigError` with one line naming the key, the value and what is
allowed, before any process group starts. The ``deepspeed`` section is an allowlist of reviewed
keys (:mod:`.deepspeed`). The checks that need the world size and the device run once, in
:func:`megaformer.config.preflight.preflight` (a layer above this package's other modules).
"""

from megaformer.config.checkpoint import CheckpointConfig
from megaformer.config.checks import check_rope_scaling, validate
from megaformer.config.checks.launch import validate_for_training, validate_for_world
from megaformer.config.data import DataConfig
from megaformer.config.deepspeed import (
    DEEPSPEED_ALLOWED,
    DERIVED_DEEPSPEED_KEYS,
    check_deepspeed_section,
    deepspeed_keys_doc,
)
from megaformer.config.evaluation import EvalConfig
from megaformer.config.fields import option
from megaformer.config.loading import RENAMED_KEYS, config_from_dict, load_config
from megaformer.config.log import LogConfig
from megaformer.config.model import (
    ROPE_SCALING_KEYS,
    MLAConfig,
    ModelConfig,
    ModelKeys,
    MoEConfig,
)
from megaformer.config.overrides import apply_overrides
from megaformer.config.parallel import ParallelConfig
from megaformer.config.reference import describe_keys
from megaformer.config.root import SECTIONS, Config
from megaformer.config.train import PRECISIONS, TrainConfig, precision_dtype
from megaformer.config.yaml_safe import MAX_CONFIG_BYTES, safe_yaml_load
from megaformer.errors import ConfigError

__all__ = [
    "DEEPSPEED_ALLOWED",
    "DERIVED_DEEPSPEED_KEYS",
    "MAX_CONFIG_BYTES",
    "PRECISIONS",
    "RENAMED_KEYS",
    "ROPE_SCALING_KEYS",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "ModelKeys",
    "MLAConfig",
    "MoEConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_overrides",
    "check_deepspeed_section",
    "check_rope_scaling",
    "config_from_dict",
    "deepspeed_keys_doc",
    "describe_keys",
    "load_config",
    "option",
    "precision_dtype",
    "safe_yaml_load",
    "validate",
    "validate_for_training",
    "validate_for_world",
]
