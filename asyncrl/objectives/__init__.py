"""Objectives: one file each, one `loss(inp, cfg)` function, registered here by name.

The registry maps names to import paths so that config validation can list the names without
importing torch. A user's own objective is `objective.import_path = "module:function"` (or
"file.py:function").
"""
from __future__ import annotations

from typing import Callable

from asyncrl.plugins import import_object

REGISTRY: dict[str, str] = {
    "ppo_clip": "asyncrl.objectives.ppo_clip:loss",
    "dr_grpo": "asyncrl.objectives.dr_grpo:loss",
    "decoupled_ppo": "asyncrl.objectives.decoupled_ppo:loss",
    "tis": "asyncrl.objectives.tis:loss",
    "mis": "asyncrl.objectives.mis:loss",
    "gspo": "asyncrl.objectives.gspo:loss",
    "m2po": "asyncrl.objectives.m2po:loss",
    "vcpo": "asyncrl.objectives.vcpo:loss",
    "sao": "asyncrl.objectives.sao:loss",
    "cispo": "asyncrl.objectives.cispo:loss",
    "opd": "asyncrl.objectives.opd:loss",
    "rl_opd": "asyncrl.objectives.rl_opd:loss",
    "opd_topk": "asyncrl.objectives.opd_topk:loss",
}


def get_objective(name: str, import_path: str | None = None) -> Callable:
    target = import_path or REGISTRY.get(name)
    if target is None:
        raise KeyError(f"objective {name!r} is not registered; known: {', '.join(REGISTRY)}")
    return import_object(target, "objective.import_path")
