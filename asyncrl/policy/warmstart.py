"""Build the tiny default policy: a BPE tokenizer trained on the task's text, a ~1M-parameter Qwen3
built from its config, and a supervised warm start on demonstrations.

The demonstrations come from a teacher (warmstart.teacher) that is sometimes wrong in a
consistent way, so the policy's greedy answer is often wrong where its samples are often right:
the room RL has to climb. Held-out prompts are never shown (task.holdout).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from asyncrl.agents.chat import Renderer, conversation_segments, normalize
from asyncrl.agents.runner import chat_template
from asyncrl.config import Config, ConfigError
from asyncrl.config.sections import InferenceConfig
from asyncrl.cores import CoreMeter
from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.plugins import import_object
from asyncrl.policy.model import (
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    chatml_corpus,
    load_policy,
)
from asyncrl.rewards.tasks import (
    MAX_CHARS_PER_TOKEN,
    BadTaskRow,
    TaskSource,
    checked_prompt,
    eval_entries,
    load_tasks,
    prompt_text,
    servable_prompt,
)
from asyncrl.vision import inputs as vision
from asyncrl.vision.inputs import is_vision
from asyncrl.vision.prompts import ImagePrompts
from asyncrl.vision.tiny import tiny_vlm

CORPUS_ITEMS = 4000  # task items (or demonstrations) the BPE tokenizer is trained on
MAX_BAD_ROWS = 1000  # rows in a row the warm start cannot train on before it stops, naming the first


def _task_example(
    tasks: TaskSource, tokenizer, index: int, teacher, rng: random.Random, max_prompt: int, context: int,
    images=None
) -> tuple[list[int], list[int], tuple]:
    """(prompt + answer + eos ids, labels only on the answer and eos, the prompt's Pictures); BadTaskRow
    for a row RL would drop (servable_prompt), or one whose answer takes the example past the model's
    context. `images`: a vision-language policy's ImagePrompts."""
    entry, prompt = servable_prompt(tasks, index, tokenizer, max_prompt, images)
    answer = teacher(entry, rng) if teacher else entry["answer"]
    if len(answer) > MAX_CHARS_PER_TOKEN * context:
        raise BadTaskRow(f"{tasks.where(entry, index)}: the answer has {len(answer)} characters")
    answer = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    _check_fits(len(prompt) + len(answer), context, tasks.where(entry, index))
    shown = images.shown(entry["image_hashes"]) if entry.get("image_hashes") else ()
    return prompt + answer, [-100] * len(prompt) + answer, shown


def _check_fits(tokens: int, context: int, where: str) -> None:
    if tokens > context:
        raise BadTaskRow(f"{where}: the example has {tokens} tokens; the model's context holds {context}")


def _examples(make, log) -> Callable[[], tuple[list[int], list[int]]]:
    """Examples from `make`, skipping the rows it refuses (the first said once); one that refuses
    MAX_BAD_ROWS in a row stops the warm start with the first reason."""
    said = False

    def example() -> tuple[list[int], list[int]]:
        nonlocal said
        first = None
        for _ in range(MAX_BAD_ROWS):
            try:
                return make()
            except BadTaskRow as e:
                first = first or str(e)
                if not said:
                    log(f"warmstart: skipping rows RL would drop, e.g. {e}")
                    said = True
        raise ConfigError(f"warmstart: {MAX_BAD_ROWS} rows in a row cannot be trained on; the first: {first}")
    return example


def _demo_example(demos, renderer: Renderer, rng: random.Random, context: int, images=None
                  ) -> tuple[list[int], list[int], tuple]:
    """(a demonstration conversation's ids, labels only on the policy's turns, its Pictures). `images`: a
    vision-language policy's ImagePrompts, for conversations whose messages show images."""
    demo = demos(rng)
    messages = [normalize(m, images.marker()) for m in demo["messages"]] if images else demo["messages"]
    refs = [ref for m in messages for ref in m.get("images", ())]
    ids, labels, hashes = [], [], []
    for text, is_policy in conversation_segments(renderer, messages, demo.get("tools")):
        piece = renderer.encode(text)
        if not is_policy and refs:  # (the images it shows, widened; the policy's turns show none)
            piece, shown = images.widen(piece, refs[len(hashes):len(hashes) + piece.count(images.pad)])
            hashes += shown
        ids += piece
        labels += piece if is_policy else [-100] * len(piece)
    _check_fits(len(ids), context, "warmstart.demos: a conversation")
    return ids, labels, images.shown(hashes) if hashes else ()


def _sft_batch(examples: list[tuple], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels."""
    rows, labels, _ = zip(*examples)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    lab = torch.full((len(rows), width), -100)
    for k, (r, lb) in enumerate(zip(rows, labels)):
        ids[k, : len(r)] = torch.tensor(r)
        lab[k, : len(lb)] = torch.tensor(lb)
    return ids, lab


def greedy_accuracy(model, tokenizer, tasks: TaskSource, size: int, max_tokens: int = 8,
                    max_prompt_tokens: int = InferenceConfig().max_prompt_tokens, images=None) -> float:
    """Fraction of `size` held-out items (distinct prompts) solved (reward 1) by greedy decoding; the
    rows the run's evaluation leaves out (servable_prompt's check) are left out here too. `images`: a
    vision-language policy's ImagePrompts."""
    checked = []
    for entry in eval_entries(tasks, size):
        try:
            checked.append(checked_prompt(tasks, entry, tokenizer, max_prompt_tokens, images=images))
        except BadTaskRow:
            continue
    if not checked:
        return float("nan")
    entries, prompts = zip(*checked)
    shown = [images.shown(e.get("image_hashes", [])) for e in entries] if images else None
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    samples = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), shown)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    return sum(tasks.score(t, e) >= 1.0 for t, e in zip(texts, entries)) / len(entries)


