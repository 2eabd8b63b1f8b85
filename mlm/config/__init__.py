"""Run configuration: nested dataclasses, TOML files and `--set section.key=value` overrides.

A run config is a TOML file whose tables are the sections below; `preset = "NAME"` fills the
model (and the seq length) from `mlm.presets`. Each config validates itself in `__post_init__`
and names the field, the value and the rule. Field docstrings are read back by `field_docs`,
so `mlm config show` prints each value with its meaning.

The package: `model` ([model] and its tables; `parts`: MoE, MLA, Mamba-2, Gated DeltaNet),
`train` ([train] and its tables), `run` (the other sections, `Config` and the checks across
sections), `io` (dicts, TOML, `--set`), `legacy` (the keys configs were written with before,
and their spellings now).
"""

from mlm.config.checks import ensure
from mlm.config.io import (
    config_from_dict,
    field_docs,
    flat_keys,
    load_config,
    parse_override,
    to_toml,
    toml_value,
)
from mlm.config.model import MAX_LAYERS, LayerSpec, ModelConfig, describe_layers
from mlm.config.parts import GatedDeltaNetConfig, MambaConfig, MLAConfig, MoEConfig, RopeConfig
from mlm.config.run import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    check_context_parallel_kinds,
    fsdp_refusals,
)
from mlm.config.train import Fp8Config, ResilienceConfig, TrainConfig

__all__ = [
    "MAX_LAYERS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "Fp8Config",
    "GatedDeltaNetConfig",
    "LayerSpec",
    "LoggingConfig",
    "MLAConfig",
    "MambaConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ResilienceConfig",
    "RopeConfig",
    "TrainConfig",
    "check_context_parallel_kinds",
    "config_from_dict",
    "describe_layers",
    "ensure",
    "field_docs",
    "flat_keys",
    "fsdp_refusals",
    "load_config",
    "parse_override",
    "to_toml",
    "toml_value",
]
