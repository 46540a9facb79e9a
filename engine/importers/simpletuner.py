"""bghira/SimpleTuner: config.json (keys plain or `--`-prefixed, as its command line), and the data backend file it
names (`data_backend_config`, a multidatabackend.json list). Keys are without `--`; a backend's are `backends[].*`
(the first image backend; text-embed and other backends are the cache's business here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.importers import common as c
from engine.importers import text_encoders as te
from engine.importers.table import (
    NO_FEATURE,
    CarriedIn,
    Context,
    Imported,
    Key,
    NotCarried,
    Problem,
    apply,
    carried_in,
    flatten,
    not_applicable,
    other_way,
)

NAME = "simpletuner"
# model_family (simpletuner/helpers/models/model_metadata.json; hunyuanvideo is HunyuanVideo 1.5 there) → family.
# ltxvideo2 is LTX-2 (its 2.3-* and 2.5-* flavours refused); ltxvideo, LTX-Video, is refused by name.
FAMILIES = {"flux": "flux", "flux2": "flux2", "chroma": "chroma", "qwen_image": "qwen_image", "z_image": "z_image",
            "wan": "wan", "hunyuanvideo": "hunyuan_video", "krea2": "krea2", "sdxl": "sdxl",
            "ideogram": "ideogram4", "hidream": "hidream", "ltxvideo2": "ltx2"}


def detect(doc: Any) -> bool:
    return isinstance(doc, dict) and any(k.lstrip("-") in ("model_family", "data_backend_config") for k in doc)


def _family(v: Any, ctx: Context) -> str:
    fam = FAMILIES.get(str(v).lower())
    if fam is None:
        raise c.unsupported("model_family", str(v))
    return fam


# SimpleTuner's flavours → the hub repository it loads for them (each model.py's HUGGINGFACE_PATHS; only used when
# the config names no model path), and each family's DEFAULT_MODEL_FLAVOUR. Flavours lorad's families do not train
# (Wan 2.1's image-to-video, Wan 2.2 I2V-A14B, VACE, ...) are refused.
FLAVOURS = {
    ("flux", "dev"): "black-forest-labs/FLUX.1-dev", ("flux", "schnell"): "black-forest-labs/FLUX.1-schnell",
    ("flux", "krea"): "black-forest-labs/FLUX.1-Krea-dev", ("flux", "kontext"): "black-forest-labs/FLUX.1-Kontext-dev",
    ("flux2", "dev"): "black-forest-labs/FLUX.2-dev", ("flux2", "klein-4b"): "black-forest-labs/FLUX.2-klein-base-4B",
    ("flux2", "klein-9b"): "black-forest-labs/FLUX.2-klein-base-9B",
    ("chroma", "base"): "lodestones/Chroma1-Base", ("chroma", "hd"): "lodestones/Chroma1-HD",
    ("chroma", "flash"): "lodestones/Chroma1-Flash",
    ("qwen_image", "v1.0"): "Qwen/Qwen-Image", ("qwen_image", "v2.0"): "Qwen/Qwen-Image-2512",
    ("qwen_image", "edit-v1"): "Qwen/Qwen-Image-Edit", ("qwen_image", "edit-v2"): "Qwen/Qwen-Image-Edit-2509",
    ("qwen_image", "edit-v2+"): "Qwen/Qwen-Image-Edit-2509", ("qwen_image", "edit-v3"): "Qwen/Qwen-Image-Edit-2511",
    ("z_image", "base"): "Tongyi-MAI/Z-Image", ("z_image", "turbo"): "Tongyi-MAI/Z-Image-Turbo",
    ("wan", "t2v-480p-1.3b-2.1"): "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    ("wan", "t2v-480p-14b-2.1"): "Wan-AI/Wan2.1-T2V-14B-Diffusers",
    ("wan", "ti2v-5b-2.2"): "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    ("hunyuanvideo", "t2v-480p"): "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
    ("hunyuanvideo", "t2v-720p"): "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
    ("krea2", "raw"): "krea/Krea-2-Raw", ("krea2", "turbo"): "krea/Krea-2-Turbo",
    ("sdxl", "base-1.0"): "stabilityai/stable-diffusion-xl-base-1.0",
    ("hidream", "full"): "HiDream-ai/HiDream-I1-Full", ("hidream", "dev"): "HiDream-ai/HiDream-I1-Dev",
    ("hidream", "fast"): "HiDream-ai/HiDream-I1-Fast",
    # LTX-2's fp4 and fp8 flavours are its weights in another precision; lorad reads the repository's bf16
    ("ltxvideo2", "dev"): "Lightricks/LTX-2", ("ltxvideo2", "2.0"): "Lightricks/LTX-2",
    ("ltxvideo2", "dev-fp4"): "Lightricks/LTX-2", ("ltxvideo2", "dev-fp8"): "Lightricks/LTX-2",
}
DEFAULT_FLAVOURS = {"flux": "krea", "flux2": "klein-9b", "chroma": "base", "qwen_image": "v2.0",
                    "z_image": "turbo-ostris-v2", "wan": "t2v-480p-1.3b-2.1", "hunyuanvideo": "t2v-480p",
                    "krea2": "raw", "sdxl": "base-1.0", "hidream": "full", "ltxvideo2": "dev"}


def _flavour(v: Any, ctx: Context) -> str:
    if str(ctx.source.get("model_family", "")).lower() == "ltxvideo2" and str(v).startswith(("2.3", "2.5")):
        raise c.unsupported("model_flavour", f"LTX-{v}")  # a later LTX-2, even with a model path given
    if "pretrained_model_name_or_path" in ctx.source:
        raise CarriedIn("model.path")
    repo = FLAVOURS.get((str(ctx.source.get("model_family", "")).lower(), str(v).lower()))
    if repo is None:
        raise Problem(f"{v}: a flavour lorad does not train or whose model it does not know; set "
                      "pretrained_model_name_or_path")
    return repo


def _is_i2v(v: Any, ctx: Context) -> None:
    """true (SimpleTuner's default for ltxvideo2's video backends): not carried over, lorad's ltx2 trains
    text-to-video; false: what lorad does."""
    if v:
        raise NotCarried(f"{NO_FEATURE} (image-to-video conditioning on the first frame; lorad's ltx2 trains "
                         "text-to-video)")
    return None


def _model_type(v: Any, ctx: Context) -> None:
    if str(v).lower() != "lora":
        raise Problem(f"{v}: lorad trains LoRA adapters only (model_type lora)")
    raise CarriedIn("lora.type")


def _lora_type(v: Any, ctx: Context) -> None:
    if str(v).lower() == "standard":
        raise CarriedIn("lora.type")
    raise NotCarried(other_way("lora.type", "LyCORIS through lycoris_config"))


def _lycoris(v: Any, ctx: Context) -> str:
    try:
        cfg = json.loads(ctx.read(Path(c.local_path(v, ctx))))
    except (OSError, ValueError) as e:
        raise NotCarried(not_applicable(f"the LyCORIS config could not be read: {e}")) from None
    algo = str(cfg.get("algo", "lora")).lower()
    if algo not in ("lora", "lokr", "loha", "locon"):
        raise NotCarried(f"{NO_FEATURE} (LyCORIS algo {algo})")
    lora = ctx.job.setdefault("lora", {})
    for k, val in cfg.items():  # the LyCORIS file's own settings: carried beside lora.type, or listed
        if k == "algo":
            continue
        if k == "factor" and algo == "lokr":
            lora["factor"], ctx.origin["lora.factor"] = int(val), f"{v}: factor = {val}"
        elif k == "linear_dim" and int(val) <= 1024:
            lora["rank"], ctx.origin["lora.rank"] = int(val), f"{v}: linear_dim = {val}"
        elif k == "linear_alpha" and int(cfg.get("linear_dim", 0)) <= 1024:
            lora["alpha"], ctx.origin["lora.alpha"] = float(val), f"{v}: linear_alpha = {val}"
        elif k == "multiplier":
            ctx.dropped.append((f"lycoris_config.{k}", val, not_applicable("the LoRA's weight when it is used")))
        else:
            ctx.dropped.append((f"lycoris_config.{k}", val, f"{NO_FEATURE}" + (
                " (a rank above 1024, LyCORIS's full matrix; lora.rank's default is used)"
                if k in ("linear_dim", "linear_alpha") else "")))
    return "lora" if algo == "locon" else algo


def _precision(v: Any, ctx: Context) -> str | None:
    s = str(v).lower()
    for needle in ("fp8", "int8", "nf4"):
        if needle in s:
            return needle
    if s == "no_change":
        return None
    raise NotCarried(f"{NO_FEATURE} (base_model_precision {v}; model.base_precision: fp8, int8, nf4)")


def _dora(v: Any, ctx: Context) -> str | None:
    return "dora" if v else None


def _ema(v: Any, ctx: Context) -> dict | None:
    return {} if v else None


def _ema_decay(v: Any, ctx: Context) -> float:
    if not ctx.source.get("use_ema"):
        raise NotCarried(other_way("train.ema", "use_ema is off there"))
    return c.number(v, ctx)


def _caption_strategy(v: Any, ctx: Context) -> str | None:
    s = str(v).lower()
    if s == "textfile":
        raise CarriedIn("data.caption_ext")
    if s == "instanceprompt":
        raise CarriedIn("data.trigger")  # with no caption files, lorad captions every image with the trigger
    raise NotCarried(other_way("data.caption_ext", f"captions from {v}; lorad reads IMAGE.txt files"))


def _instance_prompt(v: Any, ctx: Context) -> str:
    if str(ctx.source.get("backends[].caption_strategy", "")).lower() == "textfile":
        raise NotCarried(other_way("data.trigger", "only for caption_strategy instanceprompt there"))
    return str(v)


def _validation_prompt(v: Any, ctx: Context) -> list:
    return [str(v)]


def _res(v: Any, ctx: Context) -> list[int]:
    """area: megapixels, the side of a square of that area; pixel_area (the default): that square's side in pixels,
    as lorad's; pixel: the shorter edge, taken as the side (lorad's buckets keep the area, not the edge)."""
    rtype = str(ctx.source.get("backends[].resolution_type", ctx.source.get("resolution_type", "pixel_area"))).lower()
    if rtype == "area":
        return [int(round((float(v) * 1e6) ** 0.5))]
    return c.resolutions(v, ctx)


def _repeats(v: Any, ctx: Context) -> int | None:
    n = c.integer(v, ctx)
    return n + 1 if n > 0 else None  # SimpleTuner's repeats count the extra passes: 0 means each image once


OUTPUT = not_applicable("SimpleTuner's own output, trackers and logs; lorad writes to jobs/ID/")
CACHE = other_way("the cache", "lorad always caches latents and text embeddings, once, in its home")
BUCKETS = other_way("data.resolution", "lorad's buckets: aspect within 2:1 at the resolution's area")

TABLE: list[Key] = [
    Key("model_family", "model.family", _family, doc=", ".join(FAMILIES) + "; others refused"),
    Key("model_type", None, _model_type, doc="lora only"),
    Key("pretrained_model_name_or_path", "model.path", c.model_path),
    Key("prediction_type", "model.prediction", c.prediction_type, doc="SDXL: epsilon; v_prediction → v; unset: "
        "the base's scheduler decides, as there"),
    Key("rescale_betas_zero_snr", None, c.zero_snr, doc="carried in model.prediction: v"),
    Key("model_flavour", "model.path", _flavour, doc="without a model path: the flavour's hub id"),
    Key("lora_type", None, _lora_type),
    Key("lycoris_config", "lora.type", _lycoris, doc="its algo (lokr, loha, lora) and factor"),
    Key("use_dora", "lora.type", _dora),
    Key("lora_rank", "lora.rank", c.integer),
    Key("lora_alpha", "lora.alpha", c.number),
    Key("lora_dropout", "lora.dropout", c.number),
    Key("base_model_precision", "model.base_precision", _precision, doc="*fp8* → fp8, *int8* → int8, *nf4* → nf4; "
        "no_change → lorad's auto; others not carried"),
    Key("mixed_precision", "model.dtype", c.dtype),
    Key("data_backend_config", None, why=other_way("data.path", "the backend file is read with the config")),
    Key("backends[].instance_data_dir", "data.path", c.local_path, doc="the first image backend"),
    Key("backends[].caption_strategy", None, _caption_strategy, doc="textfile → IMAGE.txt; instanceprompt → "
        "data.trigger"),
    Key("backends[].instance_prompt", "data.trigger", _instance_prompt),
    Key("instance_prompt", "data.trigger", _instance_prompt),
    Key("backends[].repeats", "data.repeats", _repeats, doc="SimpleTuner's N extra passes → N + 1"),
    Key("backends[].resolution", "data.resolution", _res, doc="pixel or area (megapixels)"),
    Key("resolution", "data.resolution", _res),
    Key("backends[].resolution_type", None, carried_in("data.resolution")),
    Key("resolution_type", None, carried_in("data.resolution")),
    Key("backends[].crop", None, why=BUCKETS), Key("backends[].crop_style", None, why=BUCKETS),
    Key("backends[].crop_aspect", None, why=BUCKETS), Key("backends[].minimum_image_size", None, why=BUCKETS),
    Key("backends[].maximum_image_size", None, why=BUCKETS), Key("backends[].target_downsample_size", None, why=BUCKETS),
    Key("backends[].id", None, why=not_applicable("a backend's name")),
    Key("backends[].type", None, why=not_applicable("lorad reads local folders")),
    Key("backends[].dataset_type", None, why=not_applicable("the image backend is the one read")),
    Key("backends[].default", None, why=not_applicable("the image backend is the one read")),
    Key("backends[].cache_dir_vae", None, why=CACHE), Key("backends[].cache_dir", None, why=CACHE),
    Key("backends[].metadata_backend", None, why=CACHE), Key("backends[].skip_file_discovery", None, why=CACHE),
    Key("backends[].disabled", None, why=not_applicable("only enabled backends are read")),
    Key("backends[].video.num_frames", "data.frames", c.ltx2_frames, doc="LTX-2: [num_frames] (8k + 1); other "
        "families not carried"),
    Key("framerate", "data.fps", c.ltx2_fps, doc="LTX-2 (default 25)"),
    Key("backends[].video.frame_rate", None, why=other_way("data.fps", "carried from framerate, which SimpleTuner "
        "reads")),
    Key("backends[].video.min_frames", None, why=other_way("data.frames", "a clip shorter than one window is "
        "refused at submit")),
    Key("backends[].video.is_i2v", None, _is_i2v),
    Key("validation_num_video_frames", None, why=other_way("data.frames", "samples are as long as the clips "
        "trained")),
    Key("caption_dropout_probability", "data.caption_dropout", c.number),
    Key("train_batch_size", "train.batch_size", c.integer),
    Key("gradient_accumulation_steps", "train.grad_accum", c.positive_int),
    Key("learning_rate", "train.lr", c.number),
    Key("train_text_encoder", "lora.text_encoder", te.switch, doc="SDXL: both CLIP encoders' LoRA"),
    Key("text_encoder_lr", "lora.text_encoder_lr", te.lr_when("train_text_encoder false"), doc="SDXL, with "
        "train_text_encoder"),
    Key("optimizer", "train.optimizer", c.optimizer),
    Key("lr_scheduler", "train.schedule", c.schedule),
    Key("lr_warmup_steps", "train.warmup_steps", c.integer),
    Key("max_grad_norm", "train.max_grad_norm", c.number),
    Key("seed", "train.seed", c.integer),
    Key("gradient_checkpointing", "train.gradient_checkpointing"),
    Key("flux_guidance_value", "train.guidance", c.number),
    Key("flow_use_uniform_schedule", "train.timestep_sampling", lambda v, ctx: "linear" if v else None),
    Key("flow_schedule_auto_shift", "train.timestep_sampling", lambda v, ctx: "shift" if v else None),
    Key("flow_schedule_shift", None, why=other_way("train.timestep_sampling", "shift uses the model's own shift")),
    Key("use_ema", "train.ema", _ema),
    Key("ema_decay", "train.ema.decay", _ema_decay),
    Key("max_train_steps", "train.steps", c.positive_int),
    Key("num_train_epochs", "train.steps", lambda v, ctx: c.steps_from_epochs(c.integer(v, ctx), ctx,
                                                                               "num_train_epochs")),
    Key("checkpointing_steps", "checkpoint.every_steps", c.positive_int),
    Key("checkpoints_total_limit", "checkpoint.keep", c.positive_int),
    Key("validation_prompt", "sample.prompts", _validation_prompt),
    Key("validation_negative_prompt", None, why=NO_FEATURE),
    Key("validation_steps", "sample.every_steps", c.positive_int),
    Key("validation_guidance", "sample.guidance", c.number),
    Key("validation_num_inference_steps", "sample.steps", c.integer),
    Key("validation_seed", "sample.seed", c.integer),
    Key("validation_resolution", "sample.width", lambda v, ctx: c.integer(str(v).split("x")[0], ctx)),
    Key("user_prompt_library", None, why=other_way("sample.prompts")),
    Key("output_dir", None, why=OUTPUT), Key("report_to", None, why=OUTPUT),
    Key("tracker_project_name", None, why=OUTPUT), Key("tracker_run_name", None, why=OUTPUT),
    Key("logging_dir", None, why=OUTPUT), Key("push_to_hub", None, why=other_way("output.push_to_hub")),
    Key("hub_model_id", "output.push_to_hub", lambda v, ctx: str(v) if ctx.source.get("push_to_hub") else None),
    Key("resume_from_checkpoint", None, why=other_way("checkpoint.every_steps", "lorad resumes by itself")),
    Key("vae_cache_ondemand", None, why=CACHE), Key("aspect_bucket_rounding", None, why=BUCKETS),
    Key("attention_mechanism", None, why=not_applicable("lorad picks the attention kernel")),
    Key("disable_benchmark", None, why=not_applicable("SimpleTuner's own start-up benchmark")),
]
# SimpleTuner's defaults (simpletuner/simpletuner_sdk/server/services/field_registry/sections/*.py, which its
# argument parser is built from) where lorad's differ and the run would change: written as if the file said them.
DEFAULTS = {"lr_scheduler": "constant_with_warmup", "learning_rate": 4e-7, "optimizer": "adamw_bf16",
            "train_batch_size": 4, "max_grad_norm": 2.0, "caption_dropout_probability": 0.1,
            "gradient_checkpointing": True}


def backends_path(doc: dict[str, Any]) -> str | None:
    v = {k.lstrip("-"): val for k, val in doc.items()}.get("data_backend_config")
    return str(v) if v else None


def read(doc: dict[str, Any], ctx: Context, out: Imported, backends: Any = None) -> None:
    args = {k.lstrip("-"): v for k, v in doc.items()}
    if backends is None and args.get("data_backend_config"):
        name = str(args["data_backend_config"])
        tried = [Path(c.local_path(name, ctx)), (ctx.base_dir.parent / name).resolve()]
        p = next((t for t in tried if t.is_file()), None)  # relative to SimpleTuner's folder, as config/ is in it
        if p is None:
            out.problems.append(f"data_backend_config: {name} not found (give it with --dataset)")
        else:
            try:
                backends = json.loads(ctx.read(p))
            except (OSError, ValueError) as e:
                out.problems.append(f"data_backend_config: {name} could not be read ({e})")
    images = [b for b in backends or [] if isinstance(b, dict) and not b.get("disabled")
              and b.get("dataset_type", "image") in ("image", "video") and "instance_data_dir" in b]
    for i, b in enumerate(images[1:], 1):
        out.drop(f"backends[{i}]", b.get("instance_data_dir"), other_way("data.path", "one image folder per job"))
    for b in backends or []:
        if isinstance(b, dict) and b.get("dataset_type") == "text_embeds":
            out.drop(f"backends[{b.get('id', 'text_embeds')}]", "text_embeds", other_way("the cache"))
    flat = flatten(args)
    if images:
        flat.update({f"backends[0].{k}": v for k, v in flatten(images[0]).items()})
        ctx.images = len(c.images_in(Path(c.local_path(images[0]["instance_data_dir"], ctx)))) or None
    defaults = dict(DEFAULTS)
    if "lora_rank" in flat and "lora_alpha" not in flat:
        defaults["lora_alpha"] = flat["lora_rank"]  # SimpleTuner's alpha is the rank when unset
    if not any(k.endswith("resolution") for k in flat):
        defaults["resolution"] = 1024
    if images and "backends[0].caption_strategy" not in flat:
        defaults["backends[0].caption_strategy"] = "filename"
    fam = str(flat.get("model_family", "")).lower()
    if "pretrained_model_name_or_path" not in flat and "model_flavour" not in flat and fam in DEFAULT_FLAVOURS:
        defaults["model_flavour"] = DEFAULT_FLAVOURS[fam]
    if fam == "ltxvideo2":
        defaults["framerate"] = 25  # ltxvideo2/model.py: framerate None → 25
        if images and "audio" not in images[0]:
            out.notes.append("backends[0] has no audio block: SimpleTuner trained LTX-2's picture alone; lorad's "
                             "ltx2 also learns the sound of each clip that has an audio track")
        if images and images[0].get("dataset_type") == "video":
            defaults["backends[0].video.is_i2v"] = True  # data_backend/factory.py, for ltxvideo and ltxvideo2
    for k, v in defaults.items():
        if k not in flat:
            flat[k] = v
            out.notes.append(f"{k} not set there: SimpleTuner's default {v} written")
    ctx.source = {**flat, **{k.replace("[0]", "[]"): v for k, v in flat.items() if "[0]" in k}}
    apply(TABLE, flat, ctx, out)
