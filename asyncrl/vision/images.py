"""Images as a run keeps them: bytes named by their content hash, stored once per run.

A task row names its images (a file path, a data URI, raw bytes, or a PIL image a generator drew);
each becomes the bytes it was given, checked to decode and to be of a sane size, and is stored under
`images/<hash>` of the run directory. Samples, batches and requests carry the hash alone: the G
samples of a prompt, and every batch that trains on them, share one stored copy. An image is removed
when no batch still on disk, and no group still generating, uses it.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

from asyncrl.files import write_atomic
from asyncrl.rundir import RunDir

MAX_BYTES = 16 * 2**20  # an encoded image larger than this is refused, not decoded
MAX_PIXELS = 4096 * 4096  # nor one that would decode to more pixels (a decompression bomb)


class BadImage(ValueError):
    """An image that cannot be shown to the policy; the message says which and why."""


def image_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def image_bytes(ref, base: Path | None = None) -> bytes:
    """The bytes of one image reference: a path (relative to `base`, a JSONL file's folder), a
    `data:image/...;base64,` URI, bytes, or a PIL image (stored as PNG). Checked by `check`."""
    if isinstance(ref, (bytes, bytearray)):
        data = bytes(ref)
    elif hasattr(ref, "save"):  # a PIL image
        buffer = io.BytesIO()
        ref.save(buffer, format="PNG")
        data = buffer.getvalue()
    elif isinstance(ref, str) and ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if ";base64" not in header:
            raise BadImage(f"image data URI {ref[:40]!r}... is not base64")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise BadImage(f"image data URI {ref[:40]!r}... does not decode: {e}") from None
    elif isinstance(ref, str):
        path = Path(ref) if base is None or Path(ref).is_absolute() else base / ref
        if not path.is_file():
            raise BadImage(f"image file {str(path)!r} does not exist")
        if path.stat().st_size > MAX_BYTES:
            raise BadImage(f"image file {str(path)!r} has {path.stat().st_size} bytes; "
                           f"the limit is {MAX_BYTES}")
        data = path.read_bytes()
    else:
        raise BadImage("an image must be a file path, a data URI, bytes or a PIL image, "
                       f"got {type(ref).__name__}")
    named = f"image file {ref!r}" if isinstance(ref, str) and not ref.startswith("data:") else \
        "an image data URI" if isinstance(ref, str) else "image bytes"
    check(data, named)
    return data


def check(data: bytes, name: str = "the image") -> None:
    """BadImage unless `data` decodes to an image of at most MAX_PIXELS, within MAX_BYTES."""
    from PIL import Image

    if len(data) > MAX_BYTES:
        raise BadImage(f"{name} has {len(data)} bytes; the limit is {MAX_BYTES}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise BadImage(f"{name} is {width}x{height} pixels; the limit is {MAX_PIXELS} pixels")
            image.verify()
    except BadImage:
        raise
    except Exception as e:  # PIL raises many kinds for a file that is not an image
        raise BadImage(f"{name} does not decode as an image: {type(e).__name__}: {e}") from None


def decode(data: bytes):
    """The image as RGB (what a vision tower sees)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageStore:
    """A run's images by content hash (RunDir.images); writes are atomic, and storing twice is free.
    Without a run directory (the warm start's) it keeps them in memory."""

    def __init__(self, run_dir: str | Path | None):
        self.run = RunDir(run_dir) if run_dir is not None else None
        self.known: set[str] = set()  # stored by this process (a stat saved per prompt)
        self.memory: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        digest = image_hash(data)
        if self.run is None:
            self.memory[digest] = data
        elif digest not in self.known:
            if not self.run.image(digest).exists():
                write_atomic(self.run.image(digest), data)
            self.known.add(digest)
        return digest

    def get(self, digest: str) -> bytes:
        if self.run is None:
            if digest not in self.memory:
                raise BadImage(f"image {digest} was never stored")
            return self.memory[digest]
        path = self.run.image(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BadImage(f"image {digest} is not in the run's image store ({path})") from None
        if image_hash(data) != digest:
            raise BadImage(f"image {digest} in the run's image store does not match its hash ({path})")
        return data

    def prune(self, unused: set[str]) -> int:
        """Remove these images (none that a batch on disk or a generating group still uses: the
        caller's check); how many were there."""
        removed = 0
        for digest in unused:
            self.known.discard(digest)
            if self.run.image(digest).exists():
                self.run.image(digest).unlink(missing_ok=True)
                removed += 1
        return removed


def prune_unused(store: ImageStore, in_use: set[str]) -> int:
    """Remove the stored images that no batch file still on disk shows and that are not `in_use` (shown
    by a group generating or waiting for a batch, or by the held-out set); how many were removed."""
    from asyncrl.trajectory import read_batch

    if not store.run.images.is_dir():
        return 0
    used = set(in_use)
    for _, path in store.run.batch_files():
        used.update(h for t in read_batch(path) for h in t.images or ())
    return store.prune({p.name for p in store.run.images.iterdir() if not p.name.startswith(".")} - used)
