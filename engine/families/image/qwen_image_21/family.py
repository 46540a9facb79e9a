"""Qwen-Image 2.1 LoRA: diffusers `QwenImage21Transformer2DModel`, trained by flow matching (engine/families/image/base.py).

Qwen-Image 2.1 is not a Qwen-Image checkpoint: a single-stream, block-causal transformer (32 blocks, 4096 wide, one
modulation shared by every block, SwiGLU feed-forwards; 7.1 B parameters) over the latents of its own 16× RGBA VAE,
conditioned on Qwen3-VL's last hidden states. What is its own, all through diffusers' `QwenImage21Pipeline`:

- Latents: `AutoencoderKLQwenImage21` (64 channels, 16× spatially, RGBA): an RGB image is encoded with an opaque
  alpha channel (+1 after the [-1, 1] scaling), as the pipeline converts its condition images to RGBA; the posterior
  mode is normalised by the VAE config's latents_mean / latents_std, as `QwenImage21Pipeline._encode_vae_image` does.
- Tokens: the transformer takes the latent unpatched (`_pack_latents` is a flatten: [B, h·w, C]), one token per
  16×16 pixels, but its joint sequence gives the target image one vision-encoder slot per 2×2 of them (`img_mask`:
  the caption's positions False, then h·w/4 slots True): h and w must be even, so image sides are multiples of 32.
  The prediction is the sequence's last h·w rows, as the pipeline slices it.
- Text: the pipeline's `encode_prompt` — Qwen3-VL's last decoder layer before its final norm, over the caption in
  the pipeline's template, with the system prompt's tokens dropped; captions keep their own length. A batch pads
  them at the end with `encoder_hidden_states_mask` (padded keys are never attended to), as the pipeline does for a
  list of prompts. Unlike Qwen-Image's, the padding is not invisible: the image block's frame position follows the
  padded caption, in the pipeline as here, so train.batch_size 1 is what conditions exactly as one prompt samples.
- Time: the transformer is conditioned on σ itself (the pipeline passes t / 1000; it scales by 1000 inside) and
  predicts the scheduler's velocity ε − x0, the shared rectified-flow target; caption tokens are modulated from
  t = 0 (`causal_condition`), inside the transformer.
- Timesteps: `shift` uses the pipeline's `calculate_shift` over the h·w unpatched tokens (ImageFamily hands
  shift_mu the 2×2-patch count of the other families, (h/2)·(w/2), so it is multiplied back by 4 here).
- LoRA targets (DEFAULT_TARGETS): every block's attention q/k/v/out and its SwiGLU `proj`, `gate_layer` and `out`.
- Samples: the pipeline's own call; sample.guidance is its `true_cfg_scale` (the model is meant to sample at 1:
  no negative pass; > 1 guides against the negative prompt).

Export. `pytorch_lora_weights.safetensors` (diffusers; export.py's diffusers_lora_file, alpha / r folded into B,
lora_alpha = r in its metadata), read by `QwenImage21Pipeline.load_lora_weights` (`QwenImageLoraLoaderMixin`).

`qwen_image_21_lora_comfyui.safetensors` (ComfyUI): diffusers' module paths, bare, with their alpha:

    <module path>.lora_A.weight   [r, in]
    <module path>.lora_B.weight   [out, r]
    <module path>.alpha           lora.alpha; scale alpha / r

ComfyUI's rules (Comfy-Org/ComfyUI as stored: comfy/ldm/qwen_image21/model.py at 08f68f09, comfy/lora.py at 17358c8f,
model_lora_keys_unet). Its Qwen-Image 2.1 model keeps diffusers' module names except the SwiGLU, whose `proj` and
`gate_layer` it fuses at load into one `img_mlp.gate_up` ([gate; up], 2·hidden rows). The key map's QwenImage branch,
whose comment names Qwen Image 2.1's fused gate_up (its model class derives from QwenImage), takes every
`diffusion_model.<path>.weight` of the model under the bare `<path>` (and under `transformer.<path>`), and maps the
halves by row offset:

    K                                     -> diffusion_model.K.weight
    transformer_blocks.i.img_mlp.gate_layer -> diffusion_model.transformer_blocks.i.img_mlp.gate_up.weight rows [0, h)
    transformer_blocks.i.img_mlp.proj       -> diffusion_model.transformer_blocks.i.img_mlp.gate_up.weight rows [h, 2h)

(h: half the fused weight's rows; a checkpoint loaded unfused keeps `gate_layer` and `proj`, which the first rule
maps.) load_lora reads `.lora_A` / `.lora_B` with `K.alpha` (scale alpha / r). `comfyui_target` is these rules.
The `diffusion_model.` prefix the other Qwen-Image files use is not mapped for the two halves (only the fused
`gate_up` is a weight there), so this file keeps the bare names. diffusers reads this file as well:
`QwenImageLoraLoaderMixin.lora_state_dict` converts files with `.alpha` keys (folding alpha / r, prefixing
`transformer.`). ComfyUI's QwenImage rule maps the diffusers file's `transformer.<path>` keys too (at scale 1: alpha
is folded there). Neither file is checked against a running ComfyUI here: the tests apply these rules as written.

lora.type: DoRA goes in the diffusers file only (peft's `lora_magnitude_vector` beside A and B, which
`load_lora_weights` loads as DoRA). LoKr and LoHa go in the ComfyUI file only, as LyCORIS tensors with their
`.alpha` under the same bare keys (export.lycoris_state_dict: `<module path>.lokr_w1 | … | hada_w1_a | … | alpha`):
ComfyUI's LoKr and LoHa adapters read them for every key its LoRA key map holds, the SwiGLU halves at their rows
of `gate_up` as above. (The format rules: engine/config/rules.py image_output_formats.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.base import ImageFamily
from engine.families.image.export import lora_modules, lycoris_state_dict, output_files, save
from engine.families.image.model import pipeline_shift_mu, qwen_vae_latent

DEFAULT_TARGETS = r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|img_mlp\.(proj|gate_layer|out))$"
# Kept in the model dtype under fp8: the embedders, the shared modulation and the output layers — run once per step.
FP8_SKIP = r"^(img_in|txt_in|time_text_embed|modulation|norm_out|proj_out)(\.|$)"
COMFYUI_FILE = "qwen_image_21_lora_comfyui.safetensors"
PIPELINE = "QwenImage21Pipeline"

_HALF = re.compile(r"^(transformer_blocks\.\d+\.img_mlp)\.(gate_layer|proj)$")


def comfyui_target(key: str, fused_rows: int | None = None) -> tuple[str, tuple[int, int] | None]:
    """The weight ComfyUI's key map patches for a file key (the module docstring's rules): (weight name, (first row,
    rows) of it, or None for all of it). fused_rows: the fused gate_up's rows (None: a model loaded unfused)."""
    m = _HALF.match(key)
    if m is None or fused_rows is None:
        return f"diffusion_model.{key}.weight", None
    half = fused_rows // 2
    return f"diffusion_model.{m.group(1)}.gate_up.weight", (0 if m.group(2) == "gate_layer" else half, half)


