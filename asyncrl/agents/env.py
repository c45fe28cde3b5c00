"""Environments: a world that answers the policy turn by turn (in the spirit of Tinker's
`initial_observation()` / `step(action)`), run as an agent by `env_agent`.

    class Guess(Environment):
        max_turns = 4
        async def reset(self, task):  return "1-15"
        async def step(self, reply):   return Step("9-15")  or  Step(reward=1.0, done=True)

`reset` gives the first user message (or a list of messages, e.g. system + user); `step` gets
the policy's reply (an assistant message) and returns the next observation, a reward for the
turn and whether the episode is over. Tools listed in `tools` are offered to the policy; when
it calls them the tool results go back to it without a `step`. An environment object lives
for one episode; its class is instantiated per episode.
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncrl.agents.tools import Tool


@dataclass
class Step:
    observation: str | list[dict] | None = None
    reward: float = 0.0
    done: bool = False
    # hindsight distillation: what the teacher may know when it scores the turn just played (e.g. the
    # outcome the observation reveals); the policy never sees it (docs/distillation.md)
    hint: str | None = None


class Environment:
    tools: list[Tool] = []
    # environment turns (steps); the run's agent.max_turns still caps policy calls
    max_turns: int | None = None

    async def reset(self, task: dict) -> str | list[dict]:
        raise NotImplementedError

    async def step(self, reply: dict) -> Step:
        raise NotImplementedError


def _messages(observation: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)


def env_agent(env_class: type[Environment]):
    """An agent that plays `env_class` episodes: reset, then policy reply / step until done."""

    async def agent(task: dict, ctx) -> list[float]:
        env = env_class()
        schemas = [t.schema for t in env.tools] or None
        messages = _messages(await env.reset(task))
        steps = 0
        while True:
            reply, _ = await ctx.chat(messages, tools=schemas)
            messages.append(reply)
            if reply.get("tool_calls") and env.tools:
                messages += await ctx.call_tools(reply["tool_calls"], env.tools)
                continue
            step = await env.step(reply)
            steps += 1
            ctx.reward(step.reward)
            if step.hint is not None:
                ctx.hint(step.hint)
            if step.done or (env.max_turns is not None and steps >= env.max_turns):
                return ctx.turn_rewards
            messages += _messages(step.observation or "")

    agent.__name__ = f"env_agent({env_class.__name__})"
    return agent
