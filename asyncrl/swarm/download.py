"""A worker's fetch of one of the run's files: by the sha256 of its bytes, into `<name>.part` first, resumed
with an HTTP Range from where a broken transfer stopped, checked against its hash before it takes its
name, and (for a test or a metered link) held to a byte rate."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp

from asyncrl.files import sha256_of

ATTEMPTS = 6
CHUNK = 1 << 16


class DownloadError(RuntimeError):
    pass


async def fetch(session: aiohttp.ClientSession, url: str, digest: str, size: int, dest: Path,
                rate: float | None = None) -> Path:
    """`dest` holding the blob `digest` (`size` bytes) from `url`. `rate`: bytes per second at most."""
    if dest.exists() and dest.stat().st_size == size and await asyncio.to_thread(sha256_of, dest) == digest:
        return dest
    part = dest.with_name(dest.name + ".part")
    error = None
    for attempt in range(ATTEMPTS):
        have = part.stat().st_size if part.exists() else 0
        if have >= size:
            break
        try:
            await _transfer(session, url, part, have, rate)
        except (aiohttp.ClientError, asyncio.TimeoutError, DownloadError) as e:
            error = e
            await asyncio.sleep(min(0.5 * 2 ** attempt, 8.0))
    if not part.exists() or part.stat().st_size != size:
        raise DownloadError(f"fetching {url}: {part.stat().st_size if part.exists() else 0} of {size} bytes "
                            f"after {ATTEMPTS} attempts: {error}")
    if await asyncio.to_thread(sha256_of, part) != digest:
        part.unlink()
        raise DownloadError(f"fetching {url}: the bytes do not hash to {digest[:16]}… (discarded)")
    os.replace(part, dest)
    return dest


async def _transfer(session, url: str, part: Path, have: int, rate: float | None) -> None:
    headers = {"Range": f"bytes={have}-"} if have else {}
    async with session.get(url, headers=headers) as resp:
        if resp.status not in (200, 206):
            raise DownloadError(f"{url} answered {resp.status}: {(await resp.text())[:200]}")
        mode = "ab" if resp.status == 206 else "wb"  # (200: the server sent it all)
        start, sent = time.monotonic(), 0
        with open(part, mode) as f:
            async for chunk in resp.content.iter_chunked(CHUNK):
                f.write(chunk)
                sent += len(chunk)
                if rate:  # (ahead of the rate: wait until it is caught up)
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        f.flush()
                        await asyncio.sleep(ahead)
