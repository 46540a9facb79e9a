"""data: what a job trains on; text keys for causal_lm, image keys for the image families."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from engine.config.captions import CaptionerConfig
from engine.config.declare import (
    EDIT_FAMILIES,
    IMAGE_FAMILIES,
    LM,
    PARTS,
    STILL_FAMILIES,
    VIDEO_FAMILIES,
    Strict,
    key,
)


class MaskConfig(Strict):
    """Image families: a per-image loss mask (engine/data/masks.py): a folder of same-name masks, or the alpha channel."""

    path: str | None = None
    alpha: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (not self.alpha):
            raise ValueError("give exactly one of path (a folder of masks named like the images) or alpha: true")
        return self


class RegularisationConfig(Strict):
    """Image families: a second image folder (class images, own captions) mixed into the order with its own loss weight."""

    path: str
    weight: float = Field(1.0, gt=0.0, le=100.0)
    repeats: int = Field(1, ge=1, le=10000)


class ValidationConfig(Strict):
    """A fixed validation set, its loss reported every_steps (engine/training/heldout.py).

    Validation only reads the weights; a held-out fraction changes the training set, so only it is identity.
    """

    path: str | None = key(None, identity=False)  # a separate dataset in data.path's format
    fraction: float | None = Field(None, gt=0.0, lt=1.0)  # or this share of data.path, held out by train.seed
    every_steps: int = key(100, ge=1, le=10_000_000, identity=False)
    # batches of train.batch_size samples per evaluation; null = the whole set
    batches: int | None = key(None, ge=1, identity=False)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.fraction is None):
            raise ValueError("give exactly one of path (a separate dataset) or fraction (held out of data.path)")
        return self


class DataConfig(Strict):
    path: str = Field(description="a .jsonl file, a .txt file, or a directory of .txt files (causal_lm); a folder of images (flux)")
    # causal_lm only
    text_field: str = key("text", families=LM)
    seq_len: int = key(256, ge=8, le=131072, families=LM)
    packing: bool = key(True, families=LM)
    # Which tokens carry the loss: completions = the assistant turns of chat data (its default), all = every token
    # (the only choice, and the default, for plain text). Unset = by the data's format.
    train_on: Literal["completions", "all"] | None = key(None, families=LM)
    # image families only (engine/data/images.py): aspect-ratio buckets around each resolution, captions from
    # IMAGE.<caption_ext>
    resolution: list[Annotated[int, Field(ge=32, le=4096)]] = key(default_factory=lambda: [512], min_length=1,
                                                                  families=IMAGE_FAMILIES)
    trigger: str | None = key(None, max_length=200, families=IMAGE_FAMILIES)
    caption_ext: str = key("txt", pattern=r"^[A-Za-z0-9_]{1,16}$", families=IMAGE_FAMILIES)
    caption_dropout: float = key(0.0, ge=0.0, le=1.0, families=IMAGE_FAMILIES)
    # Captions written by a vision-language model as the job's first stage (engine/captioning/): `auto` for every
    # image, `files-else-auto` for those without a caption file; kept in the home's cache, never in data.path.
    # (None is `files`, as None is `off` for dedupe: a key some families do not read yet is unset there, not set)
    # A clip is captioned from data.captioner.frames frames sampled evenly over it (engine/captioning/frames.py).
    captions: Literal["files", "auto", "files-else-auto"] | None = key(None, families=IMAGE_FAMILIES,
                                                                        dump_default=False)
    captioner: CaptionerConfig | None = key(None, families=IMAGE_FAMILIES, dump_default=False)
    # Near-duplicate images (perceptual hashes, engine/captioning/dedupe.py): listed (warn), or one kept (skip);
    # clips by the hashes of their sampled frames.
    dedupe: Literal["off", "warn", "skip"] | None = key(None, families=IMAGE_FAMILIES, dump_default=False)
    flip: bool = key(False, families=IMAGE_FAMILIES)
    repeats: int = key(1, ge=1, le=10000, families=IMAGE_FAMILIES)
    # the image families' quality features (engine/data/image_sets.py)
    masks: MaskConfig | None = key(None, families=IMAGE_FAMILIES, read_by=STILL_FAMILIES)
    regularisation: RegularisationConfig | None = key(None, families=IMAGE_FAMILIES, read_by=STILL_FAMILIES)
    # the video families (engine/data/videos.py): clips resampled to fps, cut into windows of each length in frames
    fps: float = key(16.0, gt=0.0, le=240.0, families=VIDEO_FAMILIES)
    frames: list[Annotated[int, Field(ge=1, le=1025, multiple_of=1)]] = key(
        default_factory=lambda: [33], min_length=1, families=VIDEO_FAMILIES)
    # edit LoRAs (engine/config/controls.py): the control (input) image(s) of each target, by file stem; a list is one
    # folder per reference slot. Only edit bases read them (its EDIT_PIPELINES).
    control_path: (str | Annotated[list[str], Field(min_length=1, max_length=4)] | None) = key(
        None, families=IMAGE_FAMILIES, read_by=EDIT_FAMILIES, dump_default=False)
    validation: ValidationConfig | None = key(None, identity=PARTS)

    @property
    def caption_mode(self) -> str:
        return self.captions or "files"

    @property
    def dedupe_mode(self) -> str:
        return self.dedupe or "off"

    def captioner_or_default(self) -> CaptionerConfig:
        return self.captioner if self.captioner is not None else CaptionerConfig()

    @model_validator(mode="after")
    def _captioner_with_auto_captions(self):
        if self.captioner is not None and self.caption_mode == "files":
            raise ValueError("captioner: set data.captions to auto or files-else-auto to use it (it is files, "
                             "which reads caption files only)")
        return self

    @model_validator(mode="after")
    def _frames_fit_the_vae(self):
        if bad := [f for f in self.frames if f % 4 != 1]:
            raise ValueError(f"frames: {bad} are not 4k + 1 (1, 5, 9, ..., 33, ..., 81), what the video VAEs encode")
        return self

    def control_paths(self) -> list[str]:
        """data.control_path as a list of folders, one per reference slot (empty: not an edit job)."""
        cp = self.control_path
        return [] if cp is None else [cp] if isinstance(cp, str) else list(cp)
