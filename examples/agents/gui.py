"""A GUI-style environment (DART's setting, small): the agent sees a rendered screen and clicks.

Each screen is a 3 x 3 grid of buttons drawn with Pillow at 84 x 84 pixels (a button per 28-pixel
cell: one image token of the tiny vision-language policy each); one button is coloured, the others
grey. The policy acts through a tool call, `click(k)` with k the button's number (1-9, row by row), and
the tool's answer is the next screen: a new picture every turn, two screens an episode. Each screen
cleared is worth 0.5. The warm start's demonstrations click the coloured button on half of the screens
and a grey one otherwise; RL has to find that the coloured one pays.
"""
from __future__ import annotations

import io
import random

from asyncrl.agents import tool
from asyncrl.agents.tools import parse_arguments

SCREENS, GRID, CELL = 2, 3, 28
COLOURS = [(220, 30, 30), (30, 170, 50), (40, 60, 220), (235, 200, 20)]
ASK = "Click the coloured button."


def screen(target: int, colour: int) -> bytes:
    """The PNG of a grid whose button `target` (1-9) has colour `colour` and the rest are grey."""
    from PIL import Image, ImageDraw

    canvas = Image.new("RGB", (GRID * CELL, GRID * CELL), (250, 250, 250))
    draw = ImageDraw.Draw(canvas)
    for k in range(GRID * GRID):
        x, y = (k % GRID) * CELL, (k // GRID) * CELL
        fill = COLOURS[colour] if k + 1 == target else (150, 150, 150)
        draw.rectangle((x + 4, y + 4, x + CELL - 5, y + CELL - 5), fill=fill)
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()


def _shows(png: bytes, text: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": text}]


@tool(timeout=1.0)
def click(button: str) -> str:
    """Click the button with this number (1-9, row by row)."""
    return button  # (the agent below plays the click: the next screen is its answer)


def tasks(index: int, seed: int) -> dict:
    """Task generator (task.name): the coloured buttons and their colours of episode `index`."""
    rng = random.Random(seed * 1_000_003 + index)
    targets = [rng.randint(1, GRID * GRID) for _ in range(SCREENS)]
    colours = [rng.randrange(len(COLOURS)) for _ in range(SCREENS)]
    return {"question": ASK, "answer": " ".join(map(str, targets)),
            "metadata": {"targets": targets, "colours": colours}}


def _clicked(reply: dict) -> int | None:
    """The button the reply's first tool call clicks (its arguments are JSON, as OpenAI's are)."""
    calls = reply.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "click":
        return None
    button = str(parse_arguments(calls[0]["function"]["arguments"]).get("button", "")).strip()
    return int(button) if button.isdigit() else None


async def agent(task: dict, ctx) -> list[float]:
    """Screens in turn; each reply's click is scored and answered with the next screen."""
    meta = task["metadata"]
    messages = [{"role": "user", "content": _shows(screen(meta["targets"][0], meta["colours"][0]), ASK)}]
    for k, target in enumerate(meta["targets"]):
        reply, _ = await ctx.chat(messages, tools=[click.schema])
        messages.append(reply)
        hit = _clicked(reply) == target
        ctx.reward(1 / SCREENS if hit else 0.0)
        if k + 1 < SCREENS:
            nxt = screen(meta["targets"][k + 1], meta["colours"][k + 1])
            messages.append({"role": "tool", "content": _shows(nxt, "clicked" if hit else "missed")})
    return ctx.turn_rewards


def demos(rng: random.Random) -> dict:
    """One supervised episode: the coloured button clicked on half of the screens, a grey one otherwise."""
    meta = tasks(rng.randrange(10**9), 0)["metadata"]
    messages = [{"role": "user", "content": _shows(screen(meta["targets"][0], meta["colours"][0]), ASK)}]
    for k, target in enumerate(meta["targets"]):
        button = target if rng.random() < 0.5 else rng.choice([b for b in range(1, 10) if b != target])
        call = {"type": "function", "function": {"name": "click", "arguments": {"button": str(button)}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if k + 1 < SCREENS:
            nxt = screen(meta["targets"][k + 1], meta["colours"][k + 1])
            messages.append({"role": "tool", "content": _shows(nxt, "clicked" if button == target else "missed")})
    return {"messages": messages, "tools": [click.schema]}
