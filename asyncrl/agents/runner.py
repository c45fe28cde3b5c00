"""Running agent episodes: what an agent gets (`AgentContext`), the queue that decides which
episode runs when, and `AgentRunner`, which turns one task into one scored token record.

An agent is an async function `agent(task, ctx)` (or a class with an async `run(task, ctx)`,
or an `Environment` subclass) named in config as "module:name" or "path/file.py:name". It may
talk to the policy through `ctx.chat` / `ctx.complete`, or through any OpenAI client pointed at
`ctx.base_url` (`ctx.openai()` makes one); either way every token lands in the same record. It
returns its reward: a number, a list of per-turn rewards (summed), or None to have the task's
verifier score its last reply in the verifier process pool.

An agent that raises, hangs past `timeouts.episode` or returns NaN fails only its own episode
(recorded with the reason); one that returns what no reward can be (a string) stops the run; one
that runs into its turn or token limit is truncated and still trained on.
"""
from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from asyncrl.agents.chat import PolicySession, Renderer
from asyncrl.agents.env import Environment, env_agent
from asyncrl.agents.episode import Episode, EpisodeAborted, Limits
from asyncrl.agents.tools import Tool, ToolResult, find_tool
from asyncrl.config import ConfigError
from asyncrl.inference.client import InferenceUnavailable
from asyncrl.plugins import import_object, read_user_text
from asyncrl.policy.model import TINY_CHAT_TEMPLATE
from asyncrl.rewards.pool import VerifierError
from asyncrl.rewards.tasks import as_number
from asyncrl.run.role import ContractError, FatalError


def load_agent(path: str):
    """The agent callable `(task, ctx) -> reward` that config names."""
    obj = import_object(path, "agent.path")
    if inspect.isclass(obj) and issubclass(obj, Environment):
        return env_agent(obj)
    if inspect.isclass(obj):
        obj = obj().run
    if not inspect.iscoroutinefunction(obj):
        raise ConfigError(
            f"agent.path = {path!r} must name an async function (task, ctx), a class with an async "
            "run(task, ctx), or an asyncrl.agents.Environment subclass"
        )
    return obj


def chat_template(name: str | None) -> str | None:
    """agent.chat_template: None (the tokenizer's own), "tiny", or a jinja file's text."""
    if name is None:
        return None
    if name == "tiny":
        return TINY_CHAT_TEMPLATE
    if not Path(name).is_file():
        raise ConfigError(f'agent.chat_template = {name!r} is neither "tiny" nor a jinja file')
    return read_user_text(name, "agent.chat_template")


class EpisodeQueue:
    """At most `limit` episodes run at once. "queue": a finished episode's slot goes at once to the
    waiting episode of the oldest prompt (ROLL Flash's queue scheduling). "batch": episodes run
    in waves, and a new wave starts only when every episode of the last one has finished (the
    synchronous batching most frameworks do; kept to measure against)."""

    def __init__(self, limit: int, mode: str = "queue"):
        self.limit, self.mode = limit, mode
        self.running = 0
        self.wave_finished = 0  # batch mode: episodes of the current wave already done
        self.waiting: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()

    def _may_start(self) -> bool:
        return self.running < self.limit and (self.mode == "queue" or self.wave_finished == 0)

    @asynccontextmanager
    async def slot(self, priority: float):
        if self._may_start() and not self.waiting:
            self.running += 1
        else:
            future = asyncio.get_running_loop().create_future()
            heapq.heappush(self.waiting, (priority, next(self._order), future))
            try:
                await future  # the releasing episode counted this one in
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.running -= 1
        self.wave_finished += 1
        if self.running == 0:
            self.wave_finished = 0
        while self.waiting and self._may_start():
            _, _, future = heapq.heappop(self.waiting)
            if not future.cancelled():
                self.running += 1
                future.set_result(None)


@dataclass
class Outcome:
    """One finished episode: its record and reward, or why it cannot be trained on."""
    episode: Episode
    reward: float | None = None
    failure: str | None = None  # agent_error, episode_timeout, aborted, verifier_error
    error: str | None = None
    seconds: float = 0.0


