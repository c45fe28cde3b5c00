"""The KV cache of a running batch as plain tensors, so rows can join and leave between steps.

A transformers `DynamicCache` holds, per layer, keys and values of shape [rows, heads, length,
head_dim]. The engine left-pads: every row's newest token sits in the last column, and shorter
rows have zero keys/values (masked out) on the left. Joining two batches pads the shorter one
on the left; columns that no row uses any more are cut off on the left.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56: plain DynamicCache only
    DynamicLayer = object


def tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument (and output) `cache`; older releases
    `past_key_values`."""
    return "cache" if takes(model, "cache") else "past_key_values"


def takes(model, argument: str) -> bool:
    """Whether the model's forward has `argument`."""
    return argument in inspect.signature(model.forward).parameters


def build(layers: list[tuple[torch.Tensor, torch.Tensor]], config, spare: int | None = 64) -> DynamicCache:
    """A DynamicCache holding `layers`, each in a buffer with `spare` free columns to grow into (None: plain
    layers that grow by concatenation, as autograd needs: the trainer's)."""
    try:
        cache = DynamicCache(ddp_cache_data=layers, config=config)
    except TypeError:  # older releases take no config
        return DynamicCache.from_legacy_cache(tuple(layers))
    for layer in getattr(cache, "layers", []) if spare is not None else []:
        if type(layer) is DynamicLayer:
            GrowingLayer.adopt(layer, spare)
    return cache


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views into a buffer with spare columns.

    DynamicLayer concatenates the whole cache with each new token (a copy of every layer's KV per
    step); here a step writes one column in place and the buffer doubles when full.
    """

    @classmethod
    def adopt(cls, layer: DynamicLayer, spare: int) -> None:
        layer.__class__ = cls
        k, v = layer.keys, layer.values
        layer.length = k.shape[-2]
        layer._k = k.new_empty((*k.shape[:-2], layer.length + spare, k.shape[-1]))
        layer._v = v.new_empty((*v.shape[:-2], layer.length + spare, v.shape[-1]))
        layer._k[..., : layer.length, :] = k
        layer._v[..., : layer.length, :] = v
        layer._expose()

    def _expose(self) -> None:
        self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.length + n > self._k.shape[-2]:
            grow = max(self._k.shape[-2], n)
            self._k = torch.cat(
                [self._k, self._k.new_empty((*self._k.shape[:-2], grow, self._k.shape[-1]))], dim=-2
            )
            self._v = torch.cat(
                [self._v, self._v.new_empty((*self._v.shape[:-2], grow, self._v.shape[-1]))], dim=-2
            )
        self._k[..., self.length : self.length + n, :] = key_states
        self._v[..., self.length : self.length + n, :] = value_states
        self.length += n
        self._expose()
        return self.keys, self.values


def left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 2 (KV) or the last dim (mask) on the left to `width` with zeros."""
    dim = 2 if x.dim() == 4 else -1
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def concat(a: list, a_mask: torch.Tensor, b: list, b_mask: torch.Tensor):
    """Stack two batches' (layers, attention mask) along rows, aligning them on the right."""
    width = max(a_mask.shape[1], b_mask.shape[1])
    layers = [
        (
            torch.cat([left_pad(ka, width), left_pad(kb, width)]),
            torch.cat([left_pad(va, width), left_pad(vb, width)]),
        )
        for (ka, va), (kb, vb) in zip(a, b)
    ]
    return layers, torch.cat([left_pad(a_mask, width), left_pad(b_mask, width)])


def select(layers: list, mask: torch.Tensor, rows: torch.Tensor):
    """Keep `rows` (an index tensor, repeats allowed) and drop columns no kept row uses."""
    mask = mask[rows]
    used = mask.any(0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    return [(k[rows, :, start:], v[rows, :, start:]) for k, v in layers], mask[:, start:]
