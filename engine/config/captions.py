"""data.captioner: the vision-language model that writes captions (data.captions: auto, files-else-auto).

The captioner is part of the job's identity: another model, prompt, style or token budget writes other captions,
which train other weights. Its batch size is not (engine/captioning/stage.py batches by position in the list of
images to caption, so one batch size always writes the same captions; another may differ in the last float bits).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.declare import VIDEO_FAMILIES, Strict, key

# A small open VLM that fits beside training on a 24 GB card (about 4.5 GB in bf16); its processor needs
# torchvision: pip install 'lorad[captions]' (docs/captions.md).
DEFAULT_CAPTIONER = "Qwen/Qwen3-VL-2B-Instruct"

PROMPTS = {
    "sentence": "Describe this image in one or two plain sentences: the subject, what it does, the setting, the "
                "style. Do not start with 'The image shows'.",
    "tags": "List the visible content of this image as short comma-separated tags, most important first.",
}
# A clip's frames are several images in one prompt (engine/captioning/frames.py), in order.
CLIP_PROMPTS = {
    "sentence": "These images are frames of one video clip, in order. Describe the clip in one or two plain "
                "sentences: the subject, what it does, the setting, the style. Do not start with 'The video shows'.",
    "tags": "These images are frames of one video clip, in order. List the visible content and the motion as short "
            "comma-separated tags, most important first.",
}


class CaptionerConfig(Strict):
    model: str = Field(DEFAULT_CAPTIONER, min_length=1, max_length=500,
                       description="a transformers vision-language model: hub id, local directory or builtin:tiny-captioner")
    revision: str | None = Field(None, max_length=200)
    # None: the style's own prompt. `{trigger}` in it is replaced by data.trigger (or removed with no trigger).
    prompt: str | None = Field(None, min_length=1, max_length=2000)
    style: Literal["sentence", "tags"] = "sentence"
    max_tokens: int = Field(96, ge=4, le=1024)
    batch_size: int = key(4, ge=1, le=256, identity=False)
    # Video families: frames sampled evenly over each clip (first to last), given to the model as that many
    # images in one prompt. A still is one image.
    frames: int = key(4, ge=1, le=32, families=VIDEO_FAMILIES)
    # Stop after the caption stage, held (paused) for a person to read and edit the captions; `lorad resume`
    # trains on them. Not identity: the edits made during the hold are (engine/config/caption_edits.py).
    hold_for_review: bool = key(False, identity=False)

    def full_prompt(self, trigger: str | None, clips: bool = False) -> str:
        text = self.prompt if self.prompt is not None else (CLIP_PROMPTS if clips else PROMPTS)[self.style]
        return " ".join(text.replace("{trigger}", trigger or "").split())
