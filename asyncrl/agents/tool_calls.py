"""Reading tool calls out of the text a policy wrote (the proxy's `tool_calls` field).

hermes:  <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>
         (Qwen, Hermes and most open chat templates render and expect this)
compact: calc(2*3) as the whole reply, for one-argument tools: the tiny models' format, short
         enough for a 1M-parameter policy to learn in a minute.

A call the parser cannot read stays in the message's content: the agent sees what the policy
wrote, and the policy is trained on it like any other reply.
"""
from __future__ import annotations

import json
import re
import uuid

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.DOTALL)


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_hermes(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    calls, kept = [], text
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        calls.append(_call(name, arguments if isinstance(arguments, dict) else {"input": arguments}))
        kept = kept.replace(match.group(0), "")
    return (kept.strip() if calls else text), calls


def parse_compact(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    match = _COMPACT.match(text)
    if not match:
        return text, []
    spec = next((t["function"] for t in tools if t.get("function", {}).get("name") == match.group(1)), None)
    params = list((spec or {}).get("parameters", {}).get("properties", {}))
    if spec is None or not params:
        return text, []
    return "", [_call(spec["name"], {params[0]: match.group(2)})]


PARSERS = {"hermes": parse_hermes, "compact": parse_compact}
