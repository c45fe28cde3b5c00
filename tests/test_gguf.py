"""A model held as a GGUF file: converted once into a model directory that gives the file's own numbers,
tokenizer and chat template; reused by its hash; refused in one sentence where transformers cannot read
it. The GGUF is written here with the `gguf` package from a tiny Llama (no download)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.scale import apply_profile, parameters, profile_for
from asyncrl.policy import gguf as converter
from asyncrl.policy.model import (
    CHATML_TEMPLATE,
    build_bpe_tokenizer,
    build_tiny_model,
    chatml_corpus,
    load_policy,
)

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS = 4, 2


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of the rotary halves in q/k rows (transformers undoes it when it reads the file)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, architecture: str = "llama", quantize_ffn: bool = False):
    """A tiny Llama and its BPE tokenizer as one GGUF file; returns the HF model it was written from."""
    tokenizer = build_bpe_tokenizer(chatml_corpus([f"{a}+{b}={a + b}" for a in range(50) for b in range(20)]),
                                    vocab_size=320)
    model = build_tiny_model(tokenizer, hidden_size=64, layers=2, heads=HEADS, kv_heads=KV_HEADS,
                             architecture="llama", seed=3).eval()
    core = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = {**core["model"]["vocab"], **{t["content"]: t["id"] for t in core["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in core["added_tokens"] if t["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in core["model"]["merges"]]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(cfg.hidden_size // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHATML_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # (tied to the embedding, as in SmolLM2)
        w = tensor.detach().clone()
        if name.startswith("model.layers."):
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:]).removesuffix(".weight")
            if rest == "self_attn.q_proj":
                w = _permute(w, HEADS)
            elif rest == "self_attn.k_proj":
                w = _permute(w, KV_HEADS)
            gguf_name = f"blk.{layer}.{parts[rest]}.weight"
        else:
            gguf_name = names[name]
        data = w.numpy()
        if quantize_ffn and "ffn_up" in gguf_name:  # a quantized tensor, dequantized on conversion
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(root))
    return root


def test_a_gguf_file_becomes_a_model_with_its_numbers_tokenizer_and_template(tmp_path, cache):
    original, tokenizer = write_gguf(tmp_path / "tiny.Q8_0.gguf", quantize_ffn=True)
    said = []
    model, loaded = load_policy(tmp_path / "tiny.Q8_0.gguf")  # (any loader takes the file)
    out = converter.model_dir(converter.gguf_file(tmp_path), log=said.append)  # (or its directory)
    key = json.loads((out / converter.KEY).read_text())
    assert key["sha256"] == converter.sha256_of(tmp_path / "tiny.Q8_0.gguf")
    # a plain float32 model: nothing that loads it takes it for quantized, and it saves
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not getattr(model, "is_quantized", False)
    model.save_pretrained(tmp_path / "saved")
    assert said == []  # converted once, by the first load: the second found it by its hash
    text = [{"role": "user", "content": "12+7"}]
    assert loaded.apply_chat_template(text, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer("12+7=19")["input_ids"]])
    assert loaded("12+7=19")["input_ids"] == ids[0].tolist()
    assert loaded.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        expected, got = original(ids).logits, model(ids).logits
    # every tensor is the file's own but ffn_up, which Q8_0 rounded (~0.4% of each weight's scale)
    assert torch.allclose(got, expected, atol=0.05), (got - expected).abs().max()
    assert (got - expected).abs().max() > 0  # (the quantized tensor is the file's, not the original's)


def test_a_cut_short_conversion_is_never_taken_for_finished(tmp_path, cache):
    write_gguf(tmp_path / "m.gguf")
    out = converter.cache_root() / f"m-{converter.sha256_of(tmp_path / 'm.gguf')[:16]}"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # a directory left by a killed conversion: no key
    assert converter.model_dir(tmp_path / "m.gguf", log=lambda *_: None) == out
    assert (out / "model.safetensors").exists() and (out / converter.KEY).exists()
    assert not list(out.parent.glob(".*partial*"))


def test_what_transformers_cannot_read_is_refused_naming_it(tmp_path, cache):
    write_gguf(tmp_path / "odd.gguf", architecture="mamba7")
    with pytest.raises(ConfigError, match="architecture mamba7.*cannot|cannot read this GGUF.*mamba7"):
        converter.model_dir(tmp_path / "odd.gguf", log=lambda *_: None)
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="2 GGUF files"):
        converter.gguf_file(tmp_path / "two")
    assert not list(cache.glob("odd-*"))


def test_an_unreachable_hub_is_said_at_once(monkeypatch):
    from asyncrl.run.preflight import _check_hub_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="not in the local hub cache.*cannot be reached"):
        _check_hub_model("someone/not-here-135m")
    with pytest.raises(ConfigError, match="no such file or directory"):
        _check_hub_model("./models/../missing model")
    assert time.monotonic() - start < 3


def _fake_model(path: Path, parameters: int) -> Path:
    """A directory whose safetensors header claims `parameters` (the profile reads headers only)."""
    path.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [parameters], "data_offsets": [0, 4 * parameters]}})
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode())
    return path


def test_defaults_follow_the_model_size_and_yield_to_what_the_user_set(tmp_path):
    assert [profile_for(n) for n in (800_000, 134_515_008, 7_000_000_000)] == ["tiny", "small", "large"]
    real = _fake_model(tmp_path / "real", 134_515_008)
    assert parameters(real) == 134_515_008
    said = []
    cfg = apply_profile(load_config(overrides={"rollout": {"group_size": 4}}), real, said.append)
    assert cfg.model.defaults == "small" and cfg.trainer.lr == 1e-5 and cfg.rollout.max_tokens == 128
    assert cfg.rollout.group_size == 4  # (set by the user)
    assert "'small' profile for 134.5M parameters" in said[0] and "trainer.lr = 1e-05" in said[0]
    assert "group_size" not in said[0] and "grad_clip" not in said[0]  # (set by the user; no change)
    again = apply_profile(cfg, real, said.append)  # a resumed run: every key set, nothing changes
    assert again == cfg and said[1].endswith("taking none (all set)")
    tiny = apply_profile(load_config(), _fake_model(tmp_path / "tiny", 800_000), said.append)
    assert tiny.trainer.lr == load_config().trainer.lr and tiny.model.defaults == "tiny"
