"""SDXL's text-encoder LoRA from each tool's switches: lora.text_encoder (LoRA on both CLIP encoders) and
lora.text_encoder_lr (their learning rate, absolute as the tools' are). lorad trains both encoders or neither, and
always the UNet; on another family a text-encoder LoRA is not a feature (lorad trains the transformer's LoRA).

What each tool trains (read in their sources): sd-scripts' sdxl_train_network trains both encoders unless
--network_train_unet_only, its networks.lora at --text_encoder_lr (a list: the first value, for both; 0: that group
is skipped, the encoders do not train), else --learning_rate, and the UNet at --unet_lr else --learning_rate.
ai-toolkit: train.train_text_encoder (off by default), its LoRA network at train.lr (train.unet_lr and
train.text_encoder_lr are its full fine-tune's). OneTrainer: text_encoder.train and text_encoder_2.train (on by
default), each at its own learning_rate else the global one. SimpleTuner: --train_text_encoder at --text_encoder_lr
else --learning_rate.
"""

from __future__ import annotations

from typing import Any

from engine.importers import common as c
from engine.importers.table import NO_FEATURE, CarriedIn, Context, NotCarried, Problem, not_applicable

NOT_SDXL = f"{NO_FEATURE} (a text-encoder LoRA; lorad trains one for SDXL only)"
NOT_TRAINED = not_applicable("the text encoders do not train there")


def on(v: Any) -> bool:
    return v is True or str(v).strip().lower() in ("true", "1", "yes", "on")


def sdxl(ctx: Context) -> bool:
    return ctx.job.get("model", {}).get("family") == "sdxl"


def switch(v: Any, ctx: Context) -> bool | None:
    """A train-the-text-encoders switch: on → lora.text_encoder: true on SDXL; off → lorad's default (false)."""
    if not sdxl(ctx):
        if on(v):
            raise NotCarried(NOT_SDXL)
        return None
    return True if on(v) else None


def lr_when(trains: str):
    """A text-encoder learning rate (absolute, as lora.text_encoder_lr) when lora.text_encoder was set true."""
    def conv(v: Any, ctx: Context) -> float | None:
        if v in (None, "", "None"):
            return None
        if not sdxl(ctx):
            raise NotCarried(NOT_SDXL)
        if ctx.job.get("lora", {}).get("text_encoder") is not True:
            raise NotCarried(not_applicable(f"the text encoders do not train there ({trains})"))
        return c.number(v, ctx)
    return conv


# ---------------------------------------------------------------- kohya sd-scripts (sdxl_train_network)
def kohya_lrs(flat: dict[str, Any], notes: list[str]) -> None:
    """SDXL's encoders train at learning_rate when unet_lr takes the UNet and text_encoder_lr is unset: that
    learning_rate is then theirs (written as text_encoder_lr, so train.lr is unet_lr's)."""
    if "unet_lr" in flat and "text_encoder_lr" not in flat and not any(
            on(flat.get(k)) for k in ("network_train_unet_only", "cache_text_encoder_outputs")):
        v = flat.pop("learning_rate", 2e-6)  # sd-scripts' default learning_rate
        flat["text_encoder_lr"] = v
        notes.append(f"text_encoder_lr not set there: sd-scripts trains the text encoders at learning_rate ({v}), "
                     "written as it")


def _kohya_first(v: Any) -> Any:
    """sd-scripts' networks.lora (SDXL's) takes the first of a list of text-encoder rates, for both encoders."""
    return (v[0] if v else None) if isinstance(v, list) else v


def kohya_unet_only(v: Any, ctx: Context) -> bool | None:
    """network_train_unet_only: SDXL's encoders train unless it is set (or text_encoder_lr is 0, a group sd-scripts
    skips; or the outputs are cached, which sd-scripts refuses with a text-encoder LoRA)."""
    if not sdxl(ctx):
        raise NotCarried(not_applicable("lorad always trains the transformer's LoRA only"))
    if on(v):
        return None
    te_lr = _kohya_first(ctx.source.get("text_encoder_lr"))
    if te_lr is not None and c.number(te_lr, ctx) == 0:
        return None
    if on(ctx.source.get("cache_text_encoder_outputs")):
        ctx.notes.append("cache_text_encoder_outputs without network_train_unet_only: sd-scripts refuses to train "
                         "the text encoders on cached outputs; lorad trains the UNet only (lora.text_encoder false)")
        return None
    return True


def kohya_te_lr(v: Any, ctx: Context) -> float | None:
    first = _kohya_first(v)
    if isinstance(v, list) and len(v) > 1:
        ctx.notes.append(f"text_encoder_lr {' '.join(map(str, v))}: sd-scripts' networks.lora trains both text "
                         f"encoders at the first, "
                         f"{first}")
    if sdxl(ctx) and first is not None and c.number(first, ctx) == 0:
        raise CarriedIn("lora.text_encoder")  # sd-scripts skips a group whose lr is 0: the encoders do not train
    return lr_when("network_train_unet_only")(first, ctx)


