"""Routing replay (R3) for mixture-of-experts policies: the experts a router chose, recorded, and forced.

A MoE block's router maps each token's hidden state to logits over the experts and keeps the top k.
`record(routers(model))` collects, for every forward inside it, each MoE layer's chosen indices ([tokens, k]
per layer, the block's own flattening of [rows, positions]). `replay(model, indices)` makes the next
forward's routers use the given indices instead of their own top-k, with the gate weights recomputed
from the router's own logits over those experts (softmax over all experts, gathered at the forced
ones, renormalised where the model renormalises: ALGORITHMS.md, "Routing replay"), so gradients
still reach the router. An index of -1 keeps the router's own choice for that token (the last
sampled token, never fed to the engine, has none recorded).
"""
from __future__ import annotations

import base64
import io
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

# transformers' softmax-then-top-k routers, whose gate weights `_forced` recomputes the same way (others,
# DeepSeek-V3's grouped and biased choice or GPT-OSS's softmax over the chosen, would need their own)
REPLAYABLE = {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"}


def routers(model) -> list[torch.nn.Module]:
    """The MoE routers of `model` that can be recorded and replayed, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in REPLAYABLE]


def from_npy(text: str) -> dict:
    """vLLM's routed experts (`--enable-return-routed-experts`: a base64 NumPy .npy file of
    [tokens − 1, layers, k]) packed as `pack` packs the built-in engine's."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
    except (TypeError, ValueError, OSError) as e:
        raise ValueError(f"routed_experts {text[:40]!r}... is not a base64 .npy array: {e}") from None
    if array.ndim != 3:
        raise ValueError(f"routed_experts has shape {list(array.shape)}, not [tokens, layers, k]")
    return pack(torch.from_numpy(array.astype(np.int64)))


@contextmanager
def record(gates: list[torch.nn.Module]):
    """Yields a list, per forward inside the block, of the chosen experts of each of `gates` (a model's
    `routers`: [tokens, k] each); empty for a dense model, which has none."""
    calls: list[list[torch.Tensor]] = []
    pending: list[torch.Tensor] = []

    def hook(gate, args, out):
        pending.append(out[2].detach().to(torch.int16))
        if len(pending) == len(gates):  # (the last layer of one forward)
            calls.append(pending.copy())
            pending.clear()

    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def per_row(calls: list, rows: int, width: int) -> list[torch.Tensor]:
    """The first recorded forward over [rows, width] tokens as one [width, layers, k] tensor per row
    ([] when nothing was recorded)."""
    if not calls:
        return []
    layers = torch.stack(calls[0])  # [layers, rows · width, k]
    return list(layers.view(layers.shape[0], rows, width, -1).permute(1, 2, 0, 3))


def stacked(routes: list[torch.Tensor]) -> torch.Tensor | None:
    """A sample's chunks of routes as one [tokens, layers, k] tensor (None for a dense policy)."""
    return torch.cat(routes) if routes else None


def pack(routes: torch.Tensor) -> dict:
    """[tokens, layers, k] as JSON: its shape and its bytes in base64, one byte an index where the
    experts number fewer than 256 (-1, "none recorded", as 255), two otherwise."""
    small = routes.numel() == 0 or int(routes.max()) < 255
    array = routes.numpy().astype(np.uint8 if small else np.int16)
    return {"shape": list(routes.shape), "dtype": array.dtype.name,
            "data": base64.b64encode(array.tobytes()).decode()}


def unpack(packed: dict) -> torch.Tensor:
    """`pack`'s output as an int64 [tokens, layers, k] tensor, -1 where none was recorded."""
    try:
        data = base64.b64decode(packed["data"])
        array = np.frombuffer(data, dtype=packed["dtype"]).reshape(packed["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"routing {str(packed)[:80]!r} is not a packed [tokens, layers, k] array: {e}") \
            from None
    out = torch.from_numpy(array.astype(np.int64))
    return out.masked_fill(out == 255, -1) if packed["dtype"] == "uint8" else out


@contextmanager
def replay(model, indices: torch.Tensor):
    """Inside the block, forwards route by `indices`: [layers, tokens, k] (tokens in the block's
    flattening of the forward's [rows, positions]); -1 keeps the router's own choice."""
    gates = routers(model)
    if indices.shape[0] != len(gates):
        raise ValueError(f"routing for {indices.shape[0]} MoE layers given to a model with {len(gates)}")
    originals = [g.forward for g in gates]
    for gate, forced in zip(gates, indices):
        gate.forward = _forced(gate, forced)
    try:
        yield
    finally:
        for gate, forward in zip(gates, originals):
            gate.forward = forward


def _forced(gate, forced: torch.Tensor):
    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(hidden_states, gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        idx = forced.to(device=logits.device, dtype=torch.long)
        if idx.shape != (logits.shape[0], gate.top_k):
            raise ValueError(f"routing replay: {tuple(idx.shape)} indices for {logits.shape[0]} tokens × "
                             f"top-{gate.top_k}")
        own = torch.topk(probs, gate.top_k, dim=-1).indices
        idx = torch.where(idx < 0, own, idx)
        weights = probs.gather(1, idx)
        if getattr(gate, "norm_topk_prob", True):  # (Mixtral's always renormalises)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), idx
    return forward
