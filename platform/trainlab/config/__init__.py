"""The config layer: the one place that decides *what* an experiment is."""

from trainlab.config.loader import (
    apply_overrides,
    config_hash,
    deep_merge,
    flatten,
    load_config,
    load_raw,
    to_yaml,
    validate_raw,
)
from trainlab.config.rules import Problem, check_rules
from trainlab.config.schema import (
    AlertsConfig,
    CheckpointConfig,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    ParallelConfig,
    ResourceConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = [
    "AlertsConfig", "CheckpointConfig", "DataConfig", "ExperimentConfig", "ModelConfig",
    "ParallelConfig", "Problem", "ResourceConfig", "TrackingConfig", "TrainConfig",
    "apply_overrides", "check_rules", "config_hash", "deep_merge", "flatten", "load_config",
    "load_raw", "to_yaml", "validate_raw",
]
