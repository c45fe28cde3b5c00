"""What a vision-language policy is shown, computed the same way by the engine and the trainer.

A prompt's tokens hold each image as `<|vision_start|>` + one `<|image_pad|>` per merged patch +
`<|vision_end|>` (Qwen-VL's layout), expanded here from one pad per image, so the token ids alone say
where every image sits. The engine and the trainer then make the same two things of (tokens, images):
- the input embeddings: the token embeddings with each image's vision-tower features written over its
  pads (each distinct image through the tower once per forward, however many rows show it);
- the 3-D rotary positions (M-RoPE: time, height, width for image patches; one count for text), from
  the model's own `get_rope_index`.
Pixels come from the model directory's image processor, one `Picture` per image hash, cached.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from asyncrl.vision.images import BadImage, decode

CACHED_PICTURES = 512  # processed images a process keeps (a prompt's G samples and their batch reuse one)


def is_vision(config) -> bool:
    """Whether a model config is a vision-language model's this module can feed (Qwen2-VL family)."""
    return getattr(config, "vision_config", None) is not None \
        and getattr(config, "image_token_id", None) is not None


def placeholders(config) -> list[int]:
    """The token ids that stand for images and videos in a prompt: never sampled by the engine, and left
    out of the trainer's distribution the same way (a policy that sampled one would put an "image" where
    none is; a random or collapsed one does). [] for a text-only model."""
    if not is_vision(config):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, n, None) for n in names) if i is not None]


@dataclass(frozen=True, eq=False)
class Picture:
    digest: str
    pixels: torch.Tensor  # [patches, channels × temporal × patch²], as the processor flattens them
    grid: torch.Tensor  # [3]: temporal, height, width patches


class Pictures:
    """Processed images by content hash: the processor's output for each, made once and kept (LRU)."""

    def __init__(self, model_path: str | Path, config):
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_path))
        except OSError as e:
            raise FileNotFoundError(f"{model_path}: a vision-language model needs its image processor "
                                    f"(preprocessor_config.json): {e}") from None
        self.merge = config.vision_config.spatial_merge_size
        self.cache: OrderedDict[str, Picture] = OrderedDict()

    def get(self, digest: str, data: bytes | Callable[[], bytes]) -> Picture:
        """The image `digest` processed; `data` (its bytes, or a function that reads them) is only read
        on a miss."""
        if digest in self.cache:
            self.cache.move_to_end(digest)
            return self.cache[digest]
        image = decode(data() if callable(data) else data)
        out = self.processor(images=[image], return_tensors="pt")
        picture = Picture(digest, out["pixel_values"], out["image_grid_thw"][0])
        self.cache[digest] = picture
        if len(self.cache) > CACHED_PICTURES:
            self.cache.popitem(last=False)
        return picture

    def tokens(self, picture: Picture) -> int:
        """How many `<|image_pad|>` tokens the image takes in the prompt."""
        return int(picture.grid.prod()) // self.merge**2


def placeholder_text(tokenizer, config, images: int) -> str:
    """The text of `images` image placeholders, each one pad wide (expand() widens them)."""
    start, pad, end = tokenizer.convert_ids_to_tokens(
        [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id])
    return (start + pad + end) * images


def expand(ids: list[int], widths: list[int], image_token: int) -> list[int]:
    """`ids` with the k-th image pad repeated widths[k] times; BadImage when the prompt holds another
    number of image pads than it has images."""
    found = ids.count(image_token)
    if found != len(widths):
        raise BadImage(f"the prompt has {found} image placeholders for {len(widths)} images")
    out, k = [], 0
    for token in ids:
        if token == image_token:
            out.extend([token] * widths[k])
            k += 1
        else:
            out.append(token)
    return out


def embed(model, ids: torch.Tensor, rows: list[list[Picture]]) -> torch.Tensor:
    """[B, T, hidden] input embeddings of `ids`, each row's images' features over its image pads (in
    order). Each distinct image goes through the vision tower once."""
    embeds = model.get_input_embeddings()(ids)
    shown = [p for pictures in rows for p in pictures]
    if not shown:
        return embeds
    distinct = list({p.digest: p for p in shown}.values())
    device = embeds.device
    features = model.model.get_image_features(
        torch.cat([p.pixels for p in distinct]).to(device, model.model.visual.dtype),
        torch.stack([p.grid for p in distinct]).to(device), return_dict=True).pooler_output
    by_digest = {p.digest: f for p, f in zip(distinct, features)}
    ordered = torch.cat([by_digest[p.digest] for p in shown]).to(embeds.dtype)
    pads = (ids == model.config.image_token_id)[..., None]
    if int(pads.sum()) != ordered.shape[0]:
        raise BadImage(f"{int(pads.sum())} image pad tokens for {ordered.shape[0]} image features")
    return embeds.masked_scatter(pads, ordered)


def positions(model, ids: torch.Tensor, mask: torch.Tensor, rows: list[list[Picture]]) -> torch.Tensor:
    """[3, B, T] M-RoPE positions of `ids` (padding where mask is 0 gets 0), by the model's own rule."""
    grids = [p.grid for pictures in rows for p in pictures]
    image_token = model.config.image_token_id
    return model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == image_token).int(),
        image_grid_thw=torch.stack(grids).to(ids.device) if grids else None, attention_mask=mask)[0]


def inputs(model, ids: torch.Tensor, mask: torch.Tensor, rows: list[list[Picture]]) -> dict:
    """A forward's keyword arguments for these rows: embeddings and 3-D positions in place of ids."""
    return {"inputs_embeds": embed(model, ids, rows), "position_ids": positions(model, ids, mask, rows)}


def picture_loader(model_path: str | Path, config, run_dir: str | Path) -> Callable[[str], Picture] | None:
    """hash -> Picture from the run's image store, for a vision-language policy (None otherwise)."""
    from asyncrl.vision.images import ImageStore

    if not is_vision(config):
        return None
    pictures, store = Pictures(model_path, config), ImageStore(run_dir)
    return lambda digest: pictures.get(digest, lambda: store.get(digest))
