"""Task rows with images made into prompts: the images' placeholders in the user turn, widened to
each image's token count, the images stored by hash. The prompt's ids then say everything the engine
and the trainer need but the pixels, which they fetch by the hashes the row now carries."""
from __future__ import annotations

from pathlib import Path

from asyncrl.vision.images import ImageStore, image_bytes
from asyncrl.vision.inputs import Pictures, expand, is_vision, placeholder_text


class ImagePrompts:
    """Prompts with images for one vision-language policy; `store` keeps the images (by default in
    memory: the warm start's)."""

    def __init__(self, model_path: str | Path, config, tokenizer, store: ImageStore | None = None):
        self.config, self.tokenizer = config, tokenizer
        self.store = store or ImageStore(None)
        self.pictures = Pictures(model_path, config)
        self.pad = config.image_token_id

    def shown(self, hashes: list[str]) -> tuple:
        """The Pictures of these stored images."""
        return tuple(self.pictures.get(h, lambda h=h: self.store.get(h)) for h in hashes)

    def marker(self) -> str:
        """One image's placeholder text (one pad wide: `widen` makes it the image's width)."""
        return placeholder_text(self.tokenizer, self.config, 1)

    def prompt(self, tasks, entry: dict, refs: list) -> tuple[list[int], list[str]]:
        """(prompt ids, image hashes) of a row showing `refs`; BadImage for an image that does not
        decode, is too large or is missing."""
        marked = {**entry, "question": self.marker() * len(refs) + entry["question"]}
        return self.widen(tasks.prompt_ids(marked, self.tokenizer), refs)

    def widen(self, ids: list[int], refs: list) -> tuple[list[int], list[str]]:
        """(`ids` with the k-th image pad widened to image k's tokens, the images' hashes), the images
        stored; `refs` as image_bytes takes them."""
        datas = [image_bytes(ref) for ref in refs]
        hashes = [self.store.put(d) for d in datas]
        widths = [self.pictures.tokens(self.pictures.get(h, d)) for h, d in zip(hashes, datas)]
        return expand(ids, widths, self.config.image_token_id), hashes


def image_prompts(model_path: str | Path, tokenizer, run_dir: str | Path | None = None
                  ) -> ImagePrompts | None:
    """The policy's ImagePrompts, storing into the run's image store; None for a text-only policy."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    if not is_vision(config):
        return None
    return ImagePrompts(model_path, config, tokenizer, ImageStore(run_dir))
