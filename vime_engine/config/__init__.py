"""EngineConfig: one typed, validated configuration for the RL engine (see sections.py)."""

from vime_engine.config.sections import (
    MEGATRON_FLAGS, NON_MATH_FIELDS, SECTIONS, AdvantageEstimator, AlgorithmConfig, CheckpointConfig, ConfigError,
    DataConfig, EngineConfig, EvalConfig, KLType, LoggingConfig, ModelConfig, PlacementConfig, RewardConfig,
    RolloutConfig, TrainConfig, build_config, from_flat, load_yaml, parse_flags,
)

__all__ = [
    "MEGATRON_FLAGS", "NON_MATH_FIELDS", "SECTIONS", "AdvantageEstimator", "AlgorithmConfig", "CheckpointConfig",
    "ConfigError", "DataConfig", "EngineConfig", "EvalConfig", "KLType", "LoggingConfig", "ModelConfig",
    "PlacementConfig", "RewardConfig", "RolloutConfig", "TrainConfig", "build_config", "from_flat", "load_yaml",
    "parse_flags",
]
