"""The policy: any HF causal LM by name or path, or the default tiny one made here.

The default tiny policy is a character-level tokenizer (HF `tokenizers`, wrapped as a
`PreTrainedTokenizerFast`) and a ~1M-parameter Llama built from a config, so the whole RL loop
runs on a laptop CPU with nothing downloaded.
"""
from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# The tiny char-level models' template: "U:question\nA:reply<eos>\nT:tool output\nA:"; a tool
# call is written name(argument) (the "compact" parser reads it back).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}A:{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ v }}{% endfor %}){% endfor %}{{ eos_token }}\n"
    "{% else %}{{ m.role[0] | upper }}:{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


def build_char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny_model(tokenizer, hidden_size: int = 128, layers: int = 4, heads: int = 4, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def load_policy(path: str | Path):
    """(model in fp32 eval mode, tokenizer) from an HF name or a local directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as e:
        raise FileNotFoundError(f"cannot load model {path!r}: {e}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
