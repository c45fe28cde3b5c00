"""The orchestrator's OpenAI-compatible endpoint, one base URL per running episode:

    {proxy}/episodes/{episode_id}/v1/chat/completions   messages (+ tools) -> assistant message
    {proxy}/episodes/{episode_id}/v1/completions        prompt text or token ids -> completion
    {proxy}/episodes/{episode_id}/v1/models

so an unmodified program using the official `openai` client (base_url = ctx.base_url) can be
trained. The proxy renders nothing itself: each request goes to the episode's PolicySession,
which appends exact tokens to the episode's record and forwards token ids to the inference
server. Sampling parameters come from the run (the trainer's logprobs must match the sampler's),
so a request's temperature / top_p are ignored; max_tokens is honoured up to the run's limits.
"""
from __future__ import annotations

import time
import uuid

from aiohttp import web

from asyncrl.agents.chat import ChatFormatError
from asyncrl.agents.episode import EpisodeAborted, EpisodeLimit
from asyncrl.inference.client import InferenceError, InferenceUnavailable


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    """Whatever goes wrong in a call is the agent's to see, as an OpenAI-style error."""
    try:
        return await handler(request)
    except EpisodeLimit as e:
        return _error(400, str(e), "episode_limit")
    except (ChatFormatError, ValueError, KeyError, TypeError) as e:
        return _error(400, f"{type(e).__name__}: {e}" if not isinstance(e, ChatFormatError) else str(e))
    except EpisodeAborted as e:
        return _error(409, str(e), "aborted")
    except InferenceUnavailable as e:
        return _error(503, str(e), "inference_unavailable")
    except InferenceError as e:
        return _error(502, str(e), "inference_error")


def make_proxy(sessions: dict, model_name: str) -> web.Application:
    """`sessions`: episode id -> PolicySession, kept by the AgentRunner while each episode runs."""

    def session_of(request: web.Request):
        episode_id = request.match_info["episode"]
        session = sessions.get(episode_id)
        if session is None:
            raise ChatFormatError(
                f"episode {episode_id!r} is not running (it finished, failed or never started)"
            )
        return session

    async def body_of(request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise ChatFormatError(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ChatFormatError("the request body must be a JSON object")
        if body.get("n", 1) != 1 or body.get("stream"):
            raise ChatFormatError("an episode is one sequence: n must be 1 and stream false")
        return body

    def usage(session, completion: int) -> dict:
        total = len(session.episode.tokens)
        return {"prompt_tokens": total - completion, "completion_tokens": completion, "total_tokens": total}

    async def chat(request: web.Request) -> web.Response:
        session, body = session_of(request), await body_of(request)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ChatFormatError("'messages' must be a list of messages")
        reply, finish = await session.chat(messages, body.get("tools"),
                                           body.get("max_completion_tokens") or body.get("max_tokens"))
        sampled = session.last_sampled
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": reply,
                        "finish_reason": finish,
                        "logprobs": None,
                        "token_ids": sampled,
                    }
                ],
                "usage": usage(session, len(sampled)),
            }
        )

    async def completions(request: web.Request) -> web.Response:
        session, body = session_of(request), await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (
            isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
        ):
            raise ChatFormatError("'prompt' must be one string or one list of token ids")
        choice = await session.complete(prompt, body.get("max_tokens"))
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "text": choice["text"], "finish_reason": choice["finish_reason"],
                         "logprobs": {"token_logprobs": choice["logprobs"]["token_logprobs"]},
                         "token_ids": choice["token_ids"]}],
            "usage": usage(session, len(choice["token_ids"])),
        })

    async def models(request: web.Request) -> web.Response:
        session_of(request)
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model",
                                                              "created": 0, "owned_by": "asyncrl"}]})

    app = web.Application(middlewares=[_errors], client_max_size=16 * 2**20)
    base = "/episodes/{episode}/v1"
    app.add_routes([web.post(base + "/chat/completions", chat), web.post(base + "/completions", completions),
                    web.get(base + "/models", models)])
    return app


async def start_proxy(sessions: dict, model_name: str, host: str = "127.0.0.1") -> tuple[web.AppRunner, str]:
    """(runner to clean up, base URL) of a proxy on a free port."""
    runner = web.AppRunner(make_proxy(sessions, model_name), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://{host}:{port}"