class AgentContext:
    """What an agent gets besides its task: the policy, tools, rewards."""

    def __init__(self, runner: "AgentRunner", task: dict, session: PolicySession, episode_id: str,
                 base_url: str | None):
        self.runner, self.task, self.session = runner, task, session
        self.episode_id, self.base_url = episode_id, base_url
        self.episode = session.episode
        self.tokenizer = session.tokenizer
        self._openai = None

    @property
    def turn_rewards(self) -> list[float]:
        return self.episode.turn_rewards

    async def chat(self, messages: list, tools: list[dict] | None = None, max_tokens: int | None = None):
        """(assistant message dict, finish_reason): the policy's next turn, in process (no HTTP)."""
        return await self.session.chat(messages, tools, max_tokens)

    async def complete(self, prompt: str | list[int], max_tokens: int | None = None) -> str:
        return (await self.session.complete(prompt, max_tokens))["text"]

    def openai(self):
        """An `openai.AsyncOpenAI` client whose calls are this episode's (through the proxy)."""
        if self.base_url is None:
            raise RuntimeError("no proxy is serving this episode (AgentRunner was started without one)")
        if self._openai is None:
            import openai

            # no retries: a retried call after the server restarted would sample from the wrong weights
            self._openai = openai.AsyncOpenAI(base_url=self.base_url, api_key="asyncrl", max_retries=0,
                                              timeout=self.runner.cfg.timeouts.http,
                                              http_client=self.runner.http_client())
        return self._openai

    async def call_tool(self, tool: Tool, arguments: dict | str) -> ToolResult:
        return self._record(await tool.run(arguments, self.runner.cfg.timeouts.tool))

    def _record(self, result: ToolResult) -> ToolResult:
        self.episode.tool_calls.append(
            {"name": result.name, "seconds": round(result.seconds, 4), "error": result.error}
        )
        if result.error:
            self.runner.events.write(
                "tool_error", episode=self.episode_id, tool=result.name, error=result.error
            )
        return result

    async def call_tools(self, tool_calls: list, tools: list[Tool]) -> list[dict]:
        """Run the calls of one assistant message (concurrently); the tool messages that answer them."""
        async def one(call) -> dict:
            call = call.model_dump() if hasattr(call, "model_dump") else call
            name = call["function"]["name"]
            found = find_tool(tools, name)
            if found is None:
                error = f"no tool named {name!r}; tools: {', '.join(t.name for t in tools)}"
                result = self._record(ToolResult(name, f"error: {error}", error, 0.0))
            else:
                result = await self.call_tool(found, call["function"].get("arguments") or {})
            return {"role": "tool", "tool_call_id": call.get("id"), "content": result.text}
        return list(await asyncio.gather(*(one(c) for c in tool_calls)))

    def hint(self, text: str) -> None:
        """A hint from what came after the turn just played (a tool's reply, the user's answer): with a
        teacher (teacher.path), that turn is scored with the hint in the teacher's context, never the
        policy's (docs/distillation.md). The last hint given for a turn is the one used."""
        self.episode.hint(text)

    def reward(self, value: float) -> None:
        """Reward for the turn just played (the episode's reward is their sum)."""
        self.episode.turn_rewards.append(float(value))

    async def score(self, text: str) -> float:
        """The task's verifier on `text`, in the verifier process pool."""
        return await self.runner.verifiers.score(text, self.task, self.runner.cfg.timeouts.verifier)



