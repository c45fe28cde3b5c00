"""Agents, tools and environments the agent tests run (named by file path in their configs), and the
runner that plays them against a real inference server."""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from asyncrl.agents import Environment, Step, tool
from asyncrl.plugins import import_object

HELPERS = str(Path(__file__))

calc = import_object(str(Path(__file__).parents[1] / "examples/agents/calculator.py") + ":calc", "test")

CONVERSATIONS: dict[
    str, list
] = {}  # episode id -> the messages the agent sent last (for the tests to compare)
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


async def bpe_turns_agent(task: dict, ctx):
    """Three chat turns through the proxy: the question; a tool result and a user turn; a user turn."""
    client = ctx.openai()
    messages = [{"role": "user", "content": task["prompt"]}]
    returned = RETURNED_IDS.setdefault(ctx.episode_id, [])
    for turn in range(3):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[calc.schema], max_tokens=6
        )
        returned.append(response.choices[0].model_extra["token_ids"])
        messages.append(response.choices[0].message)
        if turn == 0:
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": "408"})
        messages.append({"role": "user", "content": f"turn {turn}"})
    return 1.0


@contextlib.asynccontextmanager
async def agent_runner(server, agent: str, **overrides):
    """An AgentRunner with its proxy, as the orchestrator runs it, for the agent `agent` of
    agents_for_tests."""
    from conftest import job_config
    from transformers import AutoTokenizer

    from asyncrl.agents.proxy import start_proxy
    from asyncrl.agents.runner import AgentRunner
    from asyncrl.inference.client import InferenceClient
    from asyncrl.observe.events import EventLog
    from asyncrl.rewards.pool import VerifierPool

    url, run_dir, model = server
    RETURNED_IDS.clear()  # episode ids repeat across runners; a test reads only its own runner's
    CONVERSATIONS.clear()
    settings = {
        "agent.path": f"{HELPERS}:{agent}",
        "agent.tool_parser": "compact",
        "agent.max_episode_tokens": 200,
        "inference.max_prompt_tokens": 256,
        "rollout.max_tokens": 16,
        **overrides,
    }
    cfg = job_config(run_dir.parent, model, **settings)
    verifiers = VerifierPool(cfg.task, 1)
    async with InferenceClient(url, 30) as client:
        runner = AgentRunner(cfg, AutoTokenizer.from_pretrained(model), verifiers,
                             EventLog(run_dir, "orchestrator"))
        runner.server = client  # the one server the tests' episodes run on (the orchestrator routes)
        proxy, runner.proxy_url = await start_proxy(runner.sessions, "policy")
        try:
            yield runner, cfg, run_dir
        finally:
            await runner.close()
            await proxy.cleanup()
            verifiers.close()


def sampled_spans(episode) -> list[list[int]]:
    spans, current = [], []
    for token, mask in zip(episode.tokens, episode.loss_mask):
        if mask:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


