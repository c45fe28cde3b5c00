"""A tiny vision-language policy built here from a real architecture's config (Qwen2.5-VL): a vision
tower of a few blocks that turns 14-pixel patches into features, merged 2x2 into the language model's
width; a small Qwen2 language model with M-RoPE; the byte-level BPE tokenizer with Qwen-VL's image
tokens; and Qwen2-VL's image processor, sized for small pictures. Saved like any HF model directory,
so the engine, the trainer and a hub Qwen2.5-VL go through the same code."""
from __future__ import annotations

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# the processor's bounds: an 84 x 84 picture is 6 x 6 patches of 14 px, 9 image tokens after the merge
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def add_vision_tokens(tokenizer) -> None:
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)


def build_tiny_vlm(tokenizer, hidden_size: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                   vision_width: int = 64, vision_depth: int = 2, seed: int = 0):
    """(model, image processor): a freshly initialised Qwen2.5-VL whose tokenizer has VISION_TOKENS."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    head_dim = hidden_size // heads
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # Qwen's split of the rotary half
    section[0] += head_dim // 2 - sum(section)
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width, num_heads=2,
            out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, fullatt_block_indexes=[vision_depth - 1]),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=True)
    model = Qwen2_5_VLForConditionalGeneration(config)
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return model, processor


def tiny_vlm(tokenizer, ws, out):
    """(model, processor) for the warm start (`ws`: its config section): the tokenizer gets the image
    tokens, and the processor is saved into `out` first (the prompts' image sizes come from it)."""
    add_vision_tokens(tokenizer)
    model, processor = build_tiny_vlm(tokenizer, ws.hidden_size, ws.layers, ws.heads, ws.kv_heads,
                                      seed=ws.seed)
    processor.save_pretrained(out)
    return model, processor