class AgentRunner:
    def __init__(self, cfg, tokenizer, verifiers, events, images=None):
        """`images`: a vision-language policy's ImagePrompts (episodes whose messages show images)."""
        self.cfg, self.verifiers, self.events, self.images = cfg, verifiers, events, images
        self.agent_of = {tag: load_agent(path) for tag, path in cfg.agent_paths().items() if path}
        self.renderer = Renderer(tokenizer, chat_template(cfg.agent.chat_template))
        self.queue = EpisodeQueue(cfg.agent.max_concurrent_episodes, cfg.agent.scheduling)
        self.sessions: dict[str, PolicySession] = {}  # running episodes, by id (the proxy's routing table)
        self.proxy_url: str | None = None
        self.limits = Limits(cfg.agent.max_turns, cfg.agent.max_episode_tokens, cfg.rollout.max_tokens)
        self.stop_ids = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(cfg.agent.stop_tokens)
        self._http = None

    def agent_for(self, task: dict):
        """The agent that plays `task`; None: the task is a single completion."""
        return self.agent_of.get(task.get("task") if self.cfg.task.mix else None)

    def http_client(self):
        """One connection pool for every episode's OpenAI client (a client of its own costs ~10 ms of
        TLS setup)."""
        if self._http is None:
            import openai

            self._http = openai.DefaultAsyncHttpxClient(timeout=self.cfg.timeouts.http)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def episode(self, task: dict, name: str, client, priority: float, greedy: bool = False) -> Outcome:
        """Run one episode of `task` on the server behind `client` (all its turns: the server keeps its
        prefix); InferenceUnavailable if that server went away under it."""
        async with self.queue.slot(priority):
            return await self._run(task, f"{name}-{uuid.uuid4().hex[:8]}", client, greedy)

    async def _run(self, task: dict, episode_id: str, client, greedy: bool) -> Outcome:
        ro = self.cfg.rollout
        sampling = {"temperature": 0.0 if greedy else ro.temperature, "top_p": 1.0 if greedy else ro.top_p}
        episode = Episode(self.limits)
        session = PolicySession(
            episode, client, self.renderer, sampling, self.stop_ids, self.cfg.agent.tool_parser, self.images
        )
        base_url = f"{self.proxy_url}/episodes/{episode_id}/v1" if self.proxy_url else None
        ctx = AgentContext(self, task, session, episode_id, base_url)
        self.sessions[episode_id] = session
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(self.agent_for(task)(task, ctx), self.cfg.timeouts.episode)
        except FatalError:  # (a verifier's broken contract met through ctx.score): no episode can fix it
            raise
        except Exception as e:
            if episode.server_lost:
                raise InferenceUnavailable(f"episode {episode_id}: the inference server went away") from None
            if episode.truncated:  # the limit ended it: keep what it did, with the rewards it earned
                result = None
            else:
                return self._failed(episode_id, episode, e, time.monotonic() - start)
        finally:
            del self.sessions[episode_id]
        if episode.server_lost:  # the agent swallowed the error; its record is incomplete
            raise InferenceUnavailable(f"episode {episode_id}: the inference server went away")
        outcome = await self._reward(episode, result, ctx)
        outcome.seconds = time.monotonic() - start
        if outcome.failure:
            self.events.write(
                "episode_failed", episode=episode_id, reason=outcome.failure, error=outcome.error
            )
        return outcome

    def _failed(self, episode_id: str, episode: Episode, error: Exception, seconds: float) -> Outcome:
        if isinstance(error, asyncio.TimeoutError):
            reason, text = (
                "episode_timeout",
                f"the agent ran past timeouts.episode ({self.cfg.timeouts.episode:g}s)",
            )
        elif isinstance(error, EpisodeAborted):
            reason, text = "aborted", str(error)
        else:
            reason, text = "agent_error", f"{type(error).__name__}: {error}"
        self.events.write(
            "episode_failed", episode=episode_id, reason=reason, error=text, turns=episode.turns
        )
        return Outcome(episode, failure=reason, error=text, seconds=seconds)

    async def _reward(self, episode: Episode, result, ctx: AgentContext) -> Outcome:
        if episode.sampled_tokens == 0:
            return Outcome(episode, failure="agent_error", error="the agent never called the policy")
        result = reward_value(result, self.agent_for(ctx.task))
        if isinstance(result, list):
            episode.turn_rewards = result
            result = sum(result)
        elif result is None:
            if episode.turn_rewards or episode.truncated:
                result = sum(episode.turn_rewards)
            else:
                try:
                    result = await ctx.score(episode.final_text)
                except VerifierError as e:
                    return Outcome(episode, failure="verifier_error", error=str(e))
        if not math.isfinite(result):
            return Outcome(episode, failure="agent_error", error=f"reward {result!r} is not a finite number")
        return Outcome(episode, reward=float(result))


def reward_value(result, agent) -> float | list[float] | None:
    """What an agent returned, as a float, a list of floats (per-turn rewards) or None (the verifier
    scores); anything else is a bug that every episode would repeat: ContractError, which stops the
    run."""
    if result is None:
        return None
    if isinstance(result, (list, tuple)):
        values = [as_number(r) for r in result]
        if None not in values:
            return values
    elif (value := as_number(result)) is not None:
        return value
    name = getattr(agent, "__qualname__", repr(agent))
    raise ContractError(f"agent {name} returned {type(result).__name__} {result!r:.60}; an agent must "
                        "return a number, a list of numbers (per-turn rewards) or None (the verifier scores)")
