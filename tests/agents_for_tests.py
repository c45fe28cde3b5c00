"""Agents, tools and environments the agent tests run (named by file path in their configs)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.agents import Environment, Step, tool
from asyncrl.imports import import_object

calc = import_object(str(Path(__file__).parents[1] / "examples/agents/calculator.py") + ":calc", "test")

CONVERSATIONS: dict[str, list] = {}  # episode id -> the messages the agent sent last (for the tests to compare)
RETURNED_IDS: dict[str, list[list[int]]] = {}  # episode id -> token ids each proxy response reported


@tool(timeout=1.0)
def add(expression: str) -> str:
    """Add integers: "2+3"."""
    return str(sum(int(x) for x in expression.split("+")))


@tool
def broken(expression: str) -> str:
    """Always raises."""
    raise RuntimeError("the tool broke")


@tool(timeout=0.2)
def slow(expression: str) -> str:
    """Sleeps past its timeout."""
    time.sleep(1.0)
    return "too late"


async def openai_agent(task: dict, ctx):
    """Three turns through the official openai client: question, tool results, a user follow-up."""
    client = ctx.openai()
    tools = [calc]
    messages = [{"role": "user", "content": task["prompt"]}]
    returned = RETURNED_IDS.setdefault(ctx.episode_id, [])
    for turn in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages,
                                                        tools=[t.schema for t in tools], max_tokens=14)
        returned.append(response.choices[0].model_extra["token_ids"])
        message = response.choices[0].message
        messages.append(message)
        if message.tool_calls:
            messages += await ctx.call_tools(message.tool_calls, tools)
        else:
            messages.append({"role": "user", "content": f"turn {turn}"})
    CONVERSATIONS[ctx.episode_id] = messages
    return 1.0 if message.content else 0.5


async def tool_error_agent(task: dict, ctx):
    """Calls the broken and the slow tool, hands the errors to the policy, goes on."""
    calls = [{"id": "a", "function": {"name": "broken", "arguments": '{"expression": "1"}'}},
             {"id": "b", "function": {"name": "slow", "arguments": '{"expression": "1"}'}},
             {"id": "c", "function": {"name": "missing", "arguments": "{}"}}]
    messages = [{"role": "user", "content": task["prompt"]}]
    reply, _ = await ctx.chat(messages, max_tokens=4)
    messages.append(reply)
    messages += await ctx.call_tools(calls, [add, broken, slow])
    reply, _ = await ctx.chat(messages, max_tokens=4)
    CONVERSATIONS[ctx.episode_id] = messages
    return 0.25


async def flaky_agent(task: dict, ctx):
    """Episode 1 of each group raises, episode 2 hangs, episode 3 loops until its turn limit."""
    k = int(ctx.episode_id.split("-")[1])
    messages = [{"role": "user", "content": task["prompt"]}]
    reply, _ = await ctx.chat(messages)
    if k == 1:
        raise ValueError("agent bug")
    if k == 2:
        await asyncio.sleep(3600)
    if k == 3:
        while True:
            messages += [reply, {"role": "user", "content": "more"}]
            reply, _ = await ctx.chat(messages)
    return None  # the verifier scores the last reply


async def completions_agent(task: dict, ctx):
    """Two /v1/completions calls, the second extending the first's prompt and completion."""
    client = ctx.openai()
    first = await client.completions.create(model="policy", prompt=task["prompt"], max_tokens=4)
    text = task["prompt"] + first.choices[0].text + "\n" + task["prompt"]
    second = await client.completions.create(model="policy", prompt=text, max_tokens=4)
    return float(second.choices[0].text.strip() == task["answer"])


class Countdown(Environment):
    """Three steps; each reply earns 0.1, the last one ends the episode."""
    max_turns = 3

    async def reset(self, task: dict) -> str:
        self.left = 3
        return task["prompt"]

    async def step(self, reply: dict) -> Step:
        self.left -= 1
        return Step(observation=f"{self.left} left", reward=0.1, done=self.left == 0)
