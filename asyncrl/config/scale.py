"""Defaults that depend on the policy's size, chosen from the model (or named by `model.defaults`).

The section defaults (sections.py) are the CPU demo's: a ~1M-parameter policy built here, 1-8-token
answers, lr 1e-4. A pretrained model trained with them collapses: SmolLM2-135M-Instruct at lr 1e-4 rose
from 9% to 25% held-out in 10 steps, then fell to 5% at step 20 with its entropy at a quarter of its start.
So a run takes the keys below from its model's profile wherever its own config leaves them unset, and says
which it took. A key the user sets always wins.
"""
from __future__ import annotations

import json
from pathlib import Path

# parameters below which a model is "tiny" (asyncrl's own policies: 0.8-20M) and above which "large"
TINY_BELOW, LARGE_FROM = 30e6, 3e9

PROFILES: dict[str, dict[str, object]] = {
    "tiny": {},  # the section defaults are this profile's
    # a pretrained LM of 30M-3B parameters (SmolLM2-135M/360M/1.7B, Qwen3-0.6B/1.7B): the lr of TRL's and
    # verl's small-model recipes scaled for few, small batches; answers of sentences, not digits
    "small": {
        "trainer.lr": 1e-5,
        "trainer.warmup_steps": 5,
        "trainer.grad_clip": 1.0,
        "objective.kl_coef": 0.0,
        "rollout.max_tokens": 128,
        "rollout.temperature": 1.0,
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 8,
        "inference.max_prompt_tokens": 512,
        "task.eval_size": 128,
        # a request of 64 prompts x 128 tokens takes a 135M model on one core over a minute
        "timeouts.http": 600.0,
    },
    # 3B and up (GPU runs): verl's and prime-rl's lr for 7B-class models, long answers
    "large": {
        "trainer.lr": 1e-6,
        "trainer.warmup_steps": 10,
        "trainer.grad_clip": 1.0,
        "objective.kl_coef": 0.0,
        "rollout.max_tokens": 1024,
        "rollout.temperature": 1.0,
        "rollout.prompts_per_step": 32,
        "rollout.group_size": 8,
        "inference.max_prompt_tokens": 2048,
        "task.eval_size": 256,
        "timeouts.http": 600.0,
    },
}


def parameters(model_dir: Path) -> int | None:
    """The model's parameter count from its safetensors headers (exact; no weights read), None where there
    are none (a hub name, .bin weights)."""
    total = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with open(shard, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for size in tensor["shape"]:
                    count *= size
                total += count
    return total or None


def profile_for(count: int | None) -> str:
    if count is None:
        return "small"  # (a model that is not a local directory is a pretrained one)
    return "tiny" if count < TINY_BELOW else "large" if count >= LARGE_FROM else "small"


def apply_profile(cfg, model_dir: Path | None, log=print):
    """`cfg` with its profile's values for every key its own config did not set, and model.defaults naming
    the profile used (so that a resumed run, whose every key is set, keeps them)."""
    chosen = cfg.model.defaults
    count = parameters(model_dir) if model_dir is not None and model_dir.is_dir() else None
    if chosen == "auto":
        chosen = profile_for(count)
    taken = {key: value for key, value in PROFILES[chosen].items()
             if not _was_set(cfg, key) and _value(cfg, key) != value}
    tree = cfg.model_dump()
    for key, value in taken.items():
        section, field = key.split(".")
        tree[section][field] = value
    tree["model"]["defaults"] = chosen
    if chosen != "tiny":
        size = f"{count / 1e6:.1f}M parameters" if count else "a model not on disk"
        settings = ", ".join(f"{key} = {value}" for key, value in taken.items()) or "none (all set)"
        log(f"defaults: the {chosen!r} profile for {size} (model.defaults; a key set in the config wins), "
            f"taking {settings}")
    return type(cfg).model_validate(tree)


def _value(cfg, key: str):
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def _was_set(cfg, key: str) -> bool:
    section, field = key.split(".")
    return field in getattr(cfg, section).model_fields_set
