"""The captioner: a transformers vision-language model (AutoModelForImageTextToText with its AutoProcessor),
checked before anything is loaded — a model that would run code from its repository (trust_remote_code) or that
sees no images is refused, naming data.captioner.model — then asked for greedy captions, a batch at a time.

Greedy decoding makes a caption a function of the image, the prompt and the model: a job killed mid-stage and
resumed writes the captions an uninterrupted run writes (same batches: stage.py)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from engine.errors import JobInvalid

KEY = "data.captioner.model"


def resolve(model: str, revision: str | None, workdir: Path) -> Path:
    """The captioner's local directory: builtin:NAME built once, a directory as is, a hub id downloaded (or found
    in the hub cache offline)."""
    from engine.builtin.models import BUILTIN_PREFIX, materialise
    from engine.builtin.tiny_captioner import BUILTIN_CAPTIONERS

    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_CAPTIONERS:
            raise JobInvalid(f"{KEY}: {model} is not a builtin captioner ({', '.join(BUILTIN_CAPTIONERS)})")
        return materialise(name, Path(workdir) / "builtin-models", BUILTIN_CAPTIONERS)
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision))


def check(model_dir: Path, name: str) -> None:
    """Refuse what must not or cannot caption: remote code, a model without a vision tower."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise JobInvalid(f"{KEY}: {name} has no readable config.json ({e})") from None
    if "auto_map" in config:
        raise JobInvalid(f"{KEY}: {name} needs trust_remote_code (its config.json maps classes to code in the "
                         f"repository); lorad runs no model repository's code: choose a model transformers "
                         f"supports natively")
    kind = config.get("model_type")
    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise JobInvalid(f"{KEY}: {name} is not a vision-language model (model_type {kind!r}); captions need a "
                         f"model that reads images, e.g. Qwen/Qwen3-VL-2B-Instruct")


def clean(text: str) -> str:
    """One line of printable text: a model's control characters and stray whitespace go."""
    kept = "".join(ch if unicodedata.category(ch)[0] != "C" else " " for ch in text)
    return " ".join(kept.split())


class Captioner:
    def __init__(self, model_dir: Path, name: str, device):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        check(model_dir, name)
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.processor.tokenizer.padding_side = "left"  # generation continues each row at its end
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device

    def caption(self, samples: list[list], prompt: str, max_tokens: int) -> list[str]:
        """One caption per sample: an image ([image]) or a clip's frames, several images in one prompt."""
        import torch

        texts = [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}] * len(ims) + [{"type": "text", "text": prompt}]}],
            add_generation_prompt=True) for ims in samples]
        # Nested, one list per prompt: the processors that group images by prompt (Idefics, SmolVLM) need it,
        # and the others flatten it.
        inputs = self.processor(images=samples, text=texts, return_tensors="pt", padding=True)
        inputs = inputs.to(self.device)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        return [clean(t) for t in self.processor.batch_decode(new, skip_special_tokens=True)]

    def close(self) -> None:
        import gc

        import torch

        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # training loads next, on the same card
