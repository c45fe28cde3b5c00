"""The trainer on a CUDA device: the same numbers as the padded, whole-vocabulary forward, its memory
with a real vocabulary, and its step time with and without shared prompts. Needs a GPU (never a test).

On a 4-layer Qwen3 built locally with Qwen3's 151,936-token vocabulary, float32 and bfloat16, for two
batch shapes of 16 groups × 8 samples (long prompts with 1-3-token answers; agent episodes sharing only
their first turn), against one padded forward of every row with the whole vocabulary at once:
  - the largest |Δ log π| and |Δ entropy| of the trainer's forward (shared prompts, chunked output layer),
  - the largest relative difference of the gradients,
  - peak GPU memory of a forward and backward, chunked vs whole vocabulary,
  - seconds per forward+backward (median of 5), shared prompts vs not.

Writes benchmarks/results/gpu_trainer.{json,md}.

    python benchmarks/gpu_trainer.py [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from shared_prefix import batch as trajectories  # (benchmarks/shared_prefix.py)
from tables import write_rows  # (benchmarks/tables.py)

from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.step import collate

VOCAB = 151_936
SHAPES = ["long prompt, short answer", "agent episodes (first turn shared)"]


def model_on(device: str, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).to(device, dtype)


def forward_backward(model, batch, **kw):
    """(logp, entropy, gradients, seconds, peak bytes) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    cuda = batch["tokens"].is_cuda  # (on the CPU: a dry run of this script, with no memory figures)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    logp, entropy = token_logprobs(model, batch, 1.0, **kw)
    ((logp * batch["mask"]).sum() / batch["mask"].sum()).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.monotonic() - start
    grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return logp.float().detach(), entropy.float().detach(), grads, seconds, peak


def compare(device: str, dtype: torch.dtype, shape: str) -> dict:
    model = model_on(device, dtype)
    batch = {k: v.to(device) for k, v in collate(trajectories(VOCAB, shape, 0), 0, 0).items()}
    mask = batch["mask"].bool()
    # the reference: every row padded, one call, the whole vocabulary's log-softmax at once
    ref = forward_backward(model, batch, buckets=False, chunk_values=2**62)
    got = forward_backward(model, batch)
    grad_rel = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
                   for g, r in zip(got[2], ref[2]))
    times = {}
    for share in (False, True):
        runs = [forward_backward(model, batch, share_prefixes=share)[3] for _ in range(6)][1:]
        times[share] = statistics.median(runs)
    return {
        "dtype": str(dtype).removeprefix("torch."), "shape": shape,
        "max_dlogp": f"{(got[0] - ref[0])[mask].abs().max().item():.2e}",
        "max_dentropy": f"{(got[1] - ref[1])[mask].abs().max().item():.2e}",
        "max_grad_rel": f"{grad_rel:.2e}",
        "peak_mib_whole": round(ref[4] / 2**20), "peak_mib_trainer": round(got[4] / 2**20),
        "step_s_padded": round(times[False], 4), "step_s_shared": round(times[True], 4),
        "speedup": round(times[False] / times[True], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(args.device), torch.__version__, flush=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            rows.append(compare(args.device, dtype, shape))
            print(rows[-1], flush=True)
    write_rows("gpu_trainer", rows)


if __name__ == "__main__":
    main()
