"""One episode's conversation with the policy, kept as exact tokens (the proxy's core).

A chat request carries the whole conversation every time. The first one is rendered with the
chat template and encoded. Each later one must repeat the conversation so far, including the
reply the policy gave: that part is not rendered or encoded again. Only what is new is added:
the rest of the template's rendering of the last reply (the end-of-turn glue after the sampled
tokens; all of it, end token included, if the reply was cut at its token budget) and the new
messages (tool results, user turns) up to the next generation prompt. These are found by
rendering the conversation with and without the new messages and taking the text between, so
any template works that renders a conversation as a prefix of its continuation.

A /v1/completions episode works the same way with text: each prompt must extend the previous
prompt plus the completion returned for it; the extension is encoded, the rest kept.
"""
from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.agents.episode import Episode, EpisodeAborted
from asyncrl.agents.tool_calls import PARSERS
from asyncrl.agents.tools import parse_arguments
from asyncrl.inference.client import InferenceUnavailable
from asyncrl.vision.images import BadImage


class ChatFormatError(ValueError):
    """The request cannot extend the episode's tokens without re-encoding what was sampled."""


def normalize(message: Any, image_marker: str | None = None) -> dict:
    """An OpenAI message (dict or the client's pydantic object) as the plain dict templates take. Its image
    parts ({"type": "image_url", ...}) become `image_marker` in the text (a vision-language policy's
    placeholder) and their URLs the message's "images"."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict) or "role" not in message:
        raise ChatFormatError(f"a message must be an object with a 'role', got {message!r:.80}")
    content, images = message.get("content") or "", []
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}, ...]
        pieces = []
        for part in (p for p in content if isinstance(p, dict)):
            if part.get("type") != "image_url":
                pieces.append(part.get("text", ""))
                continue
            if image_marker is None:
                raise ChatFormatError("a message shows an image, but the policy is a text-only model")
            url = part.get("image_url")
            images.append(url.get("url") if isinstance(url, dict) else url)
            pieces.append(image_marker)
        content = "".join(pieces)
    out = {"role": message["role"], "content": content, **({"images": images} if images else {})}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": parse_arguments(c["function"].get("arguments", {}))}}
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _same(a: dict, b: dict) -> bool:
    """Equal as conversation turns (tool-call ids and field order do not matter)."""
    def key(m):
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
        return m["role"], m["content"], calls, m.get("images")
    return key(a) == key(b)


class Renderer:
    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = template or tokenizer.chat_template
        if not self.template:
            raise ChatFormatError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
                                  "set agent.chat_template (\"tiny\" or a jinja file)")

    def text(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.template,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_segments(renderer: Renderer, messages: list[dict], tools: list[dict] | None = None):
    """[(text, is_policy_turn)] whose concatenation is the rendered conversation (supervised demos)."""
    segments, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = renderer.text(messages[:i], tools, True)
        turn = renderer.text(messages[: i + 1], tools, False)[len(prompt):]
        end = turn.rfind(renderer.tokenizer.eos_token)
        sampled = turn[: end + len(renderer.tokenizer.eos_token)] if end >= 0 else turn
        segments += [(prompt[len(done):], False), (sampled, True)]
        done = prompt + sampled
    full = renderer.text(messages, tools, False)
    return [s for s in segments + [(full[len(done):], False)] if s[0]]


class PolicySession:
    """Chat or completion calls of one episode, each appending exact tokens to `episode`."""

    def __init__(self, episode: Episode, client, renderer: Renderer, sampling: dict, stop_ids: list[int],
                 tool_parser: str = "hermes", images=None):
        """`images`: a vision-language policy's ImagePrompts (asyncrl/vision/prompts.py)."""
        self.episode, self.client, self.renderer, self.images = episode, client, renderer, images
        self.tokenizer = renderer.tokenizer
        self.sampling, self.stop_ids = sampling, stop_ids
        self.parse = PARSERS[tool_parser]
        self.history: list[dict] = []  # the conversation so far, ending with the policy's last reply
        self.text = ""                 # a completions episode: prompt + completion so far
        self.last_sampled: list[int] = []
        self.turn = asyncio.Lock()  # one call at a time: two at once would interleave their tokens

    # --- chat -------------------------------------------------------------------------------
    async def chat(self, messages: list, tools: list[dict] | None = None, max_tokens: int | None = None):
        """(assistant message, finish_reason) for the next turn of `messages`; a call made while another
        is running waits for it, then must extend the conversation that call left."""
        async with self.turn:
            return await self._chat(messages, tools, max_tokens)

    async def _chat(self, messages: list, tools: list[dict] | None, max_tokens: int | None):
        if self.text:
            raise ChatFormatError("this episode is a /v1/completions one; it cannot continue as a chat")
        marker = self.images.marker() if self.images else None
        messages = [normalize(m, marker) for m in messages]
        if not messages:
            raise ChatFormatError("'messages' is empty")
        new_ids = self._extension(messages, tools) if self.history else \
            self.renderer.encode(self.renderer.text(messages, tools, True))
        shown = [url for m in messages for url in m.get("images", ())][len(self.episode.images):]
        new_images: list[str] = []
        if shown:  # (the new messages' images: widened in the ids, stored, shown with every later turn)
            try:
                new_ids, new_images = self.images.widen(new_ids, shown)
            except BadImage as e:  # (the agent's request is wrong, as a malformed message is)
                raise ChatFormatError(str(e)) from None
        choice = await self._sample(new_ids, max_tokens, new_images)
        content = self.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        calls: list[dict] = []
        if tools:
            content, calls = self.parse(content, tools)
        reply = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = calls
        self.history = messages + [normalize(reply)]
        self.episode.final_text = content
        finish = "tool_calls" if calls else choice["finish_reason"]
        return reply, finish

    def _extension(self, messages: list[dict], tools) -> list[int]:
        """Token ids of what `messages` adds to the conversation already recorded."""
        known = len(self.history)
        for i, (old, new) in enumerate(zip(self.history, messages)):
            if not _same(old, new):
                raise ChatFormatError(
                    f"message {i} ({new['role']}) differs from the one this episode already holds; "
                    "an episode's "
                    "conversation may only grow (start a new episode to edit its history)"
                )
        if len(messages) < known:
            raise ChatFormatError(
                f"the request has {len(messages)} messages; this episode already holds {known}"
            )
        before_reply = self.renderer.text(self.history[:-1], tools, True)
        with_reply = self.renderer.text(self.history, tools, False)
        full = self.renderer.text(messages, tools, True)
        if not (with_reply.startswith(before_reply) and full.startswith(with_reply)):
            raise ChatFormatError(
                "the chat template renders the conversation so far differently once later "
                "messages follow it, so the new turn cannot be appended without re-encoding"
            )
        return self.renderer.encode(
            self._after_sampled(with_reply[len(before_reply) :]) + full[len(with_reply) :]
        )

    def _after_sampled(self, turn: str) -> str:
        """The template's text for the last reply that follows the tokens the policy sampled."""
        sampled = self.tokenizer.decode(self.last_sampled, skip_special_tokens=False)
        if turn.startswith(sampled):
            return turn[len(sampled):]
        ended = bool(self.last_sampled) and self.last_sampled[-1] in self.stop_ids
        for stop in dict.fromkeys(self.tokenizer.decode([t]) for t in self.stop_ids):
            at = turn.rfind(stop)
            if at >= 0:  # the reply was re-rendered (e.g. a tool call): keep what follows its end token
                return turn[at + len(stop):] if ended else turn[at:]
        return ""

    # --- completions ------------------------------------------------------------------------
    async def complete(self, prompt: str | list[int], max_tokens: int | None = None) -> dict:
        """The engine's choice for a prompt that extends this episode's text (or token ids); calls are
        taken in turn, as chat's are."""
        async with self.turn:
            return await self._complete(prompt, max_tokens)

    async def _complete(self, prompt: str | list[int], max_tokens: int | None) -> dict:
        if self.history:
            raise ChatFormatError("this episode is a chat; it cannot continue with /v1/completions")
        if isinstance(prompt, str):
            if not prompt.startswith(self.text):
                raise ChatFormatError(
                    f"the prompt must extend the episode so far (the previous prompt and its "
                    f"completion, {len(self.text)} characters); got {prompt[:60]!r}..."
                )
            new_ids = self.tokenizer(prompt[len(self.text) :], add_special_tokens=not self.episode.tokens)[
                "input_ids"
            ]
        else:
            if prompt[: len(self.episode.tokens)] != self.episode.tokens:
                raise ChatFormatError("the prompt's token ids must start with the episode's tokens so far")
            new_ids = prompt[len(self.episode.tokens):]
            prompt = self.tokenizer.decode(self.episode.tokens + new_ids, skip_special_tokens=True)
        choice = await self._sample(new_ids, max_tokens)
        choice["text"] = self.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        self.text = prompt + choice["text"]
        self.episode.final_text = choice["text"]
        return choice

    # --- the engine -------------------------------------------------------------------------
    async def _sample(self, new_ids: list[int], max_tokens: int | None, new_images: list[str] = ()) -> dict:
        """`new_images`: the hashes of the images `new_ids` shows (a vision-language policy's)."""
        episode = self.episode
        budget = episode.start_turn(max_tokens, len(new_ids))
        try:
            shown = episode.images + list(new_images)
            [choice] = await self.client.complete(
                [episode.tokens + new_ids],
                1,
                budget,
                self.sampling["temperature"],
                self.sampling["top_p"],
                self.stop_ids,
                cache_prefix=True,  # (the next turn continues this one)
                images=[shown] if shown else None,
                image_bytes=self.images.store.get if self.images else None,
            )
        except InferenceUnavailable:
            episode.server_lost = True
            raise
        if choice["finish_reason"] == "abort":
            raise EpisodeAborted("the inference server aborted this turn (a weight update)")
        episode.add_context(new_ids)  # only now: a failed call leaves the record as it was
        episode.images = shown
        episode.add_sampled(choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["versions"])
        episode.finish_reason = choice["finish_reason"]
        episode.routing = choice.get("routing")
        self.last_sampled = choice["token_ids"]
        return choice
