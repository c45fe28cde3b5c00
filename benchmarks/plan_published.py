"""`asyncrl plan` on a published table: verl's fully-async recipe against its colocated synchronous runs.

Source: verl, docs/advance/fully_async.md ("Asynchronous Training on 7B Model"; data on W&B,
hou-zg-meituan/fully-async-policy-colocate_async): Qwen2.5-Math-7B, DAPO, H20 GPUs, 512 prompts × 16
responses per step, responses up to 28K tokens, vLLM + FSDP2. Per step, in seconds:

    GPUs   colocate sync: gen  old_log_prob  update_actor  step  | fully async (half each): update_actor  step
     32                  357.41    107.71        313.81   790.10 |                            269.80   294.77
     64                  150.72     70.26        133.41   365.28 |                            156.98   189.26
    128                  177.85     53.92        113.81   356.30 |                            113.16   150.63

What the planner is given, from the synchronous row alone: the trainer's seconds per step (update_actor;
the asynchronous trainer uses the rollout's logprobs and skips old_log_prob) on all the GPUs, scaled to
half of them as data parallelism would (×2); the generation time of a synchronous batch, which fixes
the decode step's seconds given the response lengths. Those lengths are not in the table: a long tail
capped at 28K, mean ~4.5K tokens (DAPO on this model, early training), is assumed and varied. One
vLLM replica per GPU (a 7B model fits an H20), η = 1 (staleness_threshold 0.5 with partial rollouts:
update_policy "interrupt").

Predicted async-over-sync speedup per step is set beside the table's; a second prediction takes the
asynchronous trainer's own update_actor (what a user would measure on a trainer of that size).
Writes benchmarks/results/plan_published.{json,md}.

    python benchmarks/plan_published.py [--steps 8]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.plan.rates import Rates
from asyncrl.plan.simulate import simulate
from asyncrl.plan.workload import Workload

OUT = Path(__file__).parent / "results"
TABLE = {  # GPUs: (sync gen, sync update_actor, sync step, async update_actor, async step)
    32: (357.41, 313.81, 790.10, 269.80, 294.77),
    64: (150.72, 133.41, 365.28, 156.98, 189.26),
    128: (177.85, 113.81, 356.30, 113.16, 150.63),
}
PROMPTS, G, MAX_TOKENS, PROMPT_TOKENS = 512, 16, 28_000, 300
LENGTHS = {  # response-length tails tried ([[low, high, weight], ...]); the table does not give them
    "mean 4.5K": [[500, 3000, 60], [3000, 8000, 30], [8000, 28000, 10]],
    "mean 3K, lighter tail": [[300, 2500, 70], [2500, 8000, 25], [8000, 28000, 5]],
}
PER_ROW = 2e-5  # a decode step's seconds per running sequence (vLLM, 7B): small against the step's base


def config(eta: int, steps: int, policy: str):
    return load_config(overrides=[
        "--rollout.prompts_per_step", str(PROMPTS), "--rollout.group_size", str(G),
        "--rollout.max_tokens", str(MAX_TOKENS), "--rollout.max_staleness", str(eta),
        "--rollout.max_concurrent_groups", "100000", "--run.steps", str(steps),
        "--inference.update_policy", policy, "--inference.max_batch_sequences", "1024",
    ])


def rates(decode_base: float, update_actor: float, tokens_per_step: float) -> Rates:
    """The trainer's step as a line through the origin: update_actor for a step's tokens, on one rank."""
    return Rates(decode_base=decode_base, decode_per_row=PER_ROW, prefill_base=0.01, prefill_per_token=2e-6,
                 load_seconds=5.0, step_base=0.0, step_per_token=update_actor / tokens_per_step,
                 source="verl docs/advance/fully_async.md")


def sync_generation(workload: Workload, gpus: int, decode_base: float, steps: int) -> float:
    """Seconds of a synchronous batch's generation on `gpus` replicas (the trainer made free)."""
    out = simulate(config(0, steps, "finish"), rates(decode_base, 1e-9, 1.0), workload, replicas=gpus)
    return out["seconds"] / steps


def fit_decode_base(workload: Workload, gpus: int, gen_seconds: float, steps: int) -> float:
    low, high = 1e-4, 0.1
    for _ in range(14):  # (bisection: generation time rises with the step's base)
        mid = (low * high) ** 0.5
        low, high = (mid, high) if sync_generation(workload, gpus, mid, steps) < gen_seconds else (low, mid)
    return (low * high) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for name, answer in LENGTHS.items():
        workload = Workload(prompt=[[PROMPT_TOKENS, PROMPT_TOKENS, 1]], answer=answer)
        mean = sum((lo + hi) / 2 * w for lo, hi, w in answer) / sum(w for *_, w in answer)
        tokens_per_step = PROMPTS * G * mean
        for gpus, (gen, update, step, async_update, async_step) in TABLE.items():
            base = fit_decode_base(workload, gpus, gen, args.steps)
            predicted = {}
            for label, trainer_s in (("scaled", update * 2), ("measured trainer", async_update)):
                r = rates(base, trainer_s, tokens_per_step)  # (one rank's step: ranks = 1)
                out = simulate(config(1, 3 * args.steps, "interrupt"), r, workload, replicas=gpus // 2)
                per_step = out["seconds"] / (3 * args.steps)
                predicted[label] = {"step_s": round(per_step, 1), "speedup": round(step / per_step, 2),
                                    "staleness_mean": out["staleness_mean"]}
            rows.append({"lengths": name, "gpus": gpus, "decode_base_s": round(base, 5),
                         "sync_step_s": step, "async_step_s": async_step,
                         "published_speedup": round(step / async_step, 2), "predicted": predicted})
            print(json.dumps(rows[-1]), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "plan_published.json").write_text(json.dumps(rows, indent=1))
    lines = ["| response lengths | GPUs | sync step s | async step s (published) | speedup published | "
             "predicted, trainer scaled ×2 | predicted, trainer as measured |", "|---" * 7 + "|"]
    for r in rows:
        a, b = r["predicted"]["scaled"], r["predicted"]["measured trainer"]
        lines.append(f"| {r['lengths']} | {r['gpus']} | {r['sync_step_s']:.0f} | {r['async_step_s']:.0f} | "
                     f"{r['published_speedup']:.2f}× | {a['speedup']:.2f}× ({a['step_s']:.0f} s) | "
                     f"{b['speedup']:.2f}× ({b['step_s']:.0f} s) |")
    (OUT / "plan_published.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
