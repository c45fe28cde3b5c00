"""Resolving a user's "module:name" or "path/to/file.py:name" from config."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError


def import_object(path: str, what: str) -> Any:
    """The object `path` names; ConfigError naming the config key `what` if it cannot be found."""
    module, _, name = path.rpartition(":")
    try:
        if not module or not name:
            raise ValueError("expected 'module:name' or 'file.py:name'")
        if module.endswith(".py"):
            loaded = _load_file(Path(module).resolve())
            if not hasattr(loaded, name):
                raise AttributeError(f"{module} defines no {name!r}")
            return getattr(loaded, name)
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"{what} = {path!r} cannot be imported as 'module:name' or 'file.py:name': {e}"
        ) from None


def _load_file(file: Path):
    """The module of `file`: the one already imported from it (by any name), else load it once."""
    for loaded in list(sys.modules.values()):
        name = getattr(loaded, "__file__", None)
        if name and Path(name).resolve() == file:
            return loaded
    if not file.is_file():
        raise ImportError(f"no file {str(file)!r}")
    spec = importlib.util.spec_from_file_location(f"asyncrl_user_{file.stem}", file)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded
