"""A run's configuration: the sections and their keys (sections.py), loading a TOML file with
`--section.key value` overrides and validating it (load.py), and which changes a resumed run may take."""
from asyncrl.config.load import (
    RESUMABLE_KEYS,
    Config,
    config_changes,
    explain,
    load_config,
    merge_config,
    nested,
    parse_overrides,
    parse_value,
    read_run_config,
    save_config,
)
from asyncrl.errors import ConfigError

__all__ = [
    "RESUMABLE_KEYS", "Config", "ConfigError", "config_changes", "explain", "load_config", "merge_config",
    "nested", "parse_overrides", "parse_value", "read_run_config", "save_config",
]
