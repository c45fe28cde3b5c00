"""Decode and training rates on a real pretrained model (SmolLM2-135M-Instruct), against the plain HF paths
and this machine's bound.

Decode: the built-in engine and HF `generate` (sampled, every row to the same length) at 32 and 128 rows, one
and two threads, prompts of the real-model recipe's task as chat turns; vLLM-CPU too with --vllm-python. The
bound: a decode step reads every weight once and does 2 FLOPs per weight per row, so it takes at least
max(weight bytes / read bandwidth, FLOPs / the model's own matrix products' measured FLOP/s with weights
beyond the caches); tokens/s at the bound = rows / that. Training: the trainer's step (chunked output
layer, length buckets, shared prompts: asyncrl/trainer/step.py) against a plain HF forward + backward of the
same rows.

    python benchmarks/engine_real.py [--vllm-python PY]
Writes benchmarks/results/engine_real.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine import hf_generate, vllm_rate  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.inference.engine import Engine, SamplingParams, Sequence  # noqa: E402
from asyncrl.policy.model import load_policy  # noqa: E402
from asyncrl.rewards.tasks import load_tasks  # noqa: E402
from asyncrl.run.preflight import resolve_models  # noqa: E402

OUT = ROOT / "benchmarks/results"
RECIPE = ROOT / "examples/real/smollm2_sums.toml"
TOKENS = 48  # new tokens per row (the recipe's answers: median ~60)


def prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    tasks = load_tasks(cfg.task)
    return [tasks.prompt_ids(tasks.item(i), tokenizer) for i in range(n)]


def engine_rate(model, tokenizer, ps: list[list[int]]) -> float:
    """Decode tokens/s of the engine, prefills excluded (they are timed in `prefill_fit`)."""
    engine = Engine(model, tokenizer.pad_token_id, eos_token_id=None, seed=0)
    engine.add([Sequence(p, SamplingParams(max_tokens=TOKENS, temperature=1.0)) for p in ps])
    engine.step()  # (admission: the prefill)
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return len(ps) * steps / (time.perf_counter() - start)


def bound(model, rows: int, threads: int) -> dict:
    """Tokens/s at the machine's bound for one decode step of `rows` rows."""
    torch.set_num_threads(threads)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    flops = 2 * rows * sum(w.numel() for w in weights)
    x = torch.randn(64 * 2**20)
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    bandwidth = 3 * x.numel() * 4 / (time.perf_counter() - start)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for w in weights[:8]:
        torch.nn.functional.linear(inputs[w.shape[1]], w)  # (warm-up)
    start = time.perf_counter()
    for w in weights:  # every weight once, as a decode step reads them: from memory, not the caches
        torch.nn.functional.linear(inputs[w.shape[1]], w)
    matmul = time.perf_counter() - start
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    seconds = max(weight_bytes / bandwidth, matmul)
    return {"tokens_per_s": rows / seconds, "gflops_per_s": flops / matmul / 1e9,
            "read_gb_per_s": bandwidth / 1e9, "step_ms": 1e3 * seconds}


def train_rates(cfg, model, tokenizer, ps: list[list[int]]) -> dict:
    """Completion tokens/s of the trainer's step and of a plain HF forward + backward + AdamW step on the same
    rows (a group of samples per prompt, as a run trains them)."""
    import copy

    from asyncrl.objectives import get_objective
    from asyncrl.run.threads import _trajectories
    from asyncrl.trainer.step import train_step

    torch.set_num_threads(1)
    group = cfg.rollout.group_size
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    samples = engine.generate(ps, SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=1.0))
    trajs = _trajectories(ps, samples, group)
    tokens = sum(len(s.token_ids) for s in samples)
    learner = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-7)
    objective = get_objective(cfg.objective.name, None)
    train_step(learner, optimizer, objective, trajs[:group], 0, cfg, tokenizer.pad_token_id)  # warm-up
    start = time.perf_counter()
    train_step(learner, optimizer, objective, trajs, 0, cfg, tokenizer.pad_token_id)
    ours = time.perf_counter() - start
    width = max(len(t.tokens) for t in trajs)
    ids = torch.tensor([t.tokens + [tokenizer.pad_token_id] * (width - len(t.tokens)) for t in trajs])
    mask = (torch.arange(width)[None] < torch.tensor([len(t.tokens) for t in trajs])[:, None]).long()
    start = time.perf_counter()
    logits = learner(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (logp * mask[:, 1:]).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    plain = time.perf_counter() - start
    return {"rows": len(trajs), "completion_tokens": tokens, "asyncrl_tokens_per_s": tokens / ours,
            "hf_forward_backward_tokens_per_s": tokens / plain, "asyncrl_step_s": ours, "hf_step_s": plain}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--parts", nargs="+", default=["decode", "training"])
    args = parser.parse_args()
    cfg = resolve_models(load_config(RECIPE))
    model, tokenizer = load_policy(cfg.model.path)
    rows = []
    for count in (32, 128) if "decode" in args.parts else ():
        ps = prompts(cfg, tokenizer, count // 4)
        ps = [p for p in ps for _ in range(4)]  # (4 samples a prompt, as a group shares its prefill)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine_rate(model, tokenizer, ps[:8])  # warm-up
            row = {"rows": count, "threads": threads, "asyncrl": engine_rate(model, tokenizer, ps),
                   "hf_generate": hf_generate(model, tokenizer, ps, [TOKENS] * len(ps)),
                   "vllm": vllm_rate(args.vllm_python, cfg.model.path, ps, [TOKENS] * len(ps), threads)
                   if args.vllm_python else None,
                   "bound": bound(model, count, threads)}
            row["asyncrl_share_of_bound"] = row["asyncrl"] / row["bound"]["tokens_per_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    ro = cfg.rollout
    group = [p for p in prompts(cfg, tokenizer, ro.prompts_per_step) for _ in range(ro.group_size)]
    training = train_rates(cfg, model, tokenizer, group) if "training" in args.parts else None
    print(json.dumps(training), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    saved = OUT / "engine_real.json"
    earlier = json.loads(saved.read_text()) if saved.exists() else {}
    rows, training = rows or earlier.get("decode", []), training or earlier.get("training")  # (one part run)
    saved.write_text(json.dumps({"decode": rows, "training": training}, indent=1))
    lines = ["| rows | threads | asyncrl tok/s | HF generate | vLLM-CPU | bound | asyncrl / bound | "
             "asyncrl / generate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vllm = f"{r['vllm']:.0f}" if r["vllm"] else "not measured"
        lines.append(f"| {r['rows']} | {r['threads']} | {r['asyncrl']:.0f} | {r['hf_generate']:.0f} | "
                     f"{vllm} | {r['bound']['tokens_per_s']:.0f} | {r['asyncrl_share_of_bound']:.0%} | "
                     f"{r['asyncrl'] / r['hf_generate']:.2f}× |")
    lines += ["", f"training, {training['rows']} rows, {training['completion_tokens']} completion tokens, 1 "
              f"thread: asyncrl {training['asyncrl_tokens_per_s']:.0f} tok/s, plain HF forward + backward + "
              f"AdamW {training['hf_forward_backward_tokens_per_s']:.0f} tok/s"]
    (OUT / "engine_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
