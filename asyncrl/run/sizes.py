"""Every size checked against what it must fit, before any role starts: a setting that can never
work is refused with the numbers, instead of a role that dies and is restarted into the same death.

    a sequence   prompt + answer (or an agent's whole episode) within the model's context
    a request    the largest group request the orchestrator sends within the server's queue
    a batch      the trainer's activations for one minibatch within this machine's free memory

The memory figure is a lower bound (two float32 tensors of the model's width per layer, per token of
the minibatch, plus the weights, gradients and AdamW's moments), so that nothing that could run is
refused; what passes it and still runs out of memory is caught when it happens (supervisor.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from asyncrl.config import Config, ConfigError

GIB = 2**30


def check_sizes(cfg: Config) -> None:
    model = model_config(Path(cfg.model.path))
    if model is not None:
        _check_context(cfg, model)
    if cfg.inference.engine == "builtin":
        _check_queue(cfg)
    if model is not None and cfg.trainer.device == "cpu":
        _check_memory(cfg, model, available_memory())


def model_config(path: Path) -> dict | None:
    """A local model's config.json (its text model's, for a multimodal one); None for a hub name."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("text_config", config) if isinstance(config, dict) else None


def longest_sequence(cfg: Config) -> tuple[int, str]:
    """(tokens, what sets them) of the longest sequence a role may hold: a prompt and its answer, or an
    agent's whole episode."""
    agents = cfg.agent_paths().values()
    single = (cfg.inference.max_prompt_tokens + cfg.rollout.max_tokens,
              "inference.max_prompt_tokens + rollout.max_tokens")
    episode = (cfg.agent.max_episode_tokens, "agent.max_episode_tokens")
    if all(agents):
        return episode
    return max(single, episode) if any(agents) else single


def _check_context(cfg: Config, model: dict) -> None:
    context = model.get("max_position_embeddings")
    if not context:
        return
    tokens, what = longest_sequence(cfg)
    if tokens <= context:
        return
    where = f"model.path = {cfg.model.path!r} holds {context} positions (max_position_embeddings)"
    if what.startswith("agent"):
        raise ConfigError(f"agent.max_episode_tokens = {tokens} is longer than the model's context: {where}")
    if cfg.rollout.max_tokens >= context:
        raise ConfigError(f"rollout.max_tokens = {cfg.rollout.max_tokens} leaves no room for a prompt in the "
                          f"model's context: {where}")
    raise ConfigError(f"{what} = {cfg.inference.max_prompt_tokens} + {cfg.rollout.max_tokens} = {tokens} "
                      f"tokens is longer than the model's context: {where}; lower "
                      f"inference.max_prompt_tokens to {context - cfg.rollout.max_tokens} "
                      "or rollout.max_tokens")


def largest_request(cfg: Config) -> int:
    """Sequences in the largest request the orchestrator sends: a part of a wave (waves.parts: up to a
    batch of groups, at most max_batch_sequences rows, but one group at least)."""
    ro = cfg.rollout
    groups = max(1, min(cfg.inference.max_batch_sequences // ro.group_size, ro.prompts_per_step))
    return groups * ro.group_size


def _check_queue(cfg: Config) -> None:
    rows, queue = largest_request(cfg), cfg.inference.max_waiting_sequences
    if rows > queue:
        raise ConfigError(f"a request of {rows} sequences (rollout.group_size = {cfg.rollout.group_size}: a "
                          f"group goes to one server whole) can never wait in a server whose queue holds "
                          f"{queue} (inference.max_waiting_sequences): raise it or lower rollout.group_size")


def minibatch_rows(cfg: Config) -> int:
    ro = cfg.rollout
    return math.ceil(ro.prompts_per_step * ro.group_size / cfg.trainer.minibatches)


def trainer_memory_floor(cfg: Config, model: dict) -> int:
    """Bytes the trainer needs at least for one minibatch (see the module's docstring)."""
    width, layers = model.get("hidden_size", 0), model.get("num_hidden_layers", 0)
    vocab = model.get("vocab_size", 0)
    params = vocab * width  # (the embedding alone: a floor)
    tokens = minibatch_rows(cfg) * longest_sequence(cfg)[0]
    return 2 * 4 * layers * width * tokens + 16 * params


def available_memory() -> int | None:
    """MemAvailable, in bytes (None where /proc/meminfo is not there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(cfg: Config, model: dict, available: int | None) -> None:
    need = trainer_memory_floor(cfg, model)
    if available is None or need <= available:
        return
    ro = cfg.rollout
    raise ConfigError(
        f"one minibatch of {minibatch_rows(cfg)} sequences (rollout.prompts_per_step = {ro.prompts_per_step} "
        f"x rollout.group_size = {ro.group_size} / trainer.minibatches = {cfg.trainer.minibatches}) of up to "
        f"{longest_sequence(cfg)[0]} tokens needs at least {need / GIB:.1f} GiB in the trainer; this machine "
        f"has {available / GIB:.1f} GiB free: raise trainer.minibatches or lower those")
