"""kohya-ss sd-scripts and musubi-tuner: a training config (`--config_file` TOML, or a saved command line), and the
dataset config TOML it names (`--dataset_config`) or that is given on its own (`--dataset`).

musubi-tuner shares sd-scripts' argument names and dataset TOML shape (image_directory for image_dir); the two
differ in their script names, which are what name the model family. Keys are the argument names without `--`;
the dataset TOML's are `general.*`, `datasets[].*` and `datasets[].subsets[].*` (musubi's datasets are flat).
A `train_data_dir` is read in kohya's folder layout: sub-folders `N_name`, N the repeats, name the caption of
the images that have no caption file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from engine.importers import common as c
from engine.importers import text_encoders as te
from engine.importers.kohya_args import (  # noqa: F401 — re-exported: the importers' entry reads them here
    MODULES,
    MUSUBI_SCRIPTS,
    SCRIPTS,
    _kv_list,
    config_flat,
    is_config_toml,
    parse_command_line,
)
from engine.importers.kohya_dataset import (
    count_images,
    read_dataset,
    repeat_folders,
)
from engine.importers.table import (
    NO_FEATURE,
    NULL,
    CarriedIn,
    Context,
    Imported,
    Key,
    NotCarried,
    Problem,
    apply,
    carried_in,
    not_applicable,
    other_way,
)

NAME = "kohya"
MUSUBI = "musubi-tuner"
def _module(v: Any, ctx: Context) -> None:
    if ctx.origin.get("model.family", "").startswith("network_module"):
        return None  # the family's own origin names it already
    if str(v).startswith("lycoris"):
        raise CarriedIn("lora.type")
    raise CarriedIn("model.family")


def _rank(v: Any, ctx: Context) -> int:
    n = c.integer(v, ctx)
    if n > 1024:  # LyCORIS's "full dimension" idiom for LoKr (network_dim = 10000)
        raise NotCarried(f"{NO_FEATURE} (a rank above 1024, LyCORIS's full matrix; lora.rank's default is used)")
    return n


def _algo(v: Any, ctx: Context) -> str:
    a = str(v).lower()
    if a in ("lora", "locon"):
        return "lora"
    if a in ("lokr", "loha"):
        return a
    raise NotCarried(f"{NO_FEATURE} (LyCORIS algo {v}; lora.type: lora, dora, lokr, loha)")


def _dora(v: Any, ctx: Context) -> str | None:
    return "dora" if str(v).lower() in ("true", "1") else None


def _grad_norm(v: Any, ctx: Context) -> Any:
    n = c.number(v, ctx)
    return NULL if n == 0 else n  # 0 turns clipping off there; null does here


def _use_8bit(v: Any, ctx: Context) -> str | None:
    return "adamw8bit" if v else None


def _precision_fp8(v: Any, ctx: Context) -> str | None:
    return "fp8" if v else None


def _mixed(v: Any, ctx: Context) -> str:
    return c.dtype(v, ctx)


def _warmup(v: Any, ctx: Context) -> int:
    f = c.number(v, ctx)
    if 0 < f < 1:
        raise NotCarried(other_way("train.warmup_steps", "a fraction of the run there; give steps"))
    return int(f)


def _epochs(what: str):
    def conv(v: Any, ctx: Context) -> int:
        return c.steps_from_epochs(c.integer(v, ctx), ctx, what)
    return conv


def _every_epochs(what: str):
    def conv(v: Any, ctx: Context) -> int:
        per = c.steps_from_epochs(1, ctx, what)
        return per * c.integer(v, ctx)
    return conv


def _resolution(v: Any, ctx: Context) -> list[int]:
    """sd-scripts' and musubi-tuner's resolution is one size: 512, "768,512" or [960, 544] (W, H)."""
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return [c.side(int(v[0]), int(v[1]))]
    return c.resolutions(v, ctx)


def _timesteps(v: Any, ctx: Context) -> str:
    """kohya's timestep_sampling: sigma draws t uniformly, then the scheduler's discrete_flow_shift moves it (sd-scripts'
    default shift 3.0: toward high noise, as lorad's shift; musubi-tuner's 1.0: not moved, lorad's linear)."""
    name = str(v).lower()
    if name == "sigma":
        return "shift" if c.number(ctx.source.get("discrete_flow_shift", 1.0), ctx) > 1.0 else "linear"
    if name in ("flux2_shift", "qwen_shift", "krea2_shift", "ideogram4_shift"):
        return "shift"  # the model's own resolution-dependent shift, as lorad's shift
    return c.timestep_sampling(v, ctx)


def _task(v: Any, ctx: Context) -> str:
    """musubi-tuner's Wan --task (wan/configs: t2v-1.3B, t2v-14B, t2v-A14B, i2v-A14B, ...): t2v-* → t2v."""
    t = str(v)
    if t.startswith("t2v-") and not t.endswith("-FC"):
        return "t2v"
    if t == "i2v-A14B":
        raise Problem(f"{t}: Wan 2.2 I2V-A14B (an image input of its own) is not among lorad's Wan models "
                      "(TI2V-5B, T2V-A14B)")
    raise NotCarried(f"{NO_FEATURE} (Wan task {t}; model.task: t2v, i2v as Wan 2.2 trains it)")


def _expert(v: Any, ctx: Context) -> str | None:
    """Wan 2.2 A14B: --dit the low-noise expert and --dit_high_noise the high-noise one → both; --dit alone names
    one expert by its file (…_high_noise_… / …_low_noise_…)."""
    if not str(ctx.source.get("task", "")).endswith("A14B"):
        return None  # one transformer: no expert to pick
    if ctx.source.get("dit_high_noise"):
        return "both"
    name = Path(str(v)).name.lower()
    return "high" if "high_noise" in name else "low" if "low_noise" in name else None


def _class_tokens(v: Any, ctx: Context) -> str:
    if ctx.images is not None and ctx.source.get("_every_image_captioned"):
        raise NotCarried(other_way("data.trigger", "there, class_tokens only captions images without a caption "
                                   "file, and every image has one; data.trigger would be added to each"))
    return str(v)


def _sample_prompts(v: Any, ctx: Context) -> list:
    """sd-scripts' prompt file: one prompt a line, `--n` negative, `--d` seed (other options left to sample.*)."""
    p = Path(c.local_path(v, ctx))
    try:
        text = ctx.read(p)
    except OSError as e:
        raise NotCarried(f"{not_applicable('the prompt file could not be read: ' + (e.strerror or str(e)))}") from None
    out: list = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        prompt, *opts = re.split(r"\s--(?=[a-z]+\s)", line)
        entry: dict[str, Any] = {"prompt": prompt.strip()}
        for o in opts:
            flag, _, val = o.partition(" ")
            if flag == "n":
                entry["negative"] = val.strip()
            elif flag == "d" and val.strip().isdigit():
                entry["seed"] = int(val.strip())
        out.append(entry if len(entry) > 1 else entry["prompt"])
    return out[:64]


OUTPUT = not_applicable("the other tool's output, names and logs; lorad writes to jobs/ID/")
CACHE = other_way("the cache", "lorad always caches latents and text embeddings, once, in its home")
PARTS = other_way("model.path", "lorad reads the VAE and text encoders from the model's diffusers directory")
BUCKETS = other_way("data.resolution", "lorad's buckets: aspect within 2:1 at the resolution's area, always on")

TABLE: list[Key] = [
    Key("_script", "model.family", doc="the training script: flux_train_network → flux, wan_train_network → wan, "
        "qwen_image_train_network → qwen_image, zimage_train_network → z_image, hv_1_5_train_network → "
        "hunyuan_video, sdxl_train_network → sdxl; sd/sd3/lumina/FramePack/HunyuanVideo 1.0 refused"),
    Key("network_module", None, _module, doc="networks.lora_flux and the like name the family; lycoris.kohya "
        "takes the adapter from network_args"),
    Key("pretrained_model_name_or_path", "model.path", c.model_path, doc="a hub id or a diffusers folder; the "
        "official FLUX.1 single files become their hub id"),
    Key("dit", "model.path", c.model_path, doc="musubi-tuner's DiT weights (Wan 2.2 A14B: the low-noise expert)"),
    Key("task", "model.task", _task, doc="musubi-tuner's Wan task: t2v-* → t2v; i2v-A14B refused"),
    Key("_dit_expert", "model.expert", _expert, doc="Wan 2.2 A14B: dit + dit_high_noise → both; a dit file named "
        "*high_noise* / *low_noise* → that expert"),
    Key("dit_high_noise", None, carried_in("model.expert")),
    Key("timestep_boundary", None, why=other_way("model.expert", "the boundary is the model's own boundary_ratio")),
    Key("offload_inactive_dit", None, why=not_applicable("lorad plans memory itself")),
    Key("min_timestep", None, why=other_way("model.expert, train.timestep_bias")),
    Key("max_timestep", None, why=other_way("model.expert, train.timestep_bias")),
    Key("preserve_distribution_shape", None, why=other_way("model.expert", "an expert's σ is drawn from its side "
        "of the boundary")),
    Key("ae", None, why=PARTS), Key("vae", None, why=PARTS), Key("clip_l", None, why=PARTS),
    Key("t5xxl", None, why=PARTS), Key("t5", None, why=PARTS), Key("text_encoder", None, why=PARTS),
    Key("text_encoder1", None, why=PARTS), Key("text_encoder2", None, why=PARTS), Key("clip", None, why=PARTS),
    Key("mixed_precision", "model.dtype", _mixed),
    Key("fp8_base", "model.base_precision", _precision_fp8, doc="true → fp8"),
    Key("fp8_base_unet", "model.base_precision", _precision_fp8),
    Key("fp8_scaled", "model.base_precision", _precision_fp8),
    Key("full_bf16", None, why=other_way("lora.dtype")), Key("full_fp16", None, why=other_way("lora.dtype")),
    Key("network_dim", "lora.rank", _rank, doc="up to 1024 (LyCORIS's 10000, a full matrix: not carried)"),
    Key("network_alpha", "lora.alpha", c.number),
    Key("network_dropout", "lora.dropout", c.number),
    Key("network_args.algo", "lora.type", _algo),
    Key("network_args.factor", "lora.factor", c.integer),
    Key("network_args.dora_wd", "lora.type", _dora, doc="true → dora"),
    Key("network_args.conv_dim", None, why=f"{NO_FEATURE} (conv layers: lorad's transformers have none)"),
    Key("network_args.conv_alpha", None, why=f"{NO_FEATURE} (conv layers: lorad's transformers have none)"),
    Key("network_weights", None, why=f"{NO_FEATURE} (starting from a trained LoRA)"),
    Key("network_train_unet_only", "lora.text_encoder", te.kohya_unet_only, doc="SDXL: unset or false → true (both "
        "encoders train there by default); 0 as text_encoder_lr, or cached encoder outputs → false"),
    Key("network_train_text_encoder_only", None, te.kohya_te_only, doc="true: refused (lorad always trains the UNet)"),
    Key("train_data_dir", "data.path", c.local_path, doc="kohya's N_name folders: see the dataset rows"),
    Key("reg_data_dir", "data.regularisation.path", c.local_path),
    Key("dataset_config", None, why=other_way("data.path", "the dataset TOML is read with the config")),
    Key("datasets[].subsets[].image_dir", "data.path", c.local_path, doc="the first subset; the others: one "
        "folder per job"),
    Key("datasets[].image_directory", "data.path", c.local_path, doc="musubi-tuner"),
    Key("datasets[].video_directory", "data.path", c.local_path, doc="musubi-tuner"),
    Key("_folder_repeats", "data.repeats", c.positive_int, doc="the N of kohya's N_name folders"),
    Key("datasets[].subsets[].num_repeats", "data.repeats", c.positive_int),
    Key("datasets[].num_repeats", "data.repeats", c.positive_int),
    Key("datasets[].subsets[].class_tokens", "data.trigger", _class_tokens, doc="when some image has no caption "
        "file: what kohya captions those with"),
    Key("_folder_caption", "data.trigger", _class_tokens, doc="the name of kohya's N_name folder, as class_tokens"),
    Key("datasets[].subsets[].caption_extension", "data.caption_ext", c.caption_ext),
    Key("datasets[].caption_extension", "data.caption_ext", c.caption_ext),
    Key("general.caption_extension", "data.caption_ext", c.caption_ext),
    Key("caption_extension", "data.caption_ext", c.caption_ext),
    Key("datasets[].subsets[].caption_dropout_rate", "data.caption_dropout", c.number),
    Key("caption_dropout_rate", "data.caption_dropout", c.number),
    Key("datasets[].subsets[].flip_aug", "data.flip"), Key("flip_aug", "data.flip"),
    Key("datasets[].resolution", "data.resolution", _resolution),
    Key("general.resolution", "data.resolution", _resolution),
    Key("resolution", "data.resolution", _resolution, doc="W,H → the side of a square of the same area"),
    Key("datasets[].batch_size", "train.batch_size", c.integer),
    Key("general.batch_size", "train.batch_size", c.integer),
    Key("train_batch_size", "train.batch_size", c.integer),
    Key("gradient_accumulation_steps", "train.grad_accum", c.positive_int),
    Key("datasets[].subsets[].shuffle_caption", None, why=NO_FEATURE),
    Key("general.shuffle_caption", None, why=NO_FEATURE), Key("shuffle_caption", None, why=NO_FEATURE),
    Key("datasets[].subsets[].keep_tokens", None, why=NO_FEATURE),
    Key("general.keep_tokens", None, why=NO_FEATURE), Key("keep_tokens", None, why=NO_FEATURE),
    Key("datasets[].subsets[].is_reg", None, why=other_way("data.regularisation")),
    Key("datasets[].cache_directory", None, why=CACHE), Key("general.cache_directory", None, why=CACHE),
    Key("datasets[].enable_bucket", None, why=BUCKETS), Key("general.enable_bucket", None, why=BUCKETS),
    Key("enable_bucket", None, why=BUCKETS), Key("min_bucket_reso", None, why=BUCKETS),
    Key("max_bucket_reso", None, why=BUCKETS), Key("bucket_reso_steps", None, why=BUCKETS),
    Key("bucket_no_upscale", None, why=BUCKETS), Key("general.bucket_no_upscale", None, why=BUCKETS),
    Key("datasets[].bucket_no_upscale", None, why=BUCKETS),
    Key("unet_lr", "train.lr", c.number, doc="wins over learning_rate, as there"),
    Key("learning_rate", "train.lr", c.number),
    Key("text_encoder_lr", "lora.text_encoder_lr", te.kohya_te_lr, doc="SDXL; a list: its first, as networks.lora "
        "takes it for both encoders; unset with unet_lr: learning_rate"),
    Key("optimizer_type", "train.optimizer", c.optimizer),
    Key("use_8bit_adam", "train.optimizer", _use_8bit),
    Key("optimizer_args.weight_decay", "train.weight_decay", c.number),
    Key("optimizer_args.eps", "train.optimizer_args.eps", c.number),
    Key("lr_scheduler", "train.schedule", c.schedule),
    Key("lr_warmup_steps", "train.warmup_steps", _warmup),
    Key("max_grad_norm", "train.max_grad_norm", _grad_norm, doc="0 → null (no clipping)"),
    Key("seed", "train.seed", c.integer),
    Key("gradient_checkpointing", "train.gradient_checkpointing"),
    Key("blocks_to_swap", "train.blocks_to_swap", c.integer),
    Key("timestep_sampling", "train.timestep_sampling", _timesteps, doc="sigma → shift when discrete_flow_shift "
        "> 1 (sd-scripts' 3.0), else linear; uniform → linear; sigmoid; shift and the models' own *_shift → shift"),
    Key("guidance_scale", "train.guidance", c.number),
    Key("discrete_flow_shift", None, carried_in("train.timestep_sampling")),
    Key("v_parameterization", "model.prediction", c.v_or_epsilon, doc="SDXL: true → v, false (sd-scripts' default) → "
        "epsilon"),
    Key("zero_terminal_snr", None, c.zero_snr, doc="carried in model.prediction: v (its schedule)"),
    Key("model_prediction_type", None, why=not_applicable("each family predicts what its model was trained to")),
    Key("sigmoid_scale", None, why=NO_FEATURE), Key("weighting_scheme", None, why=NO_FEATURE),
    Key("max_train_epochs", "train.steps", _epochs("max_train_epochs"), doc="epochs × ceil(images × repeats × "
        "resolutions ÷ batch); it wins over max_train_steps, as there"),
    Key("max_train_steps", "train.steps", c.integer),
    Key("save_every_n_steps", "checkpoint.every_steps", c.positive_int),
    Key("save_every_n_epochs", "checkpoint.every_steps", _every_epochs("save_every_n_epochs")),
    Key("save_last_n_epochs", "checkpoint.keep", c.positive_int),
    Key("save_last_n_steps", None, why=other_way("checkpoint.keep", "a count of checkpoints, not of steps")),
    Key("save_state", None, why=other_way("checkpoint.every_steps", "every checkpoint holds the whole state")),
    Key("save_model_as", None, why=other_way("output.formats")),
    Key("save_precision", None, why=other_way("lora.dtype")),
    Key("sample_prompts", "sample.prompts", _sample_prompts, doc="the prompt file: --n negative, --d seed"),
    Key("sample_every_n_steps", "sample.every_steps", c.positive_int),
    Key("sample_every_n_epochs", "sample.every_steps", _every_epochs("sample_every_n_epochs")),
    Key("sample_sampler", None, why=not_applicable("each family samples with its own scheduler")),
    Key("sample_at_first", None, why=other_way("sample.every_steps")),
    Key("cache_latents", None, why=CACHE), Key("cache_latents_to_disk", None, why=CACHE),
    Key("cache_text_encoder_outputs", None, why=CACHE), Key("cache_text_encoder_outputs_to_disk", None, why=CACHE),
    Key("sdpa", None, why=not_applicable("lorad picks the attention kernel")),
    Key("xformers", None, why=not_applicable("lorad picks the attention kernel")),
    Key("persistent_data_loader_workers", None, why=not_applicable("the other tool's data loader")),
    Key("max_data_loader_n_workers", None, why=not_applicable("the other tool's data loader")),
    Key("output_dir", None, why=OUTPUT), Key("output_name", None, why=OUTPUT), Key("logging_dir", None, why=OUTPUT),
    Key("log_with", None, why=OUTPUT), Key("log_prefix", None, why=OUTPUT),
    Key("highvram", None, why=not_applicable("lorad plans memory itself")),
    Key("lowram", None, why=not_applicable("lorad plans memory itself")),
    Key("apply_t5_attn_mask", None, why=not_applicable("each family masks its text encoder as its model does")),
]
# The defaults both tools share (sd-scripts library/train_util.py, train_network.py and networks/lora*.py;
# musubi-tuner src/musubi_tuner/training/parser_common.py and networks/lora.py) where lorad's differ and the run
# would change: written as if the file said them (the header says which). Not for a dataset TOML given alone.
DEFAULTS = {"lr_scheduler": "constant", "max_train_steps": 1600, "network_dim": 4, "network_alpha": 1,
            "learning_rate": 2e-6, "optimizer_type": "AdamW", "timestep_sampling": "sigma"}
# sd-scripts' own: its --caption_extension (also the dataset TOML's fallback), --mixed_precision (accelerate's
# "no": float32) and flux_train_network's --discrete_flow_shift and --guidance_scale (library/flux_train_utils.py).
SD_SCRIPTS_DEFAULTS = {"caption_extension": ".caption", "mixed_precision": "no", "discrete_flow_shift": 3.0}
FLUX_DEFAULTS = {"guidance_scale": 3.5}
# sdxl_train_network's: timesteps drawn uniformly (no flow shift), epsilon unless --v_parameterization, and both
# text encoders' LoRA trained unless --network_train_unet_only (train_network.py: is_train_text_encoder).
SDXL_DEFAULTS = {"timestep_sampling": "uniform", "v_parameterization": False, "network_train_unet_only": False}
# musubi-tuner's own: --discrete_flow_shift 1.0; a dataset's resolution (960, 544) (dataset/config_utils.py).
MUSUBI_DEFAULTS = {"discrete_flow_shift": 1.0}
MUSUBI_RESOLUTION = [960, 544]


def _defaults(flat: dict[str, Any], musubi: bool, family: str | None, out: Imported) -> None:
    """The tool's defaults for what the config leaves unset (see DEFAULTS), each said in the header."""
    more = MUSUBI_DEFAULTS if musubi else {**SD_SCRIPTS_DEFAULTS, **(FLUX_DEFAULTS if family == "flux" else {})}
    if family == "sdxl":
        more = {k: v for k, v in more.items() if k != "discrete_flow_shift"} | SDXL_DEFAULTS
    skip = {"max_train_steps": "max_train_epochs" in flat, "learning_rate": "unet_lr" in flat,
            "optimizer_type": bool(flat.get("use_8bit_adam")),
            "caption_extension": any(k.endswith("caption_extension") for k in flat)}
    for k, v in {**DEFAULTS, **more}.items():
        if k not in flat and not skip.get(k):
            flat[k] = v
            out.notes.append(f"{k} not set there: its default {v} written")
    if musubi and any(k.startswith("datasets[") for k in flat) and not any(k.endswith("resolution") for k in flat):
        flat["general.resolution"] = MUSUBI_RESOLUTION
        out.notes.append(f"resolution not set in the dataset: musubi-tuner's default {MUSUBI_RESOLUTION} written")


def read(cfg_args: dict[str, Any], script: str | None, dataset: dict[str, Any] | None, ctx: Context,
         out: Imported) -> None:
    """One kohya/musubi import: the training arguments (from a TOML or a command line), its script, its dataset."""
    flat: dict[str, Any] = {}
    for k, v in cfg_args.items():
        if k in ("network_args", "optimizer_args"):
            for sk, sv in _kv_list(v).items():
                flat[f"{k}.{sk}"] = sv
        else:
            flat[k] = v
    if dataset is not None:
        read_dataset(dataset, flat, ctx, out)
    if script is not None:
        flat["_script"] = script
        fam = SCRIPTS.get(script.lower(), "unknown")
        if fam is None or fam == "unknown":
            out.problems.append(f"{script}.py: {c.unsupported('script', script)}" if fam is None else
                                f"{script}.py: not a LoRA training script lorad knows ({', '.join(SCRIPTS)})")
        else:
            out.set("model.family", fam, f"the script {script}.py")
        flat.pop("_script")
    elif "network_module" in flat and str(flat["network_module"]) in MODULES:
        fam = MODULES[str(flat["network_module"])]
        if fam is None and str(flat["network_module"]) == "networks.lora":  # SD 1.5's and SDXL's: the model says
            fam = "sdxl" if c.family_of_name(str(flat.get("pretrained_model_name_or_path", ""))) == "sdxl" else None
        if fam is None:
            named = flat.get("pretrained_model_name_or_path") or flat["network_module"]  # the model says which
            out.problems.append(f"network_module: {c.unsupported('network_module', str(named))}")
        else:
            out.set("model.family", fam, f"network_module = {flat['network_module']}")
    if "train_data_dir" in flat:
        repeat_folders(Path(c.local_path(flat["train_data_dir"], ctx)), flat, ctx, out)
    if cfg_args:
        family = out.get("model.family") or c.family_of_name(str(flat.get("pretrained_model_name_or_path", "")))
        if family == "sdxl":
            te.kohya_lrs(flat, out.notes)
        _defaults(flat, out.tool == MUSUBI, family, out)
    if "dit" in flat:
        flat["_dit_expert"] = flat["dit"]
    count_images(flat, ctx)
    ctx.source = flat
    apply(TABLE, flat, ctx, out)
