"""A GGUF file (llama.cpp's format, the way many users hold a model) as a Hugging Face model directory.

transformers reads a GGUF file (dequantizing it) but will not save what it read ("quantized with gguf,
not serializable"), and every role would pay the ~30 s of reading it again. So the file is converted
once: the weights dequantized to float32 into a fresh model of the file's config, the tokenizer, chat
template, special tokens and generation config from the file's metadata, all written to a directory
named by the file's sha256 under the model cache (ASYNCRL_MODEL_CACHE, default ~/.cache/asyncrl/models).
The directory is built under a temporary name and renamed into place with its key written last, so a
conversion cut short is never taken for a finished one; a lock lets one process convert while the
others wait for its result.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from asyncrl.errors import ConfigError
from asyncrl.files import exclusive, sha256_of

KEY = "gguf.json"  # the converted directory's key: the file it came from, its sha256, FORMAT
FORMAT = 2  # 1 kept the file's quantization_config: transformers then took the float32 copy for quantized
CONVERT_SECONDS = 1800.0  # the longest a process waits for another's conversion


def cache_root() -> Path:
    return Path(os.environ.get("ASYNCRL_MODEL_CACHE", "~/.cache/asyncrl/models")).expanduser()


def gguf_file(path: str | Path, key: str = "model.path") -> Path | None:
    """The GGUF file `path` names: the file itself, or the one GGUF file of a directory that has no
    config.json; None for anything else (a model directory, a hub name)."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(f"{key} = {str(path)!r} holds {len(found)} GGUF files ({names}): name the one to "
                          "use")
    return found[0] if found else None


def model_dir(gguf: Path, log=print) -> Path:
    """The converted directory of `gguf`, converting it first if no process has."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"{gguf} is a GGUF file: reading it needs the gguf package (pip install gguf, or "
                          "asyncrl[gguf])")
    digest = sha256_of(gguf)
    out = cache_root() / f"{gguf.stem}-{digest[:16]}"
    if _converted(out, digest):
        return out
    what = f"the conversion of {gguf.name} into {out}"
    with exclusive(out.with_name(f".{out.name}.lock"), what, CONVERT_SECONDS, log):
        if not _converted(out, digest):  # (another process may have finished it while this one waited)
            _convert(gguf, digest, out, log)
    return out


def _converted(out: Path, digest: str) -> bool:
    try:
        key = json.loads((out / KEY).read_text())
        return key["sha256"] == digest and key.get("format") == FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert(gguf: Path, digest: str, out: Path, log) -> None:
    start = time.monotonic()
    log(f"model: converting {gguf} (GGUF) into {out}, once (dequantized to float32) ...")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model, tokenizer = _read(gguf)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / KEY).write_text(json.dumps({"file": str(gguf.resolve()), "sha256": digest, "format": FORMAT,
                                           "architecture": model.config.model_type,
                                           "parameters": sum(p.numel() for p in model.parameters())}))
        shutil.rmtree(out, ignore_errors=True)  # (a directory whose key did not match)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"model: {gguf.name} converted in {time.monotonic() - start:.0f}s")


def _read(gguf: Path):
    """(float32 model that can be saved, tokenizer) from the file; a ConfigError naming the architecture and
    quantization when transformers cannot read them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        read = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, TypeError) as e:
        arch, kinds = describe(gguf)
        why = " ".join(str(e).split())[:200]
        raise ConfigError(f"model.path = {str(gguf)!r}: transformers cannot read this GGUF file "
                          f"(architecture {arch}, tensors {kinds}): {why}") from None
    # a model built from the config holds no quantizer, so it saves; the weights are the file's, dequantized.
    # The config loses the file's quantization_config: with it, whatever loads the copy takes it for quantized
    # (TRL's trainer refuses to train it, save_pretrained refuses to save it)
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.generation_config = GenerationConfig.from_model_config(read.config)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def describe(gguf: Path) -> tuple[str, str]:
    """(architecture, tensor types) from the file's header, for a refusal that names them."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        arch = reader.fields["general.architecture"].contents()
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
        return str(arch), ", ".join(kinds)
    except Exception as e:  # (a file that is not GGUF at all)
        return "unreadable", f"none ({type(e).__name__}: the file may not be GGUF)"
