"""The policy: any HF causal LM by name or path, or a tiny one built here from nothing.

The default tiny policy takes the code paths a real LLM does: a byte-level BPE tokenizer trained
locally (HF `tokenizers`) on the run's own task text, with multi-character tokens, ChatML special
tokens and a chat template that renders tool calls the Hermes/Qwen way; and a current HF
architecture (Qwen3: grouped-query attention, q/k norms, tied embeddings) built from its config.
The older character-level tokenizer and Llama stay as options (`warmstart.tokenizer = "char"`,
`warmstart.architecture = "llama"`): one token per character is the smallest vocabulary there is.
"""
from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Iterable

# --- the character tokenizer ------------------------------------------------------------------
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


# --- the byte-level BPE tokenizer -------------------------------------------------------------
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Tool-call markers are added tokens that decoding keeps (as in Qwen's vocabulary), so the
# hermes parser finds them in the reply's text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# GPT-2/Qwen-style pre-tokenization: words with their leading space, single digits (numbers
# never merge, as in Qwen and Llama 3), punctuation runs, newlines, other whitespace.
SPLIT_PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML, the way Qwen renders it: tools in a system turn, calls as <tool_call>{json}</tool_call>,
# tool results in a user turn inside <tool_response>.
CHATML_TEMPLATE = (  # (HF renders with trim_blocks: a newline right after a tag is dropped, so
    # newlines next to tags are written as expressions)
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\nYou may call functions. Their signatures:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>{{ '\\n' }}"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{% if loop.first and m.content %}{{ '\\n' }}{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>{{ '\\n' }}"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `texts` (any byte still encodes: the 256 byte tokens
    are always in the vocabulary), with ChatML special tokens and the CHATML_TEMPLATE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=ENDOFTEXT, eos_token=IM_END,
                                        chat_template=CHATML_TEMPLATE)
    tokenizer.add_tokens(TOOL_TOKENS)
    return tokenizer


def chatml_corpus(texts: Iterable[str], weight: int = 200) -> Iterable[str]:
    """`texts` and the chat template's literal text (`weight` times: it is in every conversation), so that
    its words and markers (`assistant`, `<tool_call>`) get merges of their own, as in a real LLM's
    vocabulary."""
    glue = [piece for piece in re.split(r"\{[{%].*?[%}]\}", CHATML_TEMPLATE) if piece.strip()]
    yield from glue * weight
    yield from texts


# --- architectures ----------------------------------------------------------------------------
def build_tiny_model(tokenizer, hidden_size: int = 128, layers: int = 4, heads: int = 4, seed: int = 0,
                     architecture: str = "llama", kv_heads: int | None = None, tied: bool = True,
                     experts: int = 8, experts_per_token: int = 2):
    """A freshly initialised causal LM: "qwen3" (q/k RMS norms), "qwen2" (q/k/v biases), "llama", or
    "qwen3_moe" (Qwen3 whose every MLP is `experts` experts, `experts_per_token` routed per token, the
    gate weights renormalised over them, as Qwen3-30B-A3B's); grouped-query attention with `kv_heads` <
    `heads`; the output layer tied to the embedding or not."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tied,
    )
    if architecture == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=hidden_size // heads, **common))
    if architecture == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            head_dim=hidden_size // heads, num_experts=experts, num_experts_per_tok=experts_per_token,
            moe_intermediate_size=hidden_size, norm_topk_prob=True, **common))
    if architecture == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    raise ValueError(f"architecture {architecture!r} is not one of qwen3, qwen2, llama, qwen3_moe")


def load_policy(path: str | Path):
    """(model in fp32 eval mode, tokenizer) from an HF name, a local directory, a GGUF file (through its
    converted directory: asyncrl/policy/gguf.py) or a file of an installed package ("package:NAME/FILE"): a
    causal LM, or a vision-language model (images in, text out: asyncrl/vision/)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from asyncrl.plugins import package_file
    from asyncrl.policy.gguf import gguf_file, model_dir

    path = package_file(str(path), "model path")
    found = gguf_file(path)
    path = str(model_dir(found) if found else path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(path, dtype=torch.float32)
    except OSError as e:
        raise FileNotFoundError(f"cannot load model {path!r}: {e}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
