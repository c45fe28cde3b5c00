"""Typed run configuration: TOML file + `--section.key value` overrides, validated at load; which
changes a resumed run may take. The sections and their keys are in asyncrl/config/sections.py
(the policy's in policy.py).

Imports no torch, so the CLI can reject a bad config before any role starts.
"""
from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ValidationError, model_validator

from asyncrl.config.policy import ModelConfig, WarmstartConfig
from asyncrl.config.sections import (
    AgentConfig,
    InferenceConfig,
    ObjectiveConfig,
    RolloutConfig,
    RunConfig,
    Section,
    TaskConfig,
    TeacherConfig,
    TimeoutConfig,
    TrainerConfig,
)
from asyncrl.config.workers import WorkersConfig
from asyncrl.errors import ConfigError
from asyncrl.files import write_atomic
from asyncrl.plugins import read_user_text
from asyncrl.rundir import RunDir


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    trainer: TrainerConfig = TrainerConfig()
    inference: InferenceConfig = InferenceConfig()
    teacher: TeacherConfig = TeacherConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    workers: WorkersConfig = WorkersConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        from asyncrl.objectives import REGISTRY

        obj, ro = self.objective, self.rollout
        if obj.import_path is None and obj.name not in REGISTRY:
            raise ValueError(
                f"objective.name = {obj.name!r} is not a known objective; "
                f"allowed: {', '.join(REGISTRY)} (or set objective.import_path)"
            )
        if obj.name == "dr_grpo" and (ro.advantage != "dr_grpo" or obj.loss_agg != "constant"):
            raise ValueError(
                "objective.name = 'dr_grpo' needs rollout.advantage = 'dr_grpo' and objective.loss_agg = "
                f"'constant' (got {ro.advantage!r} and {obj.loss_agg!r}); see asyncrl/objectives/dr_grpo.py"
            )
        t = self.trainer
        if t.routing_replay and t.activation_checkpointing:
            raise ValueError(
                "trainer.routing_replay needs a forward that is not recomputed outside the replay "
                "(trainer.activation_checkpointing = false); docs/moe.md")
        if t.lora.rank and (t.publish_patches or self.inference.weight_transfer == "nccl"):
            raise ValueError(
                "trainer.lora publishes each version as its adapters alone (a file of a few percent of the "
                "weights): trainer.publish_patches and inference.weight_transfer = 'nccl' move whole "
                "weights and do not apply; turn them off (docs/lora.md)")
        if self.inference.engine == "vllm" and self.inference.update_policy != "finish":
            raise ValueError(
                f"inference.update_policy = {self.inference.update_policy!r} needs per-token versions, "
                "which vLLM "
                "does not report; with inference.engine = 'vllm' use update_policy = 'finish'"
            )
        if self.inference.weight_transfer == "nccl":
            unmet = [f"{want} (got {got!r})" for want, got, ok in (
                ("inference.engine = 'vllm'", self.inference.engine, self.inference.engine == "vllm"),
                ("trainer.device = 'cuda'", self.trainer.device, self.trainer.device.startswith("cuda")),
                ("run.launcher = 'local'", self.run.launcher, self.run.launcher == "local")) if not ok]
            if unmet:
                raise ValueError("inference.weight_transfer = 'nccl' broadcasts from a GPU trainer into vLLM "
                                 f"replicas: it also needs {', '.join(unmet)}")
        if self.inference.engine == "vllm" and self.run.launcher == "ray":
            raise ValueError("inference.engine = 'vllm' with run.launcher = 'ray' is not supported yet (vLLM "
                             "replicas run under the local launcher; docs/distributed.md)")
        _check_teacher(self)
        _check_workers(self)
        rows = ro.prompts_per_step * ro.group_size
        if rows < self.trainer.ranks * self.trainer.minibatches:
            raise ValueError(
                f"trainer.ranks = {self.trainer.ranks} x trainer.minibatches = {self.trainer.minibatches} "
                f"needs a batch of at least that many samples (rollout.prompts_per_step x group_size = "
                f"{rows}): every rank trains rows of every minibatch")
        if self.task.name == "jsonl" and not self.task.path:
            raise ValueError(
                'task.name = \'jsonl\' needs task.path, a file of {"prompt": ..., "answer": ...} rows'
            )
        if ro.group_size == 1 and ro.advantage != "running_baseline":
            raise ValueError(
                f"rollout.group_size = 1 with rollout.advantage = {ro.advantage!r} gives every sample a zero "
                "advantage; use rollout.advantage = 'running_baseline'"
            )
        if (
            any(self.agent_paths().values())
            and self.agent.max_episode_tokens > self.inference.max_prompt_tokens
        ):
            raise ValueError(
                f"agent.max_episode_tokens = {self.agent.max_episode_tokens} exceeds "
                f"inference.max_prompt_tokens = {self.inference.max_prompt_tokens}: a late turn's prompt "
                "(the whole episode so far) would be refused"
            )
        return self

    def agent_paths(self) -> dict[str | None, str | None]:
        """Each task's agent, by task label (None: the one task of a run without task.mix); None: a
        completion."""
        if self.task.mix:
            return {m.tag: m.agent or self.agent.path for m in self.task.mix}
        return {None: self.agent.path}

    @property
    def run_dir(self) -> Path:
        return Path(self.run.root) / self.run.name

    def role_threads(self, role: str) -> int:
        """Threads for one role (the launcher sets them from the cores free: asyncrl/run/threads.py); else
        when the roles alternate (η = 0) each may use every core this process may run on."""
        from asyncrl.cores import usable_cores

        if role == "teacher":
            return self.teacher.threads
        asked = self.trainer.threads if role == "trainer" else self.inference.threads
        if asked:
            return asked
        cores = usable_cores()
        return cores if self.rollout.max_staleness == 0 else max(1, cores // 2)


def _check_workers(cfg) -> None:
    """What joined workers' samples cannot carry yet, refused before anything starts (docs/untrusted.md)."""
    w = cfg.workers
    unmet = [why for why, on in (
        ("LoRA versions (trainer.lora.rank): the recompute holds whole weights", cfg.trainer.lora.rank),
        ("routing replay: a worker's expert choices would be replayed unchecked", cfg.trainer.routing_replay),
        ("run.launcher = 'ray' with run.storage: the recompute reads versions from the run directory",
         cfg.run.launcher == "ray" and cfg.run.storage)) if on]
    if w.enabled and unmet:
        raise ValueError(f"workers.enabled does not take {unmet[0]}")


# the objectives that train on a teacher's logprobs (asyncrl/objectives/opd*.py, rl_opd.py)
DISTILLING = ("opd", "rl_opd", "opd_topk")


def _check_teacher(cfg: Config) -> None:
    """An objective that distils needs a teacher (and its top-k, for the forward KL over them)."""
    name, teacher = cfg.objective.name, cfg.teacher
    if cfg.objective.import_path is None and name in DISTILLING and not teacher.enabled:
        raise ValueError(f"objective.name = {name!r} distils from a teacher: set teacher.path (a model with "
                         "the student's tokenizer; docs/distillation.md)")
    if name == "opd_topk" and cfg.objective.import_path is None and teacher.top_k < 1:
        raise ValueError("objective.name = 'opd_topk' trains on the teacher's top-k tokens: set "
                         "teacher.top_k (e.g. 8)")
    if teacher.engine == "vllm" and cfg.run.launcher == "ray" and not teacher.url:
        raise ValueError("teacher.engine = 'vllm' with run.launcher = 'ray' is not supported yet (as for the "
                         "inference replicas); run it yourself and give teacher.url")


def parse_value(text: str, key: str = "") -> Any:
    """An override value: TOML/JSON literal when it parses as one, else the plain string; always the
    string for a text setting (`--run.name nan` is a name, not a float)."""
    if _is_text(key):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_text(key: str) -> bool:
    """Whether the setting at dotted `key` holds text (str, optional str, or a choice of strings)."""
    model, field = Config, None
    for part in key.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        field = model.model_fields[part]
        model = field.annotation
    options = typing.get_args(model) if typing.get_origin(model) is typing.Literal else ()
    if options:
        return all(isinstance(o, str) for o in options)
    if typing.get_origin(model) in (list, tuple, dict):  # (a list of strings is a TOML list: ["a", "b"])
        return False
    kinds = [k for k in (typing.get_args(model) or (model,)) if k is not type(None)]
    return field is not None and kinds == [str]


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """["--rollout.max_staleness", "4", "--run.name=x"] -> {"rollout": {"max_staleness": 4}, ...}"""
    flat: list[tuple[str, Any]] = []
    items = iter(args)
    for arg in items:
        if not arg.startswith("--"):
            raise ConfigError(f"override {arg!r} must look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value = next(items, None)
            if value is None:
                raise ConfigError(f"override --{key} has no value")
        flat.append((key, parse_value(value, key)))
    return nested(flat)


def nested(flat: list[tuple[str, Any]]) -> dict[str, Any]:
    """[("rollout.max_staleness", 4)] -> {"rollout": {"max_staleness": 4}}, later keys winning."""
    tree: dict[str, Any] = {}
    for key, value in flat:
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def merge_config(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "params":
            out[key] = merge_config(out[key], value)
        else:
            out[key] = value
    return out


def explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if not key:  # a rule across sections; its message names the keys
            lines.append(e["msg"].removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden":
            section = e["loc"][:-1]
            allowed = _allowed_keys(section)
            lines.append(f"unknown key {key!r}; allowed here: {', '.join(allowed)}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a rule within a section
            lines.append(f"[{key}] " + e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key} = {e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _allowed_keys(section_path: tuple) -> list[str]:
    model: type[BaseModel] = Config
    for part in section_path:
        field = model.model_fields.get(str(part))
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return []
        model = field.annotation
    return list(model.model_fields)


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(read_user_text(path, "config file"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    if overrides:
        extra = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
        data = merge_config(data, extra)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


def save_config(cfg: Config, path: Path) -> None:
    write_atomic(path, json.dumps(cfg.model_dump(mode="json"), indent=2))


# Keys that change how a run is executed but not what it computes: free to change on resume.
RESUMABLE_KEYS = (
    "run.root",
    "run.name",
    "run.steps",
    "run.overwrite",
    "run.prune_trained",
    "run.max_restarts",
    "run.cores",
    "run.fork_roles",
    "run.launcher",
    "run.ray_",
    "run.sinks",  # (where records are copied to, not what they are)
    "run.wandb_",
    "run.log_level",
    "inference.replicas",
    "teacher.replicas",
    "teacher.threads",
    "teacher.max_concurrent",
    "teacher.url",  # (the same teacher served elsewhere)
    "teacher.token_file",
    "teacher.ray_resources",
    "inference.ray_resources",
    "trainer.ray_resources",
    "timeouts.",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.keep_weight_versions",
    "trainer.threads",
    "trainer.ranks",  # (DCP reshards a checkpoint's optimizer to any rank count)
    "trainer.activation_checkpointing",
    "trainer.share_prefixes",  # (the same numbers either way)
    "trainer.device",
    "inference.device",
    "inference.host",
    "inference.port",
    "inference.threads",
    "inference.max_waiting_sequences",
    "rollout.max_failed_samples",
    "inference.vllm_python",
    "task.eval_every",
    "model.warmstart_if_missing",
    "agent.max_concurrent_episodes",
    "agent.scheduling",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "params":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(changes that would alter the run's meaning, harmless ones), each as 'key: old -> new'."""
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    meaning, harmless = [], []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            # a cosine schedule ends at run.steps: more steps change the lr of the steps to come
            free = key.startswith(RESUMABLE_KEYS) and not (
                key == "run.steps" and new.trainer.lr_schedule == "cosine"
            )
            (harmless if free else meaning).append(line)
    return meaning, harmless


def read_run_config(run_dir: str | Path) -> Config:
    path = RunDir(run_dir).config
    try:
        return Config.model_validate_json(path.read_text())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ConfigError(f"{path} is not a readable run config: {where + ': ' if where else ''}"
                          f"{first['msg']}") from None
