"""Tools an agent offers the policy: a function plus the JSON schema the chat template shows.

    @tool(timeout=2.0)
    def calc(expression: str) -> str:
        "Evaluate an arithmetic expression."
        ...

`calc.schema` is the OpenAI `tools=[...]` entry built from the signature and docstring;
`await calc.run(arguments)` validates the arguments, runs the function with a deadline (a plain
function in a thread, so a slow tool never blocks the event loop and generation for other
episodes goes on) and always returns text: the result, or "error: ..." that the agent can hand
back to the policy. A tool failure is the policy's problem to handle, not the run's.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from asyncrl.run.role import ContractError

# Threads for plain-function tools, apart from the event loop's default executor (which also starts
# verifier workers): a tool thread abandoned at its deadline holds one of these, not one of those.
_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tool")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ToolResult:
    name: str
    text: str            # what the policy sees
    error: str | None    # None when the call succeeded
    seconds: float


class Tool:
    def __init__(self, fn: Callable, timeout: float | None, name: str | None = None):
        self.fn, self.timeout = fn, timeout
        self.name = name or fn.__name__
        self.signature = inspect.signature(fn)
        self.schema = {"type": "function", "function": {
            "name": self.name,
            "description": inspect.getdoc(fn) or "",
            "parameters": self._parameters(),
        }}

    def _parameters(self) -> dict:
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception:  # an annotation that does not resolve: describe it as a string
            hints = {}
        properties, required = {}, []
        for name, p in self.signature.parameters.items():
            hint = hints.get(name, str)
            properties[name] = {"type": _JSON_TYPES.get(typing.get_origin(hint) or hint, "string")}
            if p.default is inspect.Parameter.empty:
                required.append(name)
        return {"type": "object", "properties": properties, "required": required}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def bind(self, arguments: dict | str) -> dict:
        """Arguments as a dict; ValueError naming what is wrong (the policy wrote the call)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments are not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            self.signature.bind(**arguments)
        except TypeError as e:
            raise ValueError(str(e)) from None
        return arguments

    async def run(self, arguments: dict | str, timeout: float | None = None) -> ToolResult:
        deadline = self.timeout if self.timeout is not None else timeout
        start = time.monotonic()
        try:
            kwargs = self.bind(arguments)
            if inspect.iscoroutinefunction(self.fn):
                value = await asyncio.wait_for(self.fn(**kwargs), deadline)
            else:  # a thread that overruns is abandoned (it cannot be killed); its result is ignored
                call = functools.partial(self.fn, **kwargs)
                value = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_THREADS, call),
                                               deadline)
        except asyncio.TimeoutError:
            error = f"tool {self.name!r} timed out after {deadline:g}s"
        except Exception as e:
            error = f"tool {self.name!r} failed: {type(e).__name__}: {e}"
        else:
            return ToolResult(self.name, self._text(value), None, time.monotonic() - start)
        return ToolResult(self.name, f"error: {error}", error, time.monotonic() - start)

    def _text(self, value) -> str:
        """What the policy reads; a value no text can stand for breaks the tool's contract (every call
        would), which stops the run: ContractError."""
        if isinstance(value, str):
            return value
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            raise ContractError(f"tool {self.name!r} returned {type(value).__name__} {value!r:.60}; a tool "
                                "must return a string or a JSON-serializable value") from None


def tool(fn: Callable | None = None, *, timeout: float | None = None, name: str | None = None):
    """Declare a tool; `timeout` (seconds) overrides the run's `timeouts.tool`."""
    if fn is None:
        return lambda f: Tool(f, timeout, name)
    return Tool(fn, timeout, name)


def find_tool(tools: list[Tool], name: str) -> Tool | None:
    return next((t for t in tools if t.name == name), None)


def parse_arguments(arguments: Any) -> Any:
    """OpenAI sends arguments as a JSON string; chat templates want the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
