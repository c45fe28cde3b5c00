"""LoRA adapters (trainer.lora): what the engine merges equals PEFT's own merge, and a run's adapters
round-trip through publish, load, checkpoint, resume and export bit for bit."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import job_config
from safetensors.torch import load_file

from asyncrl.config import ConfigError, load_config
from asyncrl.config.load import config_changes
from asyncrl.observe.events import read_events
from asyncrl.policy import lora
from asyncrl.policy.model import build_char_tokenizer, build_tiny_model, load_policy
from asyncrl.run.launcher import resume, train
from asyncrl.rundir import CheckpointFiles, RunDir
from asyncrl.store.checkpoint import export
from asyncrl.trajectory import read_batch
from asyncrl.transports import weights


def _random_adapters(model, seed: int = 0) -> None:
    """B is 0 after attach (the model unchanged): give every adapter values, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def test_the_engines_merge_is_peft_merge_and_computes_the_adapted_forward():
    tokenizer = build_char_tokenizer()
    base = build_tiny_model(tokenizer, hidden_size=32, layers=2).eval()
    spec = load_config(overrides=["--trainer.lora.rank", "4", "--trainer.lora.alpha", "8"]).trainer.lora
    adapted = lora.attach(copy.deepcopy(base), spec)
    _random_adapters(adapted)
    saved = lora.adapters(weights.model_state(adapted))
    assert saved and all(k.startswith("base_model.model.") and ".default." not in k for k in saved)

    served = lora.Merged(copy.deepcopy(base), spec)
    served.apply(saved, "test")
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (adapted(input_ids=ids).logits - served.model(input_ids=ids).logits).abs().max().item()
        moved = (base(input_ids=ids).logits - served.model(input_ids=ids).logits).abs().max().item()
    assert gap < 1e-5 < moved  # (the adapters change the output; merged, it is the adapted forward's)

    for name, module in adapted.named_modules():
        if hasattr(module, "merge") and hasattr(module, "lora_A"):
            module.merge()
            merged = module.get_base_layer().weight
            assert torch.equal(merged, served.modules[name].weight), name  # bit for bit (float32)

    # a second version replaces the first (from the kept base), it does not add to it
    _random_adapters(adapted, seed=2)
    second = lora.adapters(weights.model_state(adapted))
    fresh = lora.Merged(copy.deepcopy(base), spec)
    fresh.apply(second, "test")
    served.apply(second, "test")
    assert weights.state_hash(weights.model_state(served.model)) == weights.state_hash(
        weights.model_state(fresh.model))
    with pytest.raises(ValueError, match="does not hold this policy's adapters"):
        served.apply({k: v for k, v in second.items() if "layers.0." not in k}, "v000003.safetensors")


@pytest.mark.long
def test_a_lora_run_round_trips_its_adapters(tiny_model, tmp_path):
    """4 steps at η = 0 (the engine samples with the version the trainer trains: its logprobs must equal
    the trainer's, which they do only if the engine merged each version's adapters), checkpoints at 2
    and 4; the newest checkpoint broken, a resume replays steps 2-3 from checkpoint 2 into the same
    adapters; export writes PEFT's merge of the adapters."""
    cfg = job_config(tmp_path, tiny_model, **{"run.steps": 4, "trainer.checkpoint_every": 2,
                                              "rollout.max_staleness": 0, "task.eval_size": 0,
                                              "trainer.lora.rank": 4, "trainer.lr": 3e-3})
    run_dir = train(cfg, log=lambda *a, **k: None)
    run = RunDir(run_dir)
    full_bytes = sum(f.stat().st_size for f in CheckpointFiles(tiny_model).model.parent.glob("*.safetensors"))
    for version in range(1, 5):
        file, marker = run.weights_file(version), weights.read_marker(run_dir, version)
        state = weights.load(file)
        assert all(".lora_A." in k or ".lora_B." in k for k in state), version
        assert weights.state_hash(state) == marker["hash"]
        assert file.stat().st_size < 0.1 * full_bytes
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kls = [r["mismatch_kl"] for r in steps if "step" in r]
    assert len(kls) == 4 and max(map(abs, kls)) < 1e-6, kls
    grads = [r["grad_norm"] for r in steps if "step" in r]
    # every step whose batch has a nonzero advantage moved the adapters (a batch of groups all right or all
    # wrong has none, and no gradient: which batches those are depends on the samples drawn)
    signal = [any(a for t in read_batch(run.batch(step)) for a in t.advantages) for step in range(4)]
    assert weights.state_hash(weights.load(run.weights_file(4))) != weights.state_hash(
        weights.load(run.weights_file(1))) and any(signal)
    assert [g > 0 for g in grads] == signal, (grads, signal)
    # a checkpoint is a PEFT directory: the published version's adapters, bit for bit
    ckpt = CheckpointFiles(run.checkpoint(4))
    assert not ckpt.model.exists() and (ckpt.path / lora.CONFIG_FILE).exists()
    assert weights.state_hash(weights.load(ckpt.adapters)) == weights.read_marker(run_dir, 4)["hash"]

    ckpt.adapters.write_bytes(ckpt.adapters.read_bytes()[:100])  # broken: resume falls back to step 2
    resume(run_dir, [], log=lambda *a, **k: None)
    events = read_events(run_dir)
    resumed = [e for e in events if e["event"] == "trainer_resumed"]
    assert resumed and resumed[-1]["step"] == 2
    replayed = [e for e in events if e["event"] == "version_replayed"]
    assert [e["version"] for e in replayed] == [3, 4] and all(e["identical"] for e in replayed)

    out = export(run_dir, tmp_path / "export")
    peft_dir = out / "adapter"
    assert load_file(peft_dir / lora.WEIGHTS_FILE).keys() == weights.load(run.weights_file(4)).keys()
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(load_policy(tiny_model)[0], str(peft_dir)).merge_and_unload()
    ours = load_policy(out)[0]
    assert weights.state_hash(weights.model_state(ours)) == weights.state_hash(weights.model_state(theirs))


def test_lora_refusals():
    with pytest.raises(ConfigError, match="publish_patches"):
        load_config(overrides=["--trainer.lora.rank", "8", "--trainer.publish_patches", "true"])
    old, new = load_config(), load_config(overrides=["--trainer.lora.rank", "8"])
    meaning, _ = config_changes(old, new)
    assert any(line.startswith("trainer.lora.rank: 0 -> 8") for line in meaning)
    tokenizer = build_char_tokenizer()
    spec = load_config(overrides=["--trainer.lora.rank", "2", "--trainer.lora.target_modules",
                                  '["no_such_proj"]']).trainer.lora
    with pytest.raises(ValueError, match="no_such_proj"):
        lora.attach(build_tiny_model(tokenizer, hidden_size=16, layers=1), spec)
