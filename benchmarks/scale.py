"""Scale-out costs, measured side by side on this machine:

  jobs      the same short job with 1 and 2 replicas, under the local launcher and under Ray (trainer
            and replicas in actors, replicas fed through the object store; and with run.storage, the
            trainer fed through it too), --rounds times each: samples/s and, round by round, the ratio
            to the local single-replica run (Ray's overhead);
  transfer  one version through Ray's object store to a replica's host (put, fetch on the host, sha256,
            write), full file and sparse patch, for the tiny model and a ~20M one: bytes and seconds;
  sparsity  the sparse patch's size as a fraction of the full weights after one AdamW step at several
            learning rates, served in bfloat16 and float32 (PULSE reports ~1% at LLM-scale rates).

Writes benchmarks/results/scale.{json,md}.

    python benchmarks/scale.py [--steps 40] [--rounds 3] [--model models/tiny-default] [--skip jobs]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.config import load_config
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model, load_policy
from asyncrl.run.launcher import train
from asyncrl.transports import weights

OUT = Path(__file__).parent / "results"


def job(name: str, model: str, steps: int, extra: list[str]) -> dict:
    cfg = load_config(overrides=[
        "--run.name", f"scale-{name}", "--run.root", str(OUT / "runs"), "--run.overwrite", "true",
        "--model.path", model, "--run.steps", str(steps), "--task.eval_every", str(steps),
        "--trainer.threads", "1", "--inference.threads", "1", *extra])
    print(f"\n=== {name} ===", flush=True)
    start = time.monotonic()
    run_dir = train(cfg, log=lambda *a, **k: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "wall_seconds": round(time.monotonic() - start, 1),
            "samples_per_s": summary.get("samples_per_s"),
            "eval_accuracy_final": summary.get("eval_accuracy_final")}


def jobs(model: str, steps: int, rounds: int) -> list[dict]:
    """Every job once per round, in the same order, so that a pairing within a round shares the machine's
    state; a job's row has its median over rounds and its ratio to local-1 in each round."""
    ray = ["--run.launcher", "ray", "--run.ray_address", "local"]
    storage = tempfile.mkdtemp(prefix="asyncrl-scale-storage-")
    kinds = {"local-1": [], "ray-1": ray,
             "ray-1-storage": [*ray, "--run.storage", storage],  # the trainer fed through Ray, not files
             "local-2": ["--inference.replicas", "2"], "ray-2": ["--inference.replicas", "2", *ray]}
    runs = [[job(name, model, steps, extra) for name, extra in kinds.items()] for _ in range(rounds)]
    rows = []
    for i, name in enumerate(kinds):
        rates = [r[i]["samples_per_s"] for r in runs]
        ratios = [r[i]["samples_per_s"] / r[0]["samples_per_s"] for r in runs]
        rows.append({"name": name, "samples_per_s_median": round(statistics.median(rates), 1),
                     "samples_per_s": [round(x, 1) for x in rates],
                     "vs_local_1_each_round": [round(x, 3) for x in ratios],
                     "vs_local_1_median": round(statistics.median(ratios), 3),
                     "wall_seconds_median": statistics.median(r[i]["wall_seconds"] for r in runs)})
        print(rows[-1], flush=True)
    return rows


def stepped(model, lr: float, seed: int = 0) -> tuple[dict, dict]:
    """(weights before, weights after) one AdamW step on a language-modelling loss over random tokens."""
    torch.manual_seed(seed)
    before = {k: v.clone() for k, v in weights.model_state(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (8, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return before, weights.model_state(model)


def sparsity(path: str, lrs: list[float]) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for lr in lrs:
            model, _ = load_policy(path)
            before, after = stepped(model, lr)
            patch, changed, total = weights.make_patch(weights.cast_state(before, dtype),
                                                       weights.cast_state(after, dtype))
            full_bytes = sum(t.numel() * t.element_size() for t in weights.cast_state(after, dtype).values())
            patch_bytes = sum(t.numel() * t.element_size() for t in patch.values())
            rows.append({"model": Path(path).name, "dtype": str(dtype).removeprefix("torch."), "lr": lr,
                         "changed_fraction": round(changed / total, 5),
                         "patch_bytes_fraction": round(patch_bytes / full_bytes, 5)})
            print(rows[-1], flush=True)
    return rows


def transfer(paths: list[str], repeats: int = 3) -> list[dict]:
    """A version's file through the object store into a RoleHost on this machine, as the orchestrator
    stages it (asyncrl/transports/staging.py)."""
    import hashlib

    import ray

    from asyncrl.cluster.ray_host import RoleHost

    ray.init(num_cpus=4, object_store_memory=512 * 2**20, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    rows = []
    try:
        for path in paths:
            model, _ = load_policy(path)
            before, after = stepped(model, 1e-6)
            served = weights.cast_state(before, torch.bfloat16)
            new = weights.cast_state(after, torch.bfloat16)
            config = json.dumps({"run": {"root": "/tmp", "name": "x"}})
            host = ray.remote(RoleHost).options(num_cpus=0).remote("inference-0", None, config, "token")
            with tempfile.TemporaryDirectory() as tmp:
                files = {"full": Path(tmp) / "v.safetensors", "patch": Path(tmp) / "v.patch.safetensors"}
                save_file(new, str(files["full"]))
                save_file(weights.make_patch(served, new)[0], str(files["patch"]))
                for kind, file in files.items():
                    seconds = []
                    for version in range(1, repeats + 1):
                        start = time.monotonic()
                        data = file.read_bytes()
                        ref = ray.put(data)
                        ray.get(host.stage.remote(version, kind, [ref], hashlib.sha256(data).hexdigest(), ""))
                        seconds.append(time.monotonic() - start)
                    rows.append({"model": Path(path).name, "kind": kind, "bytes": file.stat().st_size,
                                 "seconds": round(sorted(seconds)[len(seconds) // 2], 4)})
                    print(rows[-1], flush=True)
            ray.get(host.close.remote())
    finally:
        ray.shutdown()
    return rows


def model_20m(directory: Path) -> str:
    if not (directory / "config.json").exists():
        tok = build_char_tokenizer()
        build_tiny_model(tok, hidden_size=448, layers=6, heads=7, seed=0).save_pretrained(directory)
        tok.save_pretrained(directory)
    return str(directory)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                     + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="models/tiny-default")
    parser.add_argument("--skip", nargs="*", default=[], choices=["jobs", "transfer", "sparsity"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    big = model_20m(Path(os.environ.get("ASYNCRL_BENCH_20M", "/tmp/asyncrl-bench-20m")))
    results = {}
    if "sparsity" not in args.skip:
        results["sparsity"] = sparsity(args.model, [1e-6, 1e-5, 1e-4]) + sparsity(big, [1e-6])
    if "transfer" not in args.skip:
        results["transfer"] = transfer([args.model, big])
    if "jobs" not in args.skip:
        results["jobs"] = jobs(args.model, args.steps, args.rounds)
    path = OUT / "scale.json"  # (a part skipped keeps its earlier numbers)
    results = {**(json.loads(path.read_text()) if path.exists() else {}), **results}
    path.write_text(json.dumps(results, indent=1))
    md = "\n\n".join(f"## {name}\n\n{table(rows)}" for name, rows in results.items())
    (OUT / "scale.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
