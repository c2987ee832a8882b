"""The one typed config of trainfit: its schema, cross-field rules, derived batch arithmetic and reading.

The config layer sits below everything else and imports nothing of trainfit outside itself. Its modules:
base (ConfigError, the strict section base), one module per group of sections (model, data, train, rl,
rollout, dpo), stages (the stage table), rules (cross-field rules), devices (which GPUs train, which roll
out), schema (the root `Config`, `BatchPlan`, validation and pipeline expansion), errors (pydantic errors
as one paragraph), peer_keys (the keys of TRL, verl, OpenRLHF and LLaMA-Factory that mean a trainfit key,
for the unknown-key error), words (counts in words) and io (YAML files and `key=value` overrides). The public names are re-exported here:
`from trainfit.config import X`.
"""

from trainfit.config.base import ConfigError, _Section, deep_merge
from trainfit.config.data import DataConfig, TaskConfig
from trainfit.config.devices import DeviceSplit, device_split, rollout_device, shared_gpu_note
from trainfit.config.dpo import DPOConfig, dpo_errors
from trainfit.config.io import (apply_override, compact, field_doc, format_validation_error, load_config, to_yaml,
                                valid_keys)
from trainfit.config.model import ModelConfig, PeftConfig
from trainfit.config.rl import GRPOConfig, PPOConfig, RLModelsConfig
from trainfit.config.rollout import EnvConfig, RolloutConfig
from trainfit.config.rules import Rule, cross_field_errors, rollout_errors
from trainfit.config.schema import BatchPlan, Config, StageName, expand_stages, validate
from trainfit.config.train import TRACKERS, DistributedConfig, HardwareConfig, LoggingConfig, TrainConfig

__all__ = ["BatchPlan", "Config", "ConfigError", "DPOConfig", "DataConfig", "DeviceSplit", "DistributedConfig",
           "EnvConfig", "GRPOConfig", "HardwareConfig", "LoggingConfig", "ModelConfig", "PPOConfig", "PeftConfig",
           "RLModelsConfig", "RolloutConfig", "Rule", "StageName", "TRACKERS", "TaskConfig", "TrainConfig",
           "_Section", "apply_override", "compact", "cross_field_errors", "deep_merge", "device_split",
           "dpo_errors", "expand_stages", "field_doc", "format_validation_error", "load_config", "rollout_device",
           "rollout_errors", "shared_gpu_note", "to_yaml", "valid_keys", "validate"]