def kohya_te_only(v: Any, ctx: Context) -> None:
    if on(v):
        raise Problem("lorad always trains the UNet's (or transformer's) LoRA, never the text encoders alone; "
                      "leave it out to train both")
    return None


# ---------------------------------------------------------------- ai-toolkit, OneTrainer
def unet_trains(v: Any, ctx: Context) -> None:
    """ai-toolkit's train.train_unet, OneTrainer's unet.train: off trains no UNet, which lorad always trains."""
    if not on(v):
        raise Problem("false: the UNet does not train, and lorad always trains the UNet's (or transformer's) LoRA")
    return None


# The part keys OneTrainer's table reads (onetrainer.py); the other part keys are its frozen parts' precision.
ONETRAINER_ROWS = {"unet.train", *(f"{p}.{k}" for p in ("text_encoder", "text_encoder_2") for k in
                   ("train", "learning_rate", "stop_training_after", "stop_training_after_unit"))}
# OneTrainer's SDXL defaults (modules/util/config/TrainConfig.py): both encoders train, for their first 30 epochs.
ONETRAINER_DEFAULTS = {f"{p}.{k}": v for p in ("text_encoder", "text_encoder_2") for k, v in
                       (("train", True), ("stop_training_after", 30), ("stop_training_after_unit", "EPOCH"))}


def onetrainer_defaults(flat: dict[str, Any], notes: list[str]) -> None:
    unset = {k: v for k, v in ONETRAINER_DEFAULTS.items() if k not in flat}
    flat.update(unset)
    if unset:
        notes.append(f"{', '.join(unset)} not set there: OneTrainer's SDXL defaults written (the encoders train, "
                     "for their first 30 epochs)")


def onetrainer_unet(v: Any, ctx: Context) -> None:
    """OneTrainer's unet.train: SDXL's UNet (another family trains its transformer: the part is not read)."""
    if not sdxl(ctx):
        raise NotCarried(not_applicable("a frozen model part; lorad trains the transformer's LoRA"))
    return unet_trains(v, ctx)


def onetrainer_train(other: str):
    """text_encoder.train / text_encoder_2.train (OneTrainer's default: on). lorad trains both or neither: one
    alone is trained with the other, which is listed."""
    def conv(v: Any, ctx: Context) -> bool | None:
        if not sdxl(ctx):
            raise NotCarried(not_applicable("a frozen model part; lorad trains the transformer's LoRA"))
        if not on(v):
            if on(ctx.source.get(other, True)):
                raise NotCarried(f"{NO_FEATURE} (one text encoder alone: lora.text_encoder trains both)")
            return None
        if "lora.text_encoder" in ctx.origin:
            raise CarriedIn("lora.text_encoder")
        return True
    return conv


def onetrainer_lr(other: str):
    """text_encoder(_2).learning_rate (null: the global learning_rate): one lorad rate for both encoders."""
    def conv(v: Any, ctx: Context) -> float | None:
        got = lr_when("text_encoder.train, text_encoder_2.train false")(v, ctx)
        if got is None:
            return None
        done = ctx.job.get("lora", {}).get("text_encoder_lr")
        if "lora.text_encoder_lr" in ctx.origin:
            if done == got:
                raise CarriedIn("lora.text_encoder_lr")
            raise NotCarried(f"{NO_FEATURE} (a learning rate for each encoder: lora.text_encoder_lr is both's, "
                             f"{done})")
        return got
    return conv


def onetrainer_stop(part: str):
    """text_encoder(_2).stop_training_after and its unit (OneTrainer's default: 30 epochs): lorad has no stop."""
    def conv(v: Any, ctx: Context) -> None:
        if not sdxl(ctx):
            raise NotCarried(not_applicable("a frozen model part; lorad trains the transformer's LoRA"))
        n, unit = ctx.source.get(f"{part}.stop_training_after"), ctx.source.get(f"{part}.stop_training_after_unit")
        unit = str(unit).upper()
        if n is None or unit == "NEVER" or (unit == "EPOCH" and c.integer(n, ctx) >= c.integer(
                ctx.source.get("epochs", 100), ctx)):
            return None  # no stop, or none within the run
        if ctx.job.get("lora", {}).get("text_encoder") is not True:
            raise NotCarried(NOT_TRAINED)
        raise NotCarried(f"{NO_FEATURE} (the text encoders stopping after {n} × {unit}; lorad trains "
                         "them to the end)")
    return conv
