"""Build the default tiny policy: char tokenizer + ~1M-param Llama, warm-started by supervised training.

The supervised run is deliberately short (about a minute): the policy should solve some tasks
greedily but not most, so RL has room to climb.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from asyncrl.agents.chat import Renderer, conversation_segments
from asyncrl.config import Config
from asyncrl.imports import import_object
from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.model import build_char_tokenizer, build_tiny_model
from asyncrl.rewards.tasks import TaskSource, load_tasks


def _task_example(tasks: TaskSource, tokenizer, index: int) -> tuple[list[int], list[int]]:
    """(prompt + answer + eos ids, labels only on the answer and eos)."""
    entry = tasks.item(index)
    prompt = tokenizer(tasks.prompt(entry))["input_ids"]
    answer = tokenizer(entry["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def _demo_example(demos, renderer: Renderer, rng: random.Random) -> tuple[list[int], list[int]]:
    """(a demonstration conversation's ids, labels only on the policy's turns)."""
    demo = demos(rng)
    ids, labels = [], []
    for text, is_policy in conversation_segments(renderer, demo["messages"], demo.get("tools")):
        piece = renderer.encode(text)
        ids += piece
        labels += piece if is_policy else [-100] * len(piece)
    return ids, labels


def _sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels."""
    rows, labels = zip(*examples)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    lab = torch.full((len(rows), width), -100)
    for k, (r, lb) in enumerate(zip(rows, labels)):
        ids[k, : len(r)] = torch.tensor(r)
        lab[k, : len(lb)] = torch.tensor(lb)
    return ids, lab


def greedy_accuracy(model, tokenizer, tasks: TaskSource, size: int, max_tokens: int = 8) -> float:
    """Fraction of `size` held-out items answered right by greedy decoding."""
    if size == 0:
        return float("nan")
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    entries = [tasks.item(i) for i in range(size)]
    prompts = [tokenizer(tasks.prompt(e))["input_ids"] for e in entries]
    samples = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    return sum(tasks.score(t, e) for t, e in zip(texts, entries)) / size


def warmstart(cfg: Config, out_dir: str | Path | None = None, log=print) -> dict:
    ws = cfg.warmstart
    out = Path(out_dir or cfg.model.path)
    torch.set_num_threads(ws.threads)
    torch.manual_seed(ws.seed)
    rng = random.Random(ws.seed)
    # Supervised data comes from a seed of its own, apart from RL (task.seed) and eval (task.eval_seed).
    train_tasks = load_tasks(cfg.task, seed=cfg.task.seed + 7919)
    eval_tasks = load_tasks(cfg.task, held_out=True) or train_tasks
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, ws.hidden_size, ws.layers, ws.heads, ws.seed)
    n_params = sum(p.numel() for p in model.parameters())
    demos = import_object(ws.demos, "warmstart.demos") if ws.demos else None
    renderer = Renderer(tokenizer)

    def example() -> tuple[list[int], list[int]]:
        if demos:
            return _demo_example(demos, renderer, rng)
        return _task_example(train_tasks, tokenizer, rng.randrange(10**9))

    source = ws.demos or cfg.task.name
    log(f"warmstart: {n_params / 1e6:.2f}M-parameter Llama, {ws.steps} steps of supervised training on {source}")
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.01)
    start, step, loss_value = time.monotonic(), 0, float("nan")
    model.train()
    while step < ws.steps and time.monotonic() - start < ws.max_seconds:
        ids, labels = _sft_batch([example() for _ in range(ws.batch_size)], tokenizer.pad_token_id)
        mask = (ids != tokenizer.pad_token_id).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step, loss_value = step + 1, loss.item()
        if step % 100 == 0:
            log(f"  step {step:5d}  loss {loss_value:.3f}  {time.monotonic() - start:5.0f}s", end="\r")
    model.eval()
    # an agent task's accuracy needs its agent: the run's first evaluation measures it
    accuracy = float("nan") if demos else greedy_accuracy(model, tokenizer, eval_tasks, min(cfg.task.eval_size, 200) or 200,
                                                               cfg.rollout.max_tokens)
    summary = {"params": n_params, "steps": step, "seconds": round(time.monotonic() - start, 1),
               "loss": round(loss_value, 4), "greedy_accuracy": accuracy, "task": source}
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2))
    log(f"\nwarmstart: {step} steps, loss {loss_value:.3f}, greedy accuracy {accuracy:.1%} -> {out}")
    return summary


if __name__ == "__main__":
    from asyncrl.config import load_config

    warmstart(load_config(overrides=sys.argv[1:]), log=lambda *a, **k: print(*a, **k, flush=True))
