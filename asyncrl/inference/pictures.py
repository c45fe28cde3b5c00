"""The images of a completion request: hashes per prompt ("images"), their bytes only when asked for.

A request names each prompt's images by content hash. The server finds an image in its own cache,
then in the bytes the request carries ("image_data": {hash: base64}), then in the run's image store
(a replica beside the orchestrator shares the run directory); an image found nowhere is answered with
409 and the missing hashes, and the client sends the request again with their bytes. So an image
crosses the network once per remote replica, never once per sample.
"""
from __future__ import annotations

import base64
import binascii

from asyncrl.vision.images import BadImage, ImageStore, check, image_hash
from asyncrl.vision.inputs import Picture, Pictures


class MissingImages(Exception):
    def __init__(self, digests: list[str]):
        super().__init__(f"images not on this server: {', '.join(digests)}")
        self.digests = digests


def request_pictures(body: dict, prompts: list[list[int]], pictures: Pictures | None, store: ImageStore,
                     image_token: int | None) -> list[tuple[Picture, ...]] | None:
    """Each prompt's Pictures (None: a request without images); ValueError for a malformed or
    inconsistent request, MissingImages for hashes to send again with their bytes."""
    named = body.get("images")
    if named is None:
        return None
    if pictures is None:
        raise ValueError("the request has images, but this server's model is text-only")
    if not (isinstance(named, list) and len(named) == len(prompts)
            and all(isinstance(row, list) and all(isinstance(d, str) for d in row) for row in named)):
        raise ValueError("'images' must be a list, one per prompt, of lists of image hashes")
    given = _given(body.get("image_data") or {})
    found, missing = {}, []
    for digest in {d for row in named for d in row}:
        try:
            found[digest] = pictures.get(digest, lambda d=digest: given[d] if d in given else store.get(d))
        except BadImage:
            missing.append(digest)
    if missing:
        raise MissingImages(sorted(missing))
    out = [tuple(found[d] for d in row) for row in named]
    for k, (prompt, shown) in enumerate(zip(prompts, out)):
        widths = sum(pictures.tokens(p) for p in shown)
        if prompt.count(image_token) != widths:
            raise ValueError(f"prompt {k} has {prompt.count(image_token)} image pad tokens; its "
                             f"{len(shown)} image(s) take {widths}")
    return out


def _given(data) -> dict[str, bytes]:
    """The request's image bytes by hash, each checked to be the image its hash names."""
    if not isinstance(data, dict):
        raise ValueError("'image_data' must be an object of image hash -> base64 bytes")
    out = {}
    for digest, text in data.items():
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ValueError(f"image_data[{digest!r}] is not base64") from None
        if image_hash(raw) != digest:
            raise ValueError(f"image_data[{digest!r}] holds other bytes (hash {image_hash(raw)})")
        try:
            check(raw, f"image {digest}")
        except BadImage as e:
            raise ValueError(str(e)) from None
        out[digest] = raw
    return out
