"""Async HTTP client for an inference server; every call has a deadline and a clear error."""
from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
import orjson


class InferenceError(RuntimeError):
    pass


class ImagesWanted(InferenceError):
    """The server has not seen these images (asyncrl/inference/pictures.py): send again with their bytes."""

    def __init__(self, digests: list[str]):
        super().__init__(f"the inference server asks for images {', '.join(map(str, digests))}")
        self.digests = digests


class InferenceUnavailable(InferenceError):
    """The server cannot be reached or dropped the connection: it may be restarting, retry after it is
    back."""


class InferenceTimeout(InferenceUnavailable):
    """The server did not answer in time: wedged or overloaded; the router takes it out of routing until
    it answers /health again (and the supervisor restarts one that stops beating)."""


RETRY_LATER = (429, 503)  # the server is busy or not ready: the request may succeed later


def _seconds(header: str | None) -> float | None:
    try:
        return min(max(float(header), 0.0), 30.0) if header else None
    except ValueError:  # (an HTTP date: back off by our own schedule)
        return None


class InferenceClient:
    def __init__(self, url: str, timeout: float, token: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}  # control/access.py
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "InferenceClient":
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
            headers=self.headers,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def _call(
        self, method: str, endpoint: str, what: str, timeout: float | None = None, **kwargs
    ) -> dict:
        """One request; "busy, retry later" answers (429, 503) are retried with backoff (the server's
        Retry-After if it gives one) until the deadline, anything else that is not 200 is an error."""
        total = deadline = timeout or self.timeout
        end, backoff = time.monotonic() + total, 0.25
        while True:
            status, body, retry_after = await self._request(method, endpoint, what, deadline, **kwargs)
            if status == 200:
                return body
            error = body.get("error") if isinstance(body, dict) else None
            if status == 409 and isinstance(error, dict) and isinstance(error.get("missing_images"), list):
                raise ImagesWanted(error["missing_images"])
            message = error.get("message", error) if isinstance(error, dict) else error or body
            wait = retry_after if retry_after is not None else backoff
            if status not in RETRY_LATER or time.monotonic() + wait > end:
                busy = f", busy for {total:.0f}s" if status in RETRY_LATER else ""
                raise InferenceError(f"inference server {self.url} refused {what} ({status}{busy}): "
                                     f"{message}")
            await asyncio.sleep(wait)
            deadline, backoff = max(end - time.monotonic(), 0.1), min(2 * backoff, 8.0)

    async def _request(self, method: str, endpoint: str, what: str, deadline: float, lines=None,
                       text: bool = False, **kwargs):
        """(status, body parsed as JSON or the raw text, Retry-After seconds or None). `lines`: a 200
        answer is a stream of JSON lines, each handed to `lines` as it arrives (the body is then {}).
        `text`: a 200 answer may be plain text (vLLM's adapter endpoints): {"text": ...}."""
        try:
            async with self._session.request(
                method, self.url + endpoint, timeout=aiohttp.ClientTimeout(total=deadline), **kwargs
            ) as resp:
                if resp.status == 200 and lines is not None:
                    async for line in resp.content:
                        lines(orjson.loads(line))
                    return 200, {}, None
                raw = await resp.read()
                try:  # (an empty answer is an empty object: vLLM's /health, /pause, /resume)
                    body = orjson.loads(raw) if raw.strip() else {}
                except orjson.JSONDecodeError:  # e.g. a proxy's HTML error page
                    body = raw[:200].decode(errors="replace")
                if resp.status == 200 and not isinstance(body, dict):
                    if text:
                        return 200, {"text": body}, None
                    raise InferenceError(f"inference server {self.url} answered {what} with {body!r:.120}")
                return resp.status, body, _seconds(resp.headers.get("Retry-After"))
        except asyncio.TimeoutError:
            raise InferenceTimeout(
                f"inference server {self.url} did not answer {what} within {deadline:.0f}s (timeouts.http)"
            ) from None
        except orjson.JSONDecodeError as e:
            raise InferenceError(
                f"inference server {self.url} streamed a line that is not JSON during {what}: {e}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:  # (gone mid-stream: payload)
            raise InferenceUnavailable(
                f"inference server {self.url} unreachable during {what}: {e}"
            ) from None
        except aiohttp.ClientError as e:
            raise InferenceError(f"inference server {self.url} unreachable during {what}: {e}") from None

    async def complete(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                       top_p: float = 1.0, stop_token_ids: list[int] | None = None,
                       cache_prefix: bool = False, images: list[list[str]] | None = None,
                       image_bytes=None) -> list[dict]:
        """`cache_prefix`: a later request will continue these sequences (an agent's turn): the server
        keeps their keys and values for it. `images`: each prompt's image hashes; `image_bytes(hash)`
        reads one, for a server that has not seen it."""
        body = {"prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stop_token_ids": stop_token_ids or [], "cache_prefix": cache_prefix}
        sent = await self._with_images(body, images, image_bytes, lambda: self._call(
            "POST", "/v1/completions", "a completion request", json=body))
        return sent["choices"]

    async def _with_images(self, body: dict, images, image_bytes, send):
        """send() with the prompts' image hashes in `body`; once more with the bytes of those the server
        asks for."""
        if not images or not any(images):
            return await send()
        body["images"] = images
        try:
            return await send()
        except ImagesWanted as e:
            if image_bytes is None:
                raise
            body["image_data"] = {d: base64.b64encode(image_bytes(d)).decode() for d in e.digests}
            return await send()

    async def complete_groups(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                              top_p: float, on_group, images: list[list[str]] | None = None,
                              image_bytes=None) -> None:
        """`complete` for many prompts in one request: `on_group(i, choices)` gets prompt i's n choices as
        soon as they are all done (the server streams them), whatever the other prompts' lengths."""
        body = {"prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stream_groups": True}
        what = f"a completion request for {len(prompts)} prompts"

        def group(line) -> None:
            if not (isinstance(line, dict) and isinstance(line.get("prompt_index"), int)
                    and isinstance(line.get("choices"), list)):
                raise InferenceError(f"inference server {self.url} streamed {line!r:.120} during {what}")
            on_group(line["prompt_index"], line["choices"])

        await self._with_images(body, images, image_bytes, lambda: self._call(
            "POST", "/v1/completions", what, json=body, lines=group))

    async def update_weights(self, body: dict, timeout: float) -> dict:
        """body: path, version, and optionally patch + base_version, hash, policy (see the server)."""
        return await self._call(
            "POST", "/update_weights", f"loading weights version {body['version']}", timeout, json=body
        )

    async def version(self, with_hash: bool = False) -> dict:
        return await self._call("GET", "/version" + ("?hash=1" if with_hash else ""), "a version query")

    def forget_version(self) -> None:
        """Nothing to forget: this server reports its version itself."""

    async def stats(self) -> dict:
        return await self._call("GET", "/stats", "a stats query")

    async def wait_healthy(self, deadline: float) -> None:
        start = time.monotonic()
        while True:
            try:
                await self._call("GET", "/health", "a health check", timeout=min(5.0, deadline))
                return
            except InferenceError as e:
                if time.monotonic() - start > deadline:
                    raise InferenceError(
                        f"inference server {self.url} not healthy after {deadline:.0f}s: {e}"
                    ) from None
                await asyncio.sleep(0.2)

