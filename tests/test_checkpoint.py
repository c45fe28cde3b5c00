"""Checkpoints: written in the background, restored exactly, corruption detected, exported as HF."""
import torch
from transformers import AutoModelForCausalLM

from asyncrl.policy.model import load_policy
from asyncrl.rundir import RunDir
from asyncrl.store import checkpoint
from asyncrl.transports import weights


def trained(tiny_model):
    model, tokenizer = load_policy(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, tokenizer, optimizer, scheduler


def test_background_checkpoint_restores_exactly_while_training_goes_on(tiny_model, tmp_path):
    model, tokenizer, optimizer, scheduler = trained(tiny_model)
    writer = checkpoint.CheckpointWriter(tmp_path, tokenizer, keep=2, deadline=60)
    saved_hash = weights.state_hash(weights.model_state(model))
    saved_moment = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    stall = writer.save(1, *checkpoint.parts(model, optimizer, scheduler))
    with torch.no_grad():  # training goes on while the thread writes: the snapshot must not see it
        for p in model.parameters():
            p.add_(1.0)
    writer.wait()
    assert stall < 5
    path = checkpoint.latest(tmp_path)
    assert path.name == "step_000001" and checkpoint.verify_checkpoint(path) is None
    restored, _ = load_policy(str(path))
    assert weights.state_hash(weights.model_state(restored)) == saved_hash
    assert checkpoint.load_trainer_state(path)["step"] == 1
    fresh, _ = load_policy(str(path))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint.load_optimizer(path, fresh, fresh_optimizer)
    for k, v in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], saved_moment[k])


def test_corrupt_or_partial_checkpoints_fall_back_to_an_earlier_one(tiny_model, tmp_path):
    model, tokenizer, optimizer, scheduler = trained(tiny_model)
    writer = checkpoint.CheckpointWriter(tmp_path, tokenizer, keep=3, deadline=60)
    for step in (1, 2, 3):
        writer.save(step, *checkpoint.parts(model, optimizer, scheduler))
    writer.wait()
    root = RunDir(tmp_path).checkpoints
    blob = root / "step_000003" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    blob.write_bytes(bytes(data))
    (root / "step_000002" / "manifest.json").unlink()  # as if the write stopped before its last file
    seen = []
    assert checkpoint.latest(tmp_path, log=seen.append).name == "step_000001"
    assert "model.safetensors does not match its checksum" in seen[0] and "no manifest.json" in seen[1]


def test_keep_last_n(tiny_model, tmp_path):
    model, tokenizer, optimizer, scheduler = trained(tiny_model)
    writer = checkpoint.CheckpointWriter(tmp_path, tokenizer, keep=2, deadline=60)
    for step in range(1, 6):
        writer.save(step, *checkpoint.parts(model, optimizer, scheduler))
    writer.wait()
    assert checkpoint.valid_steps(RunDir(tmp_path).checkpoints) == [4, 5]


def test_export_is_a_plain_hf_model_directory(tiny_model, tmp_path):
    model, tokenizer, optimizer, scheduler = trained(tiny_model)
    writer = checkpoint.CheckpointWriter(tmp_path / "run", tokenizer, keep=2, deadline=60)
    writer.save(7, *checkpoint.parts(model, optimizer, scheduler))
    writer.wait()
    out = checkpoint.export(tmp_path / "run", tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 6]])
    model.eval()
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert not (out / "trainer_state.pt").exists()
