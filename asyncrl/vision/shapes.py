"""A generated visual task: two shapes on a white canvas, "Which colour is the largest shape?".

Drawn with Pillow at 84 x 84 pixels (9 image tokens for the tiny policy). The answer is one of four
colour words; the smaller shape always has another colour, so an answer that names a colour it sees
is not enough. The warm start's teacher names the smaller shape's colour in `slip` of its answers
(a consistent confusion, as the default task's teacher drops the carry), which RL has to unlearn.
Items are PNG bytes: their hash is part of the item's identity, so the held-out split is by picture.
"""
from __future__ import annotations

import io
import random

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
SIZE = 84
QUESTION = "Which colour is the largest shape?"


def _draw(rng: random.Random, colour: str, size: int, canvas) -> None:
    from PIL import ImageDraw

    x, y = rng.randrange(0, SIZE - size), rng.randrange(0, SIZE - size)
    box = (x, y, x + size, y + size)
    draw = ImageDraw.Draw(canvas)
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=COLOURS[colour])


def largest_colour(index: int, seed: int) -> dict:
    """Item `index` of the task (a task.name generator: (index, seed) -> item)."""
    from PIL import Image

    rng = random.Random(f"shapes-{seed}-{index}")
    large, small = rng.sample(sorted(COLOURS), 2)
    canvas = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    small_size = rng.randrange(10, 20)
    if rng.random() < 0.5:  # either may be drawn on top
        _draw(rng, large, rng.randrange(36, 52), canvas)
        _draw(rng, small, small_size, canvas)
    else:
        _draw(rng, small, small_size, canvas)
        _draw(rng, large, rng.randrange(36, 52), canvas)
    png = io.BytesIO()
    canvas.save(png, format="PNG")
    return {"question": QUESTION, "answer": large, "images": [png.getvalue()],
            "metadata": {"large": large, "small": small}}


def confused_teacher(entry: dict, rng: random.Random, slip: float = 0.6) -> str:
    """The warm start's answer: the smaller shape's colour in `slip` of the items."""
    return entry["metadata"]["small"] if rng.random() < slip else entry["answer"]


def names_colour(completion: str, entry: dict) -> float:
    """The task's verifier: 1 when the answer is the largest shape's colour word and nothing else."""
    return float(completion.strip().lower().rstrip(".") == entry["answer"])