def build_tokenizer(cfg: Config, tasks: TaskSource, demos):
    """The warm start's tokenizer: char, or BPE trained on the task's prompts and answers (or the demos)."""
    if cfg.warmstart.tokenizer == "char":
        return build_char_tokenizer()
    rng = random.Random(cfg.warmstart.seed)
    if demos:  # (a demo's images are not text: left out)
        texts = [json.dumps(demos(rng), default=lambda _: "") for _ in range(CORPUS_ITEMS)]
    else:
        texts = []
        for index in range(CORPUS_ITEMS):
            try:
                entry = tasks.item(index)
                limit = cfg.inference.max_prompt_tokens
                text = f"{prompt_text(tasks, entry, limit, index)} {entry['answer']}"
                if len(text) > 2 * MAX_CHARS_PER_TOKEN * limit:  # (an answer no example could hold)
                    continue
                texts.append(text)
            except BadTaskRow:
                continue
    return build_bpe_tokenizer(chatml_corpus(texts), cfg.warmstart.vocab_size)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, the peak until 70% of the steps, then linearly down to a tenth. A tiny model
    learns to add only after a plateau whose length depends on the seed (500 to 1200 steps at 1e-3
    here); an lr that decays from the start (cosine) kept some seeds on it, no warm-up (2e-3) all."""
    decay_from = 0.7 * steps
    tail = 1.0 if step < decay_from else 1.0 - 0.9 * (step - decay_from) / max(1.0, steps - decay_from)
    return min(1.0, (step + 1) / warmup) * tail


def recipe(cfg: Config) -> dict:
    """What a warm-started policy is a function of: the launcher rebuilds the default policy when it
    changes."""
    unset = {"base"} if cfg.warmstart.base is None else set()  # (older policies stay current)
    # demonstrations are rendered with the agents' chat template (a policy without demos never sees it)
    agent = {"agent": {"chat_template"}} if cfg.warmstart.demos and cfg.agent.chat_template else {}
    return cfg.model_dump(mode="json", include={
        "warmstart": set(type(cfg.warmstart).model_fields) - {"threads", "max_seconds"} - unset,
        "task": {"name", "params", "prompt_format", "chat", "holdout"}, **agent})


def recipe_hash(cfg: Config) -> str:
    """A short name for the recipe: the default policy's directory gives way to models/tiny-<it>."""
    return hashlib.sha256(json.dumps(recipe(cfg), sort_keys=True).encode()).hexdigest()[:12]


COMPLETE, CUT_SHORT, OTHER, MISSING = "complete", "cut short", "another recipe", "missing"


def build_state(cfg: Config, model_dir: str | Path) -> str:
    """Whether `model_dir` holds this config's recipe built to its end (COMPLETE), built but stopped early
    (CUT_SHORT: by warmstart.max_seconds), another recipe's policy, or nothing (MISSING). A build killed
    half way leaves nothing: it is written to a temporary directory and renamed into place when done."""
    try:
        built = json.loads((Path(model_dir) / "warmstart.json").read_text())
    except (OSError, ValueError):
        return MISSING if not Path(model_dir).exists() else OTHER
    if built.get("recipe") != recipe(cfg):
        return OTHER
    # (a policy from before "complete" was recorded: complete when it ran every step)
    return COMPLETE if built.get("complete", built.get("steps") == cfg.warmstart.steps) else CUT_SHORT



def _teacher(ws):
    """The demonstrations' answer function (entry, rng) -> str, or None for the task's own answers."""
    if not ws.teacher or ws.demos:
        return None
    function = import_object(ws.teacher, "warmstart.teacher")
    return lambda entry, rng: str(function(entry, rng, **ws.teacher_params))


WATCH_EVERY = 100  # steps between looks at the cores free (another process may have started or ended)


def warmstart(cfg: Config, out_dir: str | Path | None = None, log=print) -> dict:
    """Build the policy into `out_dir` (default model.path): written beside it under a temporary name and
    renamed into place once saved, so that no reader ever finds half of one."""
    final = Path(out_dir or cfg.model.path)
    out = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    try:
        summary = _build(cfg, out, log)
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    log(f"warmstart: {summary['steps']} steps, loss {summary['loss']:.3f}, greedy accuracy "
        f"{summary['greedy_accuracy']:.1%} -> {final}")
    return summary


