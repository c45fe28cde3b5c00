"""One training step with and without shared prompts (trainer.share_prefixes), side by side, on three
batch shapes of 16 groups × 8 samples: long prompts with 1–3-token answers (the shape where every
sample re-ran its prompt), prompts and answers of similar length, and agent episodes that share only
their first turn. Seconds per step (median of 5 after a warm-up) and tokens through the model.

Writes benchmarks/results/shared_prefix.{json,md}.

    python benchmarks/shared_prefix.py [--model models/tiny-default] [--steps 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from tables import write_rows  # (benchmarks/tables.py)

from asyncrl.config import load_config
from asyncrl.objectives import get_objective
from asyncrl.policy.model import load_policy
from asyncrl.trainer.step import train_step
from asyncrl.trajectory import Trajectory

SHAPES = {  # name: (prompt length range, own tokens range: the answer, or an episode's later turns)
    "long prompt, short answer": ((90, 110), (1, 3)),
    "uniform": ((15, 25), (15, 25)),
    "agent episodes (first turn shared)": ((60, 80), (20, 60)),
}


def batch(vocab: int, shape: str, seed: int, groups: int = 16, size: int = 8) -> list[Trajectory]:
    rng = random.Random(seed)
    (p_lo, p_hi), (a_lo, a_hi) = SHAPES[shape]
    trajs = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(p_lo, p_hi))]
        for _ in range(size):
            own = [rng.randrange(3, vocab) for _ in range(rng.randint(a_lo, a_hi))]
            p, n = len(prompt), len(own)
            trajs.append(Trajectory(str(len(trajs)), str(g), "t", g, prompt + own, [0] * p + [1] * n,
                                    [-2.0] * (p + n), [-1] * p + [0] * n, 0.0,
                                    [0.0] * p + [rng.uniform(-1, 1)] * n))
    return trajs


def measure(model_path: str, shape: str, share: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_policy(model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cfg = load_config(overrides=["--trainer.share_prefixes", str(share).lower()])
    counted = []  # tokens of each forward call
    model.register_forward_pre_hook(lambda m, a, kw: counted.append(kw["input_ids"].numel()),
                                    with_kwargs=True)
    seconds = []
    for step in range(steps + 1):  # the first warms up
        trajs = batch(len(tokenizer), shape, step)
        counted.clear()
        start = time.monotonic()
        train_step(model, optimizer, get_objective("ppo_clip"), trajs, 0, cfg, tokenizer.pad_token_id)
        if step:
            seconds.append(time.monotonic() - start)
    return {"shape": shape, "share_prefixes": share, "step_s": round(statistics.median(seconds), 3),
            "tokens_through_model": sum(counted),
            "tokens_in_batch": sum(len(t.tokens) for t in trajs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny-default")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    for shape in SHAPES:
        pair = [measure(args.model, shape, share, args.steps) for share in (False, True)]
        pair[1]["speedup"] = round(pair[0]["step_s"] / pair[1]["step_s"], 2)
        pair[0]["speedup"] = 1.0
        for row in pair:
            print(row, flush=True)
        rows += pair
    write_rows("shared_prefix", rows)


if __name__ == "__main__":
    main()
