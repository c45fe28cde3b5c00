"""Peak memory of the trainer's forward and backward with a real vocabulary (Qwen3's 151,936 tokens, a
2-layer model built locally): the output layer in chunks of positions (the default, `CHUNK_VALUES` in
asyncrl/trainer/step.py) against every position of a length bucket at once (as before chunking).
Each setting runs in a fresh process; its peak resident memory, and what the step added to it.

Writes benchmarks/results/vocab_memory.{json,md}.

    python benchmarks/vocab_memory.py [--rows 16] [--length 256]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from tables import write_rows  # (benchmarks/tables.py)

VOCAB = 151_936


def child(chunk_values: int, rows: int, length: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncrl.trainer.logprobs import token_logprobs
    from asyncrl.trainer.step import collate
    from asyncrl.trajectory import Trajectory

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, tie_word_embeddings=True))
    prompt, answer = length // 2, length - length // 2
    trajs = [Trajectory(str(i), "g", "t", 0, torch.randint(3, VOCAB, (length,)).tolist(),
                        [0] * prompt + [1] * answer, [0.0] * length, [-1] * prompt + [0] * answer)
             for i in range(rows)]
    batch = collate(trajs, pad_id=0, version=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.monotonic()
    logp, entropy = token_logprobs(model, batch, 1.0, chunk_values=chunk_values)
    (logp * batch["mask"]).sum().backward()
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mib": round(peak), "step_added_mib": round(peak - before), "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.rows, args.length)))
        return
    from asyncrl.trainer.logprobs import CHUNK_VALUES

    settings = {"chunked (default)": CHUNK_VALUES, "whole bucket at once": 2**62}
    rows = []
    for name, values in settings.items():
        out = subprocess.run([sys.executable, __file__, "--child", str(values), "--rows", str(args.rows),
                              "--length", str(args.length)], capture_output=True, text=True, check=True)
        row = {"output_layer": name, "positions_per_chunk": min(values // VOCAB, args.rows * args.length),
               "vocab": VOCAB, "rows": args.rows, "length": args.length,
               **json.loads(out.stdout.strip().splitlines()[-1])}
        print(row, flush=True)
        rows.append(row)
    write_rows("vocab_memory", rows)


if __name__ == "__main__":
    main()
