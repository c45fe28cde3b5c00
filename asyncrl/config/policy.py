"""The policy's sections: which model a run trains, and the supervised warm start that builds the tiny
ones (dense or mixture-of-experts) when no hub model is used."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.sections import Section


class ModelConfig(Section):
    path: str = "models/tiny-default"
    # When `path` is the default tiny model and it is missing, build it first (asyncrl warmstart).
    warmstart_if_missing: bool = True
    # the profile of size-dependent defaults (lr, answer length, batch shape, ...: asyncrl/config/scale.py)
    # for the keys a config leaves unset; auto: by the model's parameter count
    defaults: Literal["auto", "tiny", "small", "large"] = "auto"


class WarmstartConfig(Section):
    """The supervised warm start that builds the tiny default policy (asyncrl/policy/warmstart.py)."""

    # 1500 x 32: the ~52% greedy start of 1500 x 64 on half the examples (~2.4 min on 2 cores instead of
    # ~4.5) for seeds 0 and 1; seed 2 ends partly on the loss plateau (26%; 50% with x 64), so this is not
    # yet a recipe for every seed (docs/default_recipe.md)
    steps: int = Field(1500, ge=1)
    max_seconds: float = Field(900.0, gt=0, description="stop early on a slow machine")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0, description="peak (asyncrl/policy/warmstart.py has the schedule)")
    warmup_steps: int = Field(50, ge=1)
    # bpe: byte-level BPE trained on the task's text, ChatML template (Qwen's); char: one token per
    # character with the compact "tiny" template
    tokenizer: Literal["bpe", "char"] = "bpe"
    vocab_size: int = Field(
        512, ge=300, description="bpe: at most this many tokens (256 bytes + merges + specials)"
    )
    # qwen2_5_vl: a vision-language policy (asyncrl/vision/tiny.py) for tasks whose rows show images
    architecture: Literal["qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_5_vl"] = "qwen3"
    hidden_size: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1, description="grouped-query attention: key/value heads (divides heads)")
    # qwen3_moe: every layer's MLP is this many experts, of which a router picks `experts_per_token`
    experts: int = Field(8, ge=2)
    experts_per_token: int = Field(2, ge=1)
    # 0: the cores free for it (asyncrl/cores.py), looked at again every WATCH_EVERY steps
    threads: int = Field(0, ge=0)
    seed: int = 0
    # "module:function" taking a random.Random and returning one demonstration conversation
    # {"messages": [...], "tools": [...]}: supervised data for agent tasks (the policy learns on
    # its replies only). None: the task's prompt -> answer pairs.
    demos: str | None = None
    # "module:function" (entry, rng, **teacher_params) -> the answer a prompt -> answer demonstration
    # shows (asyncrl/rewards/teachers.py); None: the task's own answer
    teacher: str | None = "asyncrl.rewards.teachers:drops_overflow"
    teacher_params: dict[str, Any] = {"slip": 0.7}
    # a policy (HF name or directory) to fine-tune instead of a freshly built tiny model: its tokenizer and
    # weights, so a new task's warm start can begin from a policy that already has the skill (e.g. the
    # default's sums, for the same sums behind a long preamble); the architecture fields are then unused
    base: str | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> "WarmstartConfig":
        if self.heads % self.kv_heads or self.hidden_size % self.heads:
            raise ValueError(f"warmstart.heads = {self.heads} must be a multiple of warmstart.kv_heads = "
                             f"{self.kv_heads} and divide warmstart.hidden_size = {self.hidden_size}")
        if self.experts_per_token > self.experts:
            raise ValueError(f"warmstart.experts_per_token = {self.experts_per_token} is more than "
                             f"warmstart.experts = {self.experts}")
        return self
