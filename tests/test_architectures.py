"""Real architectures, built locally from their configs at small sizes with a byte-level BPE tokenizer:
Qwen3 (q/k norms, grouped-query attention, tied embeddings), Qwen2 (q/k/v biases, GQA, untied), Llama
(multi-head, untied) and Qwen3-MoE (every MLP 8 experts, top-2). For each: a save / load round trip,
the built-in engine's sampled logprobs against the trainer's forward, a trainer step on 2 ranks against
1, and a checkpoint exported as a plain Hugging Face directory."""

import pytest
import torch
from test_ranks import CASES, jobs_of_steps, on_two_ranks, steps
from transformers import AutoModelForCausalLM

from asyncrl.inference.engine import Engine, SamplingParams
from asyncrl.policy.model import build_bpe_tokenizer, build_tiny_model, chatml_corpus, load_policy
from asyncrl.store import checkpoint
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.step import collate
from asyncrl.trajectory import Trajectory
from asyncrl.transports import weights

ARCHITECTURES = {  # name: (architecture, heads, kv_heads, tied)
    "qwen3-gqa-tied": ("qwen3", 4, 2, True),
    "qwen2-gqa-untied": ("qwen2", 4, 2, False),
    "llama-mha-untied": ("llama", 4, 4, False),
    "qwen3_moe-gqa-tied": ("qwen3_moe", 4, 2, True),  # 8 experts, 2 routed per token
}
TEXTS = [f"{a}+{b}={a + b}" for a in range(40) for b in range(0, 40, 3)]


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[str, str]:
    tokenizer = build_bpe_tokenizer(chatml_corpus(TEXTS), vocab_size=320)
    paths = {}
    for name, (architecture, heads, kv_heads, tied) in ARCHITECTURES.items():
        model = build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=heads, architecture=architecture,
                                 kv_heads=kv_heads, tied=tied)
        path = tmp_path_factory.mktemp("arch") / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_round_trip_engine_logprobs_and_export(policies, name, tmp_path):
    architecture, _, kv_heads, tied = ARCHITECTURES[name]
    model, tokenizer = load_policy(policies[name])
    assert model.config.model_type == architecture and model.config.num_key_value_heads == kv_heads
    assert model.config.tie_word_embeddings == tied
    published = weights.model_state(model)
    assert ("lm_head.weight" in published) != tied  # a tied output layer is published once, as the embedding

    # the engine (KV cache, continuous batching) samples tokens whose logprobs the trainer's forward matches
    prompts = [tokenizer(t)["input_ids"] for t in ("12+30=", "7+1=", "39+36=")]
    engine = Engine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    samples = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0))
    trajs = [Trajectory(str(i), "g", "t", 0, p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids),
                        [0.0] * len(p) + s.logprobs, [-1] * len(p) + s.versions)
             for i, (p, s) in enumerate(zip(prompts, samples))]
    batch = collate(trajs, tokenizer.pad_token_id, version=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    mask = batch["mask"] > 0
    assert int(mask.sum()) >= 3
    torch.testing.assert_close(logp[mask], batch["behav"][mask], rtol=0, atol=1e-4)

    # a checkpoint exports as a directory transformers loads, with the same weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    writer = checkpoint.CheckpointWriter(tmp_path / "run", tokenizer, keep=2, deadline=60)
    writer.save(1, *checkpoint.parts(model, optimizer, scheduler))
    writer.wait()
    exported = AutoModelForCausalLM.from_pretrained(checkpoint.export(tmp_path / "run", tmp_path / "out"))
    assert weights.state_hash(weights.model_state(exported)) == weights.state_hash(published)


def test_each_architecture_trains_on_two_ranks_as_on_one(policies, tmp_path):
    """FSDP2 wraps each architecture's decoder blocks; the 2-rank step equals the 1-rank one."""
    paths = [policies[name] for name in ARCHITECTURES]
    results = on_two_ranks(tmp_path, jobs_of_steps, [(path, CASES[:1]) for path in paths])
    torch.set_num_threads(1)
    for name, path, [two] in zip(ARCHITECTURES, paths, results):
        [one] = steps(path, Ranks(), CASES[:1])
        assert two["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-4, abs=1e-6), name
        assert one["state"].keys() == two["state"].keys(), name
        for key in one["state"]:
            torch.testing.assert_close(two["state"][key], one["state"][key], rtol=1e-4, atol=1e-6, msg=name)