def rgba(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] -> [B, 4, H, W] with an opaque alpha channel (1 after the VAE's scaling)."""
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)


def text_processor(model_path: str, revision: str | None):
    """The directory's own processor, or, where transformers cannot build it (the real Qwen3VLProcessor's video
    processor needs torchvision, which lorad does not install), one over its tokenizer and chat template that
    tokenises text the same way (text-to-image reads nothing else of it; engine/builtin/tiny_qwen_image_21.py)."""
    from transformers import AutoProcessor, AutoTokenizer, PaddleOCRVLProcessor, Qwen2VLImageProcessorPil

    try:
        return AutoProcessor.from_pretrained(model_path, subfolder="processor", revision=revision)
    except (ImportError, AttributeError, ValueError):
        tok = AutoTokenizer.from_pretrained(model_path, subfolder="processor", revision=revision)
        return PaddleOCRVLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok,
                                    chat_template=tok.chat_template)


def load_pipeline(model_path: str, revision: str | None, dtype, keep: tuple[str, ...], **parts):
    """QwenImage21Pipeline with only `keep` (and the scheduler) loaded: its constructor reads the processor, so that
    is always there (text_processor)."""
    from diffusers import DiffusionPipeline, QwenImage21Pipeline

    from engine.families.image.dataset import pipeline_components

    components = pipeline_components(DiffusionPipeline.load_config(model_path, revision=revision))
    drop = {k: None for k in components if not k.startswith(("scheduler", "processor", *keep))}
    return QwenImage21Pipeline.from_pretrained(model_path, revision=revision, dtype=dtype,
                                               processor=text_processor(model_path, revision), **{**drop, **parts})


