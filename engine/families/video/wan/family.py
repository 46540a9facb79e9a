"""Wan 2.2 LoRA: diffusers `WanTransformer3DModel`, trained by flow matching on cached clip windows
(engine/families/video/base.py), through diffusers' `WanPipeline` and its components.

What is Wan's own:

- Latents: `AutoencoderKLWan` encodes [1, 3, F, H, W] (F = 4k + 1) to [1, C, k + 1, H/s, W/s] (s = 8, or 16 for
  2.2's residual VAE: scale_factor_spatial); the posterior mode is normalised with the VAE config's
  `latents_mean` / `latents_std`, as `WanImageToVideoPipeline.prepare_latents` normalises its condition (and
  `WanPipeline.__call__` undoes before decoding).
- Text: the pipeline's `encode_prompt` (UMT5's last hidden state, each caption cut at its length and zero-padded
  to max_sequence_length: 512 on the real model, the tokenizer's limit where lower). Wan attends to the padding as
  it was trained to; there is no mask.
- Time: the transformer takes t = σ · num_train_timesteps (1000), as the pipeline hands it the scheduler's
  timesteps. TI2V-5B (`expand_timesteps` in model_index.json) takes one t per latent token, as the pipeline builds
  it from its first-frame mask; the others one per sample. `shift` sampling uses the scheduler's static shift.
- i2v (model.task: i2v, TI2V-5B): first-frame conditioning as `WanImageToVideoPipeline` does it with
  expand_timesteps: the first latent frame is the clean image latent, its tokens get t = 0, and the loss leaves
  that frame out (it is given, not predicted). T2V-A14B has no such conditioning; I2V-A14B (a 36-channel input
  with a mask and a CLIP image encoder) is left out.
- Experts (A14B): engine/families/video/experts.py.
- LoRA targets: self- and cross-attention q/k/v/out and both FFN linears of every block.
- Export: the diffusers file (engine/families/image/export.py: `transformer.<path>`, alpha / r folded) and a
  ComfyUI file in the original Wan names that ComfyUI's Wan model has (comfy/ldm/wan/model.py):

      diffusion_model.blocks.N.self_attn.q|k|v|o      ← blocks.N.attn1.to_q|to_k|to_v|to_out.0
      diffusion_model.blocks.N.cross_attn.q|k|v|o     ← blocks.N.attn2.to_q|to_k|to_v|to_out.0
      diffusion_model.blocks.N.ffn.0 | ffn.2          ← blocks.N.ffn.net.0.proj | ffn.net.2
      each with .lora_A.weight [r, in], .lora_B.weight [out, r] and .alpha (lora.alpha; scale alpha / r)

  ComfyUI's loader maps `diffusion_model.<name>` to its weight `diffusion_model.<name>.weight`; diffusers reads
  the same file back (`_convert_non_diffusers_wan_lora_to_diffusers`, alpha folded). A14B writes one pair per
  expert, named for the ComfyUI model each goes into (EXPERT_FILES): the high-noise expert's files load into the
  high-noise model (`transformer`; in diffusers plain `load_lora_weights`), the low-noise one's into the low-noise
  model (`transformer_2`; in diffusers `load_lora_weights(..., load_into_transformer_2=True)`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.export import diffusers_lora_file, lora_modules, metadata, save
from engine.families.image.flow_lora import load_lora_transformer
from engine.families.video.experts import (
    EXPERTS,
    WanExperts,
    check_expert,
    expert_sigmas,
    pipeline_settings,
    routed,
)

DEFAULT_TARGETS = r"^blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ffn\.net\.(0\.proj|2))$"
# Kept in the model dtype under fp8: the patch embedding, the condition embedders and the output head.
FP8_SKIP = r"^(patch_embedding|condition_embedder|norm_out|proj_out|scale_shift_table)(\.|$)"
COMFYUI_FILE = "wan_lora_comfyui.safetensors"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
# expert -> (diffusers file, ComfyUI file)
EXPERT_FILES = {"high": ("wan22_high_noise_lora.safetensors", "wan22_high_noise_lora_comfyui.safetensors"),
                "low": ("wan22_low_noise_lora.safetensors", "wan22_low_noise_lora_comfyui.safetensors")}
_COMFY = [(r"\.attn1\.to_(q|k|v)$", r".self_attn.\1"), (r"\.attn1\.to_out\.0$", ".self_attn.o"),
          (r"\.attn2\.to_(q|k|v)$", r".cross_attn.\1"), (r"\.attn2\.to_out\.0$", ".cross_attn.o"),
          (r"\.ffn\.net\.0\.proj$", ".ffn.0"), (r"\.ffn\.net\.2$", ".ffn.2")]


def comfyui_name(module: str) -> str:
    """The original Wan name (ComfyUI's) of a diffusers module path."""
    for pat, rep in _COMFY:
        if re.search(pat, module):
            return re.sub(pat, rep, module)
    raise ValueError(f"no ComfyUI name for Wan module {module!r}")


class WanModel:
    """The Wan half of a VideoFamily (see the module docstring)."""

    name = "wan"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def __init__(self):
        self.settings: dict[str, Any] = {}

    def transformer_class(self) -> type:
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        from engine.families.image.model import tokenizer_text_len

        return tokenizer_text_len(model_path, revision, 512)

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

        vae = pipe.vae
        lat = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        mean = torch.tensor(vae.config.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        return ((lat - mean) / std)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, _neg = pipe.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=max_len,
                                          device=device)
        return embeds[0]

    # ---------------------------------------------------------------- the transformer(s)
    def load(self, path: str, cfg: JobConfig, device: torch.device, log) -> torch.nn.Module:
        self.settings = pipeline_settings(path, cfg.model.revision)
        check_expert(cfg.model.expert, self.settings)
        if cfg.model.task == "i2v" and not self.settings["expand_timesteps"]:
            raise JobInvalid("model.task: i2v trains TI2V-5B's first-frame conditioning (expand_timesteps); this "
                             "model has none (I2V-A14B is not supported yet)")

        def one(subfolder: str) -> torch.nn.Module:
            return load_lora_transformer(self.transformer_class(), path, cfg, device, log, fp8_skip=FP8_SKIP,
                                         default_targets=DEFAULT_TARGETS, subfolder=subfolder)

        if cfg.model.expert == "both":
            return WanExperts(one("transformer"), one("transformer_2"))
        return one(EXPERTS.get(cfg.model.expert, "transformer"))

    def sigmas(self, cfg: JobConfig, sched: dict[str, Any], batch: int, generator: torch.Generator) -> torch.Tensor:
        shift = float(sched.get("shift", 1.0)) if cfg.train.timestep_sampling == "shift" else 1.0
        return expert_sigmas(cfg, cfg.model.expert, self.settings.get("boundary_ratio"), batch, shift, generator)

    def condition(self, x_t: torch.Tensor, x0: torch.Tensor, cfg: JobConfig):
        """(model input, loss mask): i2v keeps the first latent frame clean and out of the loss."""
        if cfg.model.task != "i2v":
            return x_t, None
        mask = torch.ones(1, 1, x_t.shape[2], 1, 1, device=x_t.device)
        mask[:, :, 0] = 0
        return (1 - mask) * x0 + mask * x_t, mask

    def predict(self, model, x_t: torch.Tensor, sigma: torch.Tensor, text: dict[str, torch.Tensor],
                cfg: JobConfig) -> torch.Tensor:
        """The velocity (ε − x0) of each sample; `text` the batch's prompt_embeds (Wan has no mask: see above)."""
        embeds = text["prompt_embeds"]
        inner = getattr(model, "module", model)
        dtype, device = inner.dtype, x_t.device
        t = sigma * 1000.0  # the scheduler's num_train_timesteps: the pipeline's timesteps
        b, _c, f, h, w = x_t.shape
        p = inner.config.patch_size
        if self.settings.get("expand_timesteps"):  # one t per token, 0 on a clean first frame (i2v)
            frame_t = t[:, None].expand(b, f).clone()
            if cfg.model.task == "i2v":
                frame_t[:, 0] = 0
            t = frame_t[:, :, None].expand(b, f, (h // p[1]) * (w // p[2])).reshape(b, -1)

        def forward(transformer, rows=None) -> torch.Tensor:
            pick = (lambda v: v) if rows is None else (lambda v: v[rows])
            return transformer(hidden_states=pick(x_t).to(dtype), timestep=pick(t).to(dtype),
                               encoder_hidden_states=pick(embeds).to(device, dtype), return_dict=False)[0]

        if isinstance(inner, WanExperts):
            return routed(model, self.settings["boundary_ratio"], sigma, forward)
        return forward(model)

    # ---------------------------------------------------------------- samples and export
    def sample_pipeline(self, model_path: str, cfg: JobConfig, model):
        from diffusers import WanPipeline

        from engine.training.dtypes import torch_dtype

        parts = ({"transformer": model.transformer, "transformer_2": model.transformer_2}
                 if isinstance(model, WanExperts) else {EXPERTS.get(cfg.model.expert, "transformer"): model})
        pipe = WanPipeline.from_pretrained(model_path, revision=cfg.model.revision, text_encoder=None,
                                           tokenizer=None, dtype=torch_dtype(cfg.model.dtype), **parts)
        pipe.vae.to(model.device)
        return pipe

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype)}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        md = metadata(cfg, meta)
        if isinstance(model, WanExperts):
            pairs = [("high", model.transformer), ("low", model.transformer_2)]
        else:
            pairs = [(cfg.model.expert, model)]
        names = []
        for expert, transformer in pairs:
            diff, comfy = EXPERT_FILES.get(expert, (DIFFUSERS_FILE, COMFYUI_FILE))
            emd = {**md, "wan_expert": expert or "", "wan_transformer": EXPERTS.get(expert, "transformer")}
            if "diffusers" in cfg.output.formats:
                tmp = diffusers_lora_file(transformer, out_dir, emd)
                if diff != tmp:
                    (Path(out_dir) / tmp).rename(Path(out_dir) / diff)
                names.append(diff)
            if "comfyui" in cfg.output.formats:
                names.append(comfyui_file(transformer, cfg, Path(out_dir) / comfy, emd))
        return names


def comfyui_file(transformer, cfg: JobConfig, path: Path, md: dict[str, str]) -> str:
    sd = {}
    for module, (a, b, _base) in lora_modules(transformer).items():
        key = "diffusion_model." + comfyui_name(module)
        sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"] = a, b
        sd[f"{key}.alpha"] = torch.tensor(float(cfg.lora.alpha))
    return save(sd, path, {**md, "ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
                           "ss_base_model_version": "wan"})


def Wan():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.video.base import VideoFamily

    return VideoFamily(WanModel())
