"""A GUI-style environment (DART's setting, small): the agent fills a form it sees on a rendered screen.

Each screen is a form drawn with Pillow at 84 x 84 pixels: a colour swatch above an empty text field. The
policy acts through a tool call, `type(text)`, writing the swatch's colour name into the field; the tool's
answer is the next screen (the form's next field, another swatch): a new picture every turn, two screens an
episode, each field typed right worth 0.5. The warm start's demonstrations type the right colour on 35% of
the screens and one of the three others otherwise, so a sampled episode starts out with about one field in
three right: RL has to find which colour word pays for which swatch.
"""
from __future__ import annotations

import io
import random

from asyncrl.agents import tool
from asyncrl.agents.tools import parse_arguments

SCREENS, SIZE = 2, 84
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
RIGHT = 0.35  # the demonstrations' share of right answers
ASK = "Type the colour of the swatch."


def screen(colour: str, field: int) -> bytes:
    """The PNG of form field `field`: a window frame, the swatch, an empty text box under it."""
    from PIL import Image, ImageDraw

    canvas = Image.new("RGB", (SIZE, SIZE), (235, 235, 235))
    draw = ImageDraw.Draw(canvas)
    draw.rectangle((0, 0, SIZE - 1, 9), fill=(60, 60, 90))  # the title bar
    draw.rectangle((4 + 6 * field, 2, 8 + 6 * field, 6), fill=(200, 200, 200))  # which field: a tab
    draw.rectangle((14, 16, SIZE - 15, 52), fill=COLOURS[colour])
    draw.rectangle((10, 60, SIZE - 11, 76), fill=(255, 255, 255), outline=(90, 90, 90))
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()


def _shows(png: bytes, text: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": text}]


@tool(timeout=1.0)
def type(text: str) -> str:  # noqa: A001 (the action's name, as a GUI agent's)
    """Type text into the form's field."""
    return text  # (the agent below plays the action: the next screen is its answer)


def tasks(index: int, seed: int) -> dict:
    """Task generator (task.name): the swatches of episode `index`."""
    rng = random.Random(seed * 1_000_003 + index)
    colours = [rng.choice(sorted(COLOURS)) for _ in range(SCREENS)]
    return {"question": ASK, "answer": " ".join(colours), "metadata": {"colours": colours}}


def typed(reply: dict) -> str | None:
    """The text the reply's first tool call types (its arguments are JSON, as OpenAI's are)."""
    calls = reply.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "type":
        return None
    return str(parse_arguments(calls[0]["function"]["arguments"]).get("text", "")).strip().lower()


async def agent(task: dict, ctx) -> list[float]:
    """The form's screens in turn; each reply's typing is scored and answered with the next screen."""
    colours = task["metadata"]["colours"]
    messages = [{"role": "user", "content": _shows(screen(colours[0], 0), ASK)}]
    for k, colour in enumerate(colours):
        reply, _ = await ctx.chat(messages, tools=[type.schema])
        messages.append(reply)
        right = typed(reply) == colour
        ctx.reward(1 / SCREENS if right else 0.0)
        if k + 1 < SCREENS:
            answer = "accepted" if right else "rejected"
            messages.append({"role": "tool", "content": _shows(screen(colours[k + 1], k + 1), answer)})
    return ctx.turn_rewards


def demos(rng: random.Random) -> dict:
    """One supervised episode: the right colour typed on RIGHT of the screens, another one otherwise."""
    colours = tasks(rng.randrange(10**9), 0)["metadata"]["colours"]
    messages = [{"role": "user", "content": _shows(screen(colours[0], 0), ASK)}]
    for k, colour in enumerate(colours):
        text = colour if rng.random() < RIGHT else rng.choice([c for c in sorted(COLOURS) if c != colour])
        call = {"type": "function", "function": {"name": "type", "arguments": {"text": text}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if k + 1 < SCREENS:
            answer = "accepted" if text == colour else "rejected"
            messages.append({"role": "tool", "content": _shows(screen(colours[k + 1], k + 1), answer)})
    return {"messages": messages, "tools": [type.schema]}