class QwenImage21Model:
    """The Qwen-Image 2.1 half of an ImageFamily (see the module docstring)."""

    name = "qwen_image_21"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import QwenImage21Transformer2DModel

        return QwenImage21Transformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        return 1024  # a cache-key setting only: the pipeline truncates no caption, nor does encode_text

    def load_pipeline(self, model_path: str, revision: str | None, dtype, keep: tuple[str, ...]):
        return load_pipeline(model_path, revision, dtype, keep)

    def sample_pipeline(self, model_path: str, cfg: JobConfig, transformer):
        from engine.training.dtypes import torch_dtype

        pipe = load_pipeline(model_path, cfg.model.revision, torch_dtype(cfg.model.dtype), ("vae",),
                             transformer=transformer)
        pipe.vae.to(transformer.device)
        return pipe

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        return qwen_vae_latent(pipe, rgba(pixels))

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, _mask, _image_slots = pipe.encode_prompt(text, device=device)
        return embeds[0]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

        return pipeline_shift_mu(calculate_shift, sched, 4 * image_seq_len)  # h·w tokens (module docstring)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        from diffusers import QwenImage21Pipeline

        b, c, h, w = x.shape
        return QwenImage21Pipeline._pack_latents(x, b, c, h, w)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        dtype, device = inner.dtype, x_t.device
        b, _c, h, w = x_t.shape
        text = embeds.to(device, dtype)
        mask = mask.to(device).bool()
        # One vision-encoder slot per 2x2 latent tokens of the target, after the caption (QwenImage21Pipeline).
        slots = torch.cat([torch.zeros_like(mask), mask.new_ones(b, h * w // 4)], dim=1)
        out = model(hidden_states=self.pack(x_t.to(dtype)), encoder_hidden_states=text, timestep=sigma.to(dtype),
                    img_shapes=[[(1, h, w)]] * b, img_mask=slots,
                    # The pipeline passes no mask where nothing is padded; all ones is the same attention.
                    encoder_hidden_states_mask=None if bool(mask.all()) else mask, return_dict=False)[0]
        return out[:, -h * w:]

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is the pipeline's true_cfg_scale, against the negative prompt (the empty caption by default).
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype),
                "true_cfg_scale": cfg.sample.guidance}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        return output_files(model, cfg, out_dir, meta, lambda md: comfyui_file(model, cfg, out_dir, md))


def comfyui_file(model: torch.nn.Module, cfg: JobConfig, out_dir: Path, md: dict[str, str]) -> str:
    """qwen_image_21_lora_comfyui.safetensors: <module path>.lora_A / .lora_B / .alpha, or LoKr / LoHa tensors under
    the same keys (the module docstring)."""
    kohya = {"ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
             "ss_base_model_version": "qwen_image_21"}
    if cfg.lora.type in ("lokr", "loha"):
        kohya.update(ss_network_module="lycoris.kohya", ss_network_args=json.dumps({"algo": cfg.lora.type}))
        return save(lycoris_state_dict(model, lambda name: name), Path(out_dir) / COMFYUI_FILE, {**md, **kohya})
    sd = {}
    for name, (a, b, _base) in lora_modules(model).items():
        sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = a, b
        sd[f"{name}.alpha"] = torch.tensor(float(cfg.lora.alpha))
    return save(sd, Path(out_dir) / COMFYUI_FILE, {**md, **kohya})


class QwenImage21Family(ImageFamily):
    """ImageFamily, plus the trainer's check of the base's pipeline class (a hub id is checked only here)."""

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from diffusers import DiffusionPipeline

        from engine.builtin.models import resolve_model_path
        from engine.config.paths import check_pipeline_family

        path = resolve_model_path(cfg.model.path, workdir)
        try:
            pipeline = DiffusionPipeline.load_config(path, revision=cfg.model.revision).get("_class_name")
        except (OSError, ValueError):
            pipeline = None  # a transformer-only directory
        check_pipeline_family(self.model.name, pipeline, cfg.model.path)
        return super().load_model(cfg, workdir, device, log)


def QwenImage21():  # noqa: N802 - reads as the family's class at get_family's call site
    return QwenImage21Family(QwenImage21Model())