def _build(cfg: Config, out: Path, log) -> dict:
    ws = cfg.warmstart
    meter = CoreMeter()
    torch.set_num_threads(ws.threads or meter.free())
    torch.manual_seed(ws.seed)
    rng = random.Random(ws.seed)
    # Supervised data comes from the warm start's own seed, apart from RL's (task.seed) and eval's
    # (task.eval_seed) streams, so reseeding an RL run reuses its policy instead of rebuilding it.
    train_tasks = load_tasks(cfg.task, seed=ws.seed + 7920)
    eval_tasks = load_tasks(cfg.task, held_out=True) or train_tasks
    demos = import_object(ws.demos, "warmstart.demos") if ws.demos else None
    teacher = _teacher(ws)
    if ws.base:
        try:
            model, tokenizer = load_policy(ws.base)
        except FileNotFoundError as e:
            local = Path(ws.base).exists()
            where = "" if local else " (no directory of that name here, so it was tried as a hub name)"
            raise FileNotFoundError(f"warmstart.base = {ws.base!r}{where}: {e}") from None
    elif ws.architecture == "qwen2_5_vl":
        tokenizer = build_tokenizer(cfg, train_tasks, demos)
        model, _ = tiny_vlm(tokenizer, ws, out)
    else:
        tokenizer = build_tokenizer(cfg, train_tasks, demos)
        model = build_tiny_model(
            tokenizer, ws.hidden_size, ws.layers, ws.heads, ws.seed, ws.architecture, ws.kv_heads,
            experts=ws.experts, experts_per_token=ws.experts_per_token,
        )
    architecture = model.config.model_type
    images = ImagePrompts(ws.base or out, model.config, tokenizer) if is_vision(model.config) else None
    n_params = sum(p.numel() for p in model.parameters())
    renderer = Renderer(tokenizer, chat_template(cfg.agent.chat_template))  # (as the run's episodes render)

    context = model.config.get_text_config().max_position_embeddings
    example = _examples(
        (lambda: _demo_example(demos, renderer, rng, context, images)) if demos else
        (lambda: _task_example(train_tasks, tokenizer, rng.randrange(10**9), teacher, rng,
                               cfg.inference.max_prompt_tokens, context, images)), log)

    source = ws.demos or cfg.task.name + (f" (teacher {ws.teacher} {ws.teacher_params})" if teacher else "")
    built = ws.base or f"{ws.tokenizer} tokenizer"
    log(f"warmstart: {n_params / 1e6:.2f}M-parameter {architecture}, {built} of {len(tokenizer)} tokens, "
        f"{ws.steps} steps of supervised training on {source}")
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, ws.steps, ws.warmup_steps))
    start, step, loss_value = time.monotonic(), 0, float("nan")
    model.train()
    while step < ws.steps and time.monotonic() - start < ws.max_seconds:
        examples = [example() for _ in range(ws.batch_size)]
        ids, labels = _sft_batch(examples, tokenizer.pad_token_id)
        mask = (ids != tokenizer.pad_token_id).long()
        shown = [e[2] for e in examples]
        fed = vision.inputs(model, ids, mask, shown) if any(shown) else {"input_ids": ids}
        loss = model(**fed, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        step, loss_value = step + 1, loss.item()
        if step % WATCH_EVERY == 0:
            if not ws.threads:
                torch.set_num_threads(meter.free())
            log(f"  step {step:5d}  loss {loss_value:.3f}  {time.monotonic() - start:5.0f}s  "
                f"{torch.get_num_threads()} thread(s)", end="\r")
    model.eval()
    if step < ws.steps:  # a slow or busy machine: the policy may not have learned what the recipe needs
        log(
            f"\nwarmstart: stopped at step {step} of {ws.steps} by "
            f"warmstart.max_seconds = {ws.max_seconds:.0f}; "
            "the policy may be undertrained (is another job using the cores?): it is recorded as cut short, "
            "and the next run that needs it builds it again"
        )
    # an agent task's accuracy needs its agent: the run's first evaluation measures it
    accuracy = (
        float("nan")
        if demos
        else greedy_accuracy(model, tokenizer, eval_tasks, cfg.task.eval_size or 200, cfg.rollout.max_tokens,
                             cfg.inference.max_prompt_tokens, images)
    )
    summary = {"params": n_params, "steps": step, "seconds": round(time.monotonic() - start, 1),
               "loss": round(loss_value, 4), "greedy_accuracy": accuracy, "task": source,
               "tokenizer": ws.base or ws.tokenizer, "vocab": len(tokenizer), "architecture": architecture,
               "complete": step >= ws.steps, "recipe": recipe(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    from asyncrl.config import load_config

    warmstart(load_config(overrides=sys.argv[1:]), log=lambda *a, **k: print(*a, **k, flush=True))
