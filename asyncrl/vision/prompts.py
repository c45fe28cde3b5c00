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

    def shown(self, hashes: list[str]) -> tuple:
        """The Pictures of these stored images."""
        return tuple(self.pictures.get(h, lambda h=h: self.store.get(h)) for h in hashes)

    def prompt(self, tasks, entry: dict, refs: list) -> tuple[list[int], list[str]]:
        """(prompt ids, image hashes) of a row showing `refs`; BadImage for an image that does not
        decode, is too large or is missing."""
        datas = [image_bytes(ref) for ref in refs]
        hashes = [self.store.put(d) for d in datas]
        markers = placeholder_text(self.tokenizer, self.config, len(refs))
        marked = {**entry, "question": markers + entry["question"]}
        ids = tasks.prompt_ids(marked, self.tokenizer)
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
