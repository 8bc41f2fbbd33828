"""EngineConfig: one typed, validated configuration for the RL engine.

Every field is also a vime/slime-style command-line flag: the field `rollout_batch_size` is the flag
`--rollout-batch-size`, so a vime user's launch script carries over. Sections group the fields by the part of
the engine that reads them; flag names are unique across sections. YAML files use the same flat names
(`rollout-batch-size: 16` or `rollout_batch_size: 16`); flags given on the command line win over the file.

The modules, one job each: `sections` (the section models; NON_MATH_FIELDS, the fields a resume may change),
`megatron_flags` (Megatron-Core pass-through flags), `engine_config` (EngineConfig, its derived values, the fields a
resume must match), `flat_values` (flat names into an EngineConfig), `yaml_file` (load_yaml), `flags` (parse_flags),
`build` (build_config: defaults < YAML < flags), `errors` (ConfigError, flag names in messages), `switches` (the
words for true and false).
"""

from vime_engine.config.build import build_config
from vime_engine.config.engine_config import EngineConfig
from vime_engine.config.errors import ConfigError
from vime_engine.config.flags import parse_flags
from vime_engine.config.flat_values import from_flat, with_overrides
from vime_engine.config.megatron_flags import MEGATRON_FLAGS
from vime_engine.config.sections import (
    NON_MATH_FIELDS, SECTIONS, AlgorithmConfig, CheckpointConfig, DataConfig, EvalConfig, KLType, LoggingConfig,
    ModelConfig, PlacementConfig, RewardConfig, RolloutConfig, TrainConfig,
)
from vime_engine.config.yaml_file import load_yaml

__all__ = [
    "MEGATRON_FLAGS", "NON_MATH_FIELDS", "SECTIONS", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig",
    "EngineConfig", "EvalConfig", "KLType", "LoggingConfig", "ModelConfig", "PlacementConfig", "RewardConfig",
    "RolloutConfig", "TrainConfig", "build_config", "from_flat", "load_yaml", "parse_flags", "with_overrides",
]
