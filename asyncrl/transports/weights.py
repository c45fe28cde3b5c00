"""The weights channel: versioned safetensors files in the run directory.

Version v is `weights/v{v:06d}.safetensors` (full fp32 state), optionally
`v{v:06d}.patch.safetensors` (the elements whose serving-dtype value changed since v−1), then
`v{v:06d}.json` (the trainer's step metrics and hashes). The json is written last, so its
presence means the version is complete. Version 0 is the initial model at `model.path`.

A version is written every step, so its cost is the run's: a new 4 MB file cost ~4.5 ms on this
machine's ext4 (allocating its blocks, and discarding them when it was pruned) against ~0.2 ms to
overwrite an existing one. Pruning therefore keeps the newest dropped file as a spare that the next
version is written over, under its temporary name; and the hash is xxh3-128 (integrity, not
secrecy: the run's token guards access), ~15x faster than sha256 over the same bytes.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from asyncrl.files import atomic_path, write_atomic
from asyncrl.rundir import RunDir, spare_beside


def _bytes(tensor: torch.Tensor):
    """The tensor's raw bytes, without a copy when it is already contiguous on the CPU."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over names, dtypes and raw bytes, in name order: equal iff the weights are bit-identical."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        h.update(name.encode())
        h.update(str(state[name].dtype).encode())
        h.update(_bytes(state[name]))
    return h.hexdigest()


# safetensors' names for the dtypes a policy's weights come in; any other goes through save_file
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_state(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`state` as a safetensors file at `path` (a temporary name: see atomic_path), written over the
    directory's spare file when there is one. The bytes are the format's: an 8-byte header length, the
    JSON header padded to 8 bytes, then each tensor's bytes, back to back in the header's order."""
    if any(t.dtype not in _DTYPES for t in state.values()):
        save_file(state, str(path))
        return
    header, offset = {}, 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        os.replace(spare_beside(path), path)  # (claimed by one writer: a rename is atomic)
        mode = "r+b"
    except FileNotFoundError:
        mode = "wb"
    with open(path, mode) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in state.values():
            f.write(_bytes(t))
        f.truncate()


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to publish: tied parameters only once (safetensors refuses shared storage)."""
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().cpu().contiguous()
    return state


def publish(run_dir: str | Path, version: int, state: dict[str, torch.Tensor], meta: dict) -> str:
    """Write version `version`; returns its hash."""
    with atomic_path(RunDir(run_dir).weights_file(version)) as tmp:
        write_state(tmp, state)
    digest = state_hash(state)
    write_atomic(RunDir(run_dir).marker(version), json.dumps({**meta, "version": version, "hash": digest}))
    return digest


def load_request(run_dir: str | Path, version: int, marker: dict | None = None, patch: bool = True) -> dict:
    """The /update_weights body for `version`: its file, its hash as served (the serving dtype's, when it
    differs from the trainer's) and, if one was published and `patch`, the sparse patch from version − 1."""
    marker = marker or read_marker(run_dir, version)
    body = {"path": str(RunDir(run_dir).weights_file(version)), "version": version,
            "hash": marker.get("serving_hash", marker["hash"])}
    if patch and RunDir(run_dir).patch(version).exists():
        body.update(patch=str(RunDir(run_dir).patch(version)), base_version=version - 1)
    return body


def read_marker(run_dir: str | Path, version: int) -> dict | None:
    path = RunDir(run_dir).marker(version)
    return json.loads(path.read_text()) if path.exists() else None


def load(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def prune(run_dir: str | Path, newest: int, keep: int) -> None:
    """Drop weight files older than the last `keep` versions (markers stay: they hold metrics); the
    newest full file dropped becomes the spare the next version is written over. (A reader still on it
    would read a mix of two versions, and its hash check would refuse them; a server is at most η + 1
    versions behind, and `keep` is more than that.)"""
    for version in range(max(1, newest - keep - 8), newest - keep + 1):
        path = RunDir(run_dir).weights_file(version)
        if version == newest - keep and path.exists():
            os.replace(path, spare_beside(path))
        else:
            path.unlink(missing_ok=True)
        RunDir(run_dir).patch(version).unlink(missing_ok=True)
        for links in (path.with_suffix(""), path.with_suffix(".lora")):  # vLLM's views of it (vllm_client.py)
            shutil.rmtree(links, ignore_errors=True)


# --- sparse patches (PULSE): only the elements whose serving-dtype value changed -------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so that equality is exact (nan, −0.0) and not numeric."""
    return t.contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype, copy=True).contiguous() for k, v in state.items()}  # never an alias


def make_patch(served: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[dict, int, int]:
    """(patch, changed elements, total elements): for each tensor the flat indices where `new`
    differs bitwise from `served` (same dtype) and the new values there."""
    patch, changed, total = {}, 0, 0
    for name, tensor in new.items():
        idx = (_bits(served[name]) != _bits(tensor)).flatten().nonzero().squeeze(1)
        total += tensor.numel()
        if idx.numel():
            # int32 indices where they fit: half the bytes of int64 (a bf16 patch is 6 bytes per element)
            patch[f"{name}::idx"] = idx.to(torch.int32) if tensor.numel() < 2**31 else idx
            patch[f"{name}::val"] = tensor.flatten()[idx]
            changed += idx.numel()
    return patch, changed, total


def apply_patch(state: dict[str, torch.Tensor], patch: dict[str, torch.Tensor]) -> None:
    """Write a patch into `state` in place (the tensors must be contiguous)."""
    for key, idx in patch.items():
        if key.endswith("::idx"):
            name = key[: -len("::idx")]
            target = state[name]
            values = patch[f"{name}::val"].to(target.device, target.dtype)
            target.view(-1)[idx.to(target.device).long()] = values


def save_patch(run_dir: str | Path, version: int, patch: dict[str, torch.Tensor]) -> Path:
    path = RunDir(run_dir).patch(version)
    with atomic_path(path) as tmp:
        save_file(patch, str(tmp))
    return path
