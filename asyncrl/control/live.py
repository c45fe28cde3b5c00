"""Settings a running job may change (`asyncrl ctl RUN set KEY VALUE`), and how a change becomes part
of the run's history.

A change is requested over the control API (asyncrl/control/api.py) and goes into the ledger
pending. It takes effect with the next batch the orchestrator starts to assemble: the ledger records
that step, the orchestrator's rollouts from then on use it, and the batch file carries the trainer's
settings for that step. A restarted orchestrator rebuilds its settings from the ledger, a restarted
trainer reads them from each batch it replays, so a resumed run trains every step under the settings
it had before the crash.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from asyncrl.config import Config, ConfigError, explain, merge_config, nested, parse_value

# Each is read afresh where it is used (the trainer per step, the orchestrator per group or version).
LIVE_KEYS = (
    "trainer.lr",
    "objective.eps_low",
    "objective.eps_high",
    "objective.kl_coef",
    "objective.entropy_coef",
    "rollout.max_staleness",
    "rollout.max_tokens",
    "rollout.temperature",
    "task.eval_every",
    "run.steps",
)
# One-off requests, recorded and scheduled like changes, done once at the step they are scheduled at.
ACTIONS = ("checkpoint",)


def with_settings(cfg: Config, settings: dict[str, Any]) -> Config:
    """`cfg` with the dotted `settings` set, validated like a config file (ConfigError if invalid)."""
    if not settings:
        return cfg
    tree = merge_config(cfg.model_dump(mode="json"), nested(list(settings.items())))
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


def setting(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_change(cfg: Config, key: str, text: str, next_step: int) -> Any:
    """The typed value of a requested change; ConfigError that says why it cannot be made live.
    `next_step`: the step the change will be scheduled at (the batch after the one being assembled)."""
    if key not in LIVE_KEYS:
        raise ConfigError(f"{key!r} cannot change while the run goes on; live keys: {', '.join(LIVE_KEYS)}")
    check_open(cfg, next_step)
    value = setting(with_settings(cfg, {key: parse_value(text, key)}), key)
    if key == "objective.kl_coef" and cfg.objective.kl_coef == 0 and value > 0:
        raise ConfigError("objective.kl_coef: this run started without a KL anchor (kl_coef = 0), so the "
                          "trainer holds no reference model; resume it with --objective.kl_coef to add one")
    if key == "run.steps":
        check_steps(cfg, value, next_step)
    return value


def check_open(cfg: Config, next_step: int) -> None:
    """A change or action takes effect with a batch: none is left once the last one is assembled."""
    if next_step >= cfg.run.steps:
        raise ConfigError(f"the run has assembled its last batch (step {cfg.run.steps - 1}): nothing more "
                          "would take effect (resume it with --section.key value to change it)")


def check_steps(cfg: Config, steps: int, next_step: int) -> None:
    """The trainer learns of a new run.steps from the batch it is scheduled with, so that batch is
    trained: the run can end no sooner than after it. (The lr schedule keeps the run's first length: a
    cosine goes on at trainer.min_lr_ratio past it.)"""
    if steps < next_step + 1:
        raise ConfigError(f"run.steps = {steps}: the change is scheduled with batch {next_step}, which is "
                          f"trained, so the run can end after {next_step + 1} steps at the earliest")


def settings_at(changes: list[tuple[int, str, Any]], step: int) -> dict[str, Any]:
    """The live settings in force at `step`, from (step, key, value) changes in the order made."""
    return {key: value for at, key, value in changes if at <= step and key not in ACTIONS}


def actions_at(changes: list[tuple[int, str, Any]], step: int) -> list[str]:
    """The one-off requests scheduled at exactly `step`."""
    return sorted({key for at, key, _ in changes if at == step and key in ACTIONS})
