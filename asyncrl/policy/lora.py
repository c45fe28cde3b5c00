"""LoRA adapters on a policy (trainer.lora): low-rank matrices A, B beside each frozen target weight W0.

In the trainer PEFT injects them (`attach`) and only they train. Everything that leaves the trainer —
each published version, each checkpoint, the optimizer's state — is the adapters alone, named as PEFT
saves them (`base_model.model.<module>.lora_A.weight`), so a version file is an adapter_model.safetensors
that PEFT and vLLM load as it is. The built-in engine and `asyncrl export` hold a plain model instead and
merge a version into a copy of its base weights (`Merged`): W = W0 + (alpha / rank) · B A, the sum PEFT's
own merge computes, in the same order (bit for bit in float32).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PREFIX = "base_model.model."  # PEFT's file names start here (the PeftModel wrapping the model)
ADAPTER = "default"  # the one adapter's name inside the trainer's modules
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # a PEFT directory


def peft_config(spec, base: str | None = None):
    """PEFT's LoraConfig for trainer.lora. `base`: the policy's path (made absolute, so that an export run
    from elsewhere finds it) or hub name, recorded as the adapters' base_model_name_or_path."""
    from peft import LoraConfig

    targets = list(spec.target_modules)
    if base is not None and Path(base).exists():
        base = str(Path(base).resolve())
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      # PEFT's shortcut for every linear layer but the output head is a string, not a name
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      base_model_name_or_path=base)


def attach(model: torch.nn.Module, spec) -> torch.nn.Module:
    """Adapters on `model`'s target modules (B = 0: the model computes what it did); every other weight
    frozen."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(spec), model)
    except ValueError as e:
        raise ValueError(f"trainer.lora.target_modules = {list(spec.target_modules)}: {e}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved_name(name: str) -> str:
    """A trainer module's adapter name as PEFT's files spell it."""
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters in a trainer's state dict, under their saved names."""
    return {saved_name(name): tensor for name, tensor in state.items() if is_adapter(name)}


def load_adapters(model: torch.nn.Module, saved: dict[str, torch.Tensor], where: str) -> None:
    """Saved adapters into a model they were attached to; ValueError naming `where` if they do not fit."""
    own = {saved_name(name): param for name, param in model.named_parameters() if is_adapter(name)}
    _check_names(set(own), set(saved), where)
    with torch.no_grad():
        for name, param in own.items():
            if param.shape != saved[name].shape:
                raise ValueError(f"{where}: {name} has shape {list(saved[name].shape)}, the adapter here "
                                 f"{list(param.shape)} (another trainer.lora.rank?)")
            param.copy_(saved[name])


def _check_names(expected: set[str], given: set[str], where: str) -> None:
    if expected != given:
        missing, extra = sorted(expected - given), sorted(given - expected)
        raise ValueError(f"{where} does not hold this policy's adapters: {len(missing)} missing "
                         f"{missing[:2]}, {len(extra)} unknown {extra[:2]} (another "
                         "trainer.lora.target_modules?)")


def write_config(config, directory: Path) -> None:
    """adapter_config.json from a `peft_config`: what PEFT (PeftModel.from_pretrained) and vLLM read beside
    the adapters' weights."""
    text = json.dumps(config.to_dict(), indent=2,
                      default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / CONFIG_FILE).write_text(text)


class Merged:
    """A plain model (no adapter modules) serving base + a version's adapters: each target weight is
    rewritten from the copy of its base kept at the first version that touched it."""

    def __init__(self, model: torch.nn.Module, spec):
        self.model, self.scale = model, spec.alpha / spec.rank
        self.modules = dict(model.named_modules())
        self.base: dict[str, torch.Tensor] = {}  # module name -> its weight before any adapter
        self.held: dict[str, torch.Tensor] = {}  # the adapters merged now (their hash is the version's)

    def apply(self, saved: dict[str, torch.Tensor], where: str) -> None:
        pairs = self._pairs(saved, where)
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                weight = self.modules[name].weight
                if name not in self.base:
                    self.base[name] = weight.detach().clone()
                # PEFT's order, (B A) · scale + W0, in float32; one buffer for the whole sum
                merged = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
                merged.mul_(self.scale).add_(self.base[name])
                weight.copy_(merged)
        self.held = saved

    def _pairs(self, saved: dict[str, torch.Tensor], where: str) -> dict[str, tuple]:
        """{module name: (A, B)}, checked against this model's modules before anything is written."""
        names = {key.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for key in saved}
        expected = {f"{PREFIX}{n}.lora_{x}.weight" for n in names for x in "AB"}
        _check_names(expected, set(saved), where)
        if self.held:
            _check_names(set(self.held), set(saved), where)
        pairs = {}
        for name in sorted(names):
            a, b = saved[f"{PREFIX}{name}.lora_A.weight"], saved[f"{PREFIX}{name}.lora_B.weight"]
            weight = getattr(self.modules.get(name), "weight", None)
            if weight is None or weight.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise ValueError(f"{where}: adapter {name} ({b.shape[0]}x{a.shape[1]}) fits no weight of "
                                 f"{type(self.model).__name__} of that shape")
            pairs[name] = (a, b)
        return pairs
