"""Settings a running job may change (`asyncrl ctl RUN set KEY VALUE`), and how a change becomes part
of the run's history.

A change is requested over the control API (asyncrl/orchestrator/control.py) and goes into the ledger
pending. It takes effect with the next batch the orchestrator starts to assemble: the ledger records
that step, the orchestrator's rollouts from then on use it, and the batch file carries the trainer's
settings for that step. A restarted orchestrator rebuilds its settings from the ledger, a restarted
trainer reads them from each batch it replays, so a resumed run trains every step under the settings
it had before the crash.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from asyncrl.config import Config, ConfigError, explain, merge_config, parse_value

# Each is read afresh where it is used (the trainer per step, the orchestrator per group or version).
LIVE_KEYS = (
    "trainer.lr",
    "objective.eps_low",
    "objective.eps_high",
    "objective.kl_coef",
    "objective.entropy_coef",
    "rollout.max_staleness",
    "rollout.max_tokens",
    "task.eval_every",
)


def with_settings(cfg: Config, settings: dict[str, Any]) -> Config:
    """`cfg` with the dotted `settings` set, validated like a config file (ConfigError if invalid)."""
    if not settings:
        return cfg
    tree: dict[str, Any] = {}
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return Config.model_validate(merge_config(cfg.model_dump(mode="json"), tree))
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


def setting(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_change(cfg: Config, key: str, text: str) -> Any:
    """The typed value of a requested change; ConfigError that says why it cannot be made live."""
    if key not in LIVE_KEYS:
        raise ConfigError(f"{key!r} cannot change while the run goes on; live keys: {', '.join(LIVE_KEYS)}")
    value = setting(with_settings(cfg, {key: parse_value(text, key)}), key)
    if key == "objective.kl_coef" and cfg.objective.kl_coef == 0 and value > 0:
        raise ConfigError("objective.kl_coef: this run started without a KL anchor (kl_coef = 0), so the "
                          "trainer holds no reference model; resume it with --objective.kl_coef to add one")
    return value


def settings_at(changes: list[tuple[int, str, Any]], step: int) -> dict[str, Any]:
    """The live settings in force at `step`, from (step, key, value) changes in the order made."""
    return {key: value for at, key, value in changes if at <= step}
