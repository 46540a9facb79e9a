"""Krea 2 LoRA (base and Turbo): diffusers `Krea2Transformer2DModel`, trained by flow matching (engine/families/image/base.py).

Krea 2 is a single-stream MMDiT (28 blocks, 6144 wide, 48 query heads over 12 key/value heads, a sigmoid
output gate on attention, SwiGLU feed-forwards; 12.8 B parameters) conditioned on a stack of 12 hidden states
tapped from Qwen3-VL-4B, which a small text-fusion transformer (2 + 2 blocks, 2560 wide) folds into one token
sequence. What is Krea 2's own, all through diffusers' `Krea2Pipeline`:

- Latents: Qwen-Image's VAE (`AutoencoderKLQwenImage`, 16 channels), the posterior mode normalised by its
  latents_mean / latents_std — the inverse of what the pipeline decodes (Krea 2 has no img2img pipeline; the
  mode comes from Qwen-Image's `retrieve_latents`, as engine/families/image/qwen_image/family.py does).
- Tokens and positions: the pipeline's `_pack_latents` (2×2 patches, [B, h/2·w/2, 64]) and its static
  `prepare_position_ids` (text rows at the origin, image rows (0, row, col)); the image ids do not depend on
  the caption's length.
- Text: the pipeline's `encode_prompt` — Qwen3-VL over the caption in Krea 2's template, padded in the middle
  to 512 tokens, with positions that skip the padding; the 12 tapped hidden states per token, [L, 12, 2560].
  The cache keeps the caption's real tokens only, flattened to [L, 12·2560] (ComfyUI's conditioning layout), and
  `predict` unflattens them; a batch is padded at the end with a mask, which the transformer applies as a
  key-padding mask everywhere. Padding never changes a real token: text rows all sit at position 0 and the
  text-fusion blocks that attend across layers run per token.
- Time and sign: the transformer is conditioned on σ itself (the pipeline passes t / 1000) and predicts the
  scheduler's velocity ε − x0, the shared rectified-flow target; nothing is negated.
- Timesteps: `shift` is the pipeline's: base checkpoints use `calculate_shift` over the scheduler's
  256 … 6400 image tokens (μ 0.5 … 1.15); a directory whose model_index.json says `is_distilled` (Turbo, the
  few-step TDM checkpoint) uses the fixed μ = 1.15 it was distilled with, as `Krea2Pipeline.__call__` and
  `Krea2TurboSetTimestepsStep` do.
- Base and Turbo: the same transformer class and the same loss. Neither embeds a guidance value (train.guidance
  is not read). Base samples with CFG (Krea 2's convention: cond + g·(cond − uncond), on when
  `sample.guidance` > 0; the pipeline suggests 4.5 and 28 steps); Turbo wants `sample.guidance: 0` (no negative
  pass) and 8 steps. Training on Turbo directly slowly undoes its distillation over long runs.
- LoRA targets (DEFAULT_TARGETS): every main block's attention q/k/v, the output gate and the output
  projection, and the SwiGLU gate/up/down — the 28 `transformer_blocks`. The text-fusion blocks and the
  embedders are left alone by default (both loaders below map them too, if lora.targets names them).

Export (alpha / r folded into lora_B in both files; no `.alpha` keys):

`pytorch_lora_weights.safetensors` (diffusers; export.py's diffusers_lora_file, as for FLUX.2 and Qwen-Image):

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)
    metadata "lora_adapter_metadata"          LoraConfig with lora_alpha = r

read by `Krea2Pipeline.load_lora_weights` (`Krea2LoraLoaderMixin`, which passes no network alphas) at scale 1.

`krea2_lora_comfyui.safetensors` (ComfyUI): ComfyUI's Krea 2 model (comfy/ldm/krea2/model.py, `SingleStreamDiT`)
keeps the reference checkpoint's module names, which differ from diffusers':

    transformer_blocks.i.attn.to_q | to_k | to_v | to_gate | to_out.0   blocks.i.attn.wq | wk | wv | gate | wo
    transformer_blocks.i.ff.gate | up | down                          blocks.i.mlp.gate | up | down
    text_fusion.{layerwise,refiner}_blocks.i.<same>                   txtfusion.{layerwise,refiner}_blocks.i.<same>
    img_in, time_embed.linear_1 / 2, time_mod_proj                    first, tmlp.0 / 2, tproj.1
    txt_in.linear_1 / 2, text_fusion.projector, final_layer.linear    txtmlp.1 / 3, txtfusion.projector, last.linear

and the file is

    diffusion_model.<ComfyUI name>.lora_A.weight   [r, in]
    diffusion_model.<ComfyUI name>.lora_B.weight   [out, r]   × alpha / r (folded)

ComfyUI's generic rule (comfy/lora.py, model_lora_keys_unet: every `diffusion_model.<state-dict path>`) maps
each key to `<ComfyUI name>.weight`, and load_lora reads `.lora_A` / `.lora_B` at scale 1 when there is no
`.alpha`. The alpha is folded rather than written because diffusers reads this file too:
`Krea2LoraLoaderMixin.lora_state_dict` converts `diffusion_model.` + these names
(`_convert_non_diffusers_krea2_lora_to_diffusers`, the table above read backwards) and refuses any key it does
not convert, an `.alpha` included. The stored ComfyUI snapshot's lora.py predates Krea 2; its model file gives
the names. Newer ComfyUI also maps diffusers' names for Krea 2 (`comfy.utils.krea2_to_diffusers`, with the
`transformer.` / `diffusion_model.` / bare prefixes) — seen in third-party copies of that code, not checked
here — which would let it read the diffusers file as well.

lora.type: DoRA goes in the diffusers file only (lora_magnitude_vector beside A and B; Krea2LoraLoaderMixin loads
it as DoRA). LoKr and LoHa go in the ComfyUI file only, as LyCORIS tensors with their `.alpha` under the same
`diffusion_model.<ComfyUI name>` keys (export.folded_comfyui_file): ComfyUI's LoKr and LoHa adapters read
`<key>.lokr_w1`, ... for every key its LoRA key map holds; diffusers reads neither type, so its converter never
sees the `.alpha`.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.builtin.models import resolve_model_path
from engine.config.job import JobConfig
from engine.families.image.base import ImageFamily
from engine.families.image.dataset import pad_texts
from engine.families.image.export import folded_comfyui_file, output_files
from engine.families.image.model import pipeline_shift_mu, qwen_vae_latent, tokenizer_text_len

DEFAULT_TARGETS = r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))$"
# Kept in the model dtype under fp8: the embedders, the time modulation, the text projector (12 inputs) and the
# final layer — small, run once per step. The text-fusion blocks (0.35 B) are not small.
FP8_SKIP = r"^(img_in|time_embed|time_mod_proj|txt_in|text_fusion\.projector|final_layer)(\.|$)"
COMFYUI_FILE = "krea2_lora_comfyui.safetensors"
MAX_TEXT_LEN = 512  # the pipeline's max_sequence_length
DISTILLED_MU = 1.15  # Krea2Pipeline.__call__'s fixed shift for the distilled checkpoint

_BLOCK_NAMES = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
                "attn.to_out.0": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
_TOP_NAMES = {"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
              "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
              "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"}
_BLOCK = re.compile(r"^(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)\.(\d+)\.(.+)$")


def comfyui_name(module: str) -> str:
    """ComfyUI's (the reference checkpoint's) name of a diffusers Krea 2 module path (the docstring's table)."""
    m = _BLOCK.match(module)
    if m and m.group(3) in _BLOCK_NAMES:
        group = "blocks" if m.group(1) == "transformer_blocks" else m.group(1).replace("text_fusion.", "txtfusion.")
        return f"{group}.{m.group(2)}.{_BLOCK_NAMES[m.group(3)]}"
    if module in _TOP_NAMES:
        return _TOP_NAMES[module]
    raise ValueError(f"no ComfyUI name for Krea 2 module {module!r}")


def _pack(x: torch.Tensor) -> torch.Tensor:
    from diffusers import Krea2Pipeline

    b, c, h, w = x.shape
    # An instance method that reads only the pipeline's patch_size (2, as every Krea 2 directory has it).
    return Krea2Pipeline._pack_latents(SimpleNamespace(patch_size=2), x, b, c, h, w)


class Krea2Model:
    """The Krea 2 half of an ImageFamily (see the module docstring)."""

    name = "krea2"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP
    text_layers = 12  # the real model's num_text_layers; Krea2Family.load_model sets the directory's own

    def transformer_class(self) -> type:
        from diffusers import Krea2Transformer2DModel

        return Krea2Transformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        """Tokens per caption: the pipeline's 512, capped by the tokenizer's own limit (the tiny one has 48)."""
        return tokenizer_text_len(model_path, revision, MAX_TEXT_LEN)

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        return qwen_vae_latent(pipe, pixels)

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        embeds, mask = pipe.encode_prompt(text, device=device, max_sequence_length=max_len)
        return embeds[0][mask[0]].flatten(1)  # the real tokens, [L, layers · D]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        """μ of the pipeline's schedule: fixed 1.15 for a distilled (Turbo) directory, else calculate_shift."""
        from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

        if sched.get("is_distilled", False):
            return DISTILLED_MU
        return pipeline_shift_mu(calculate_shift, {"max_image_seq_len": 6400, **sched}, image_seq_len)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return _pack(x)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        from diffusers import Krea2Pipeline

        dtype, device = inner.dtype, x_t.device
        b, _c, h, w = x_t.shape
        layers = inner.config.num_text_layers
        text = embeds.to(device, dtype).unflatten(-1, (layers, -1))  # [B, L, layers, D]
        ids = Krea2Pipeline.prepare_position_ids(text.shape[1], h // 2, w // 2, device)
        return model(hidden_states=_pack(x_t.to(dtype)), encoder_hidden_states=text, timestep=sigma.to(dtype),
                     position_ids=ids, encoder_attention_mask=mask.to(device).bool(), return_dict=False)[0]

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is Krea 2's CFG scale against the negative prompt (the empty caption by default; 0 for
        # Turbo: no negative pass). The pipeline builds one set of position ids for both passes, so both captions
        # are padded to one length (the pipeline pads both to 512), with a mask over the real tokens.
        texts = [emb["prompt_embeds"], negative["prompt_embeds"]]
        padded, mask = pad_texts(texts, max(t.shape[0] for t in texts))
        padded = padded.to(device, dtype).unflatten(-1, (self.text_layers, -1))
        mask = mask.to(device).bool()
        return {"prompt_embeds": padded[:1], "prompt_embeds_mask": mask[:1],
                "negative_prompt_embeds": padded[1:], "negative_prompt_embeds_mask": mask[1:]}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        # krea2_lora_comfyui.safetensors: diffusion_model.<ComfyUI name>, alpha / r folded into B.
        return output_files(model, cfg, out_dir, meta, lambda md: folded_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "krea2", comfyui_name))


class Krea2Family(ImageFamily):
    """ImageFamily, plus what Krea 2 reads from its directory beside the scheduler: the pipeline's `is_distilled`
    (the timestep shift) and the transformer's tapped-layer count (the cached text's layout)."""

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from diffusers import DiffusionPipeline

        transformer = super().load_model(cfg, workdir, device, log)
        try:
            pipe = DiffusionPipeline.load_config(resolve_model_path(cfg.model.path, workdir),
                                                 revision=cfg.model.revision)
        except (OSError, ValueError):
            pipe = {}  # a transformer-only directory: a base checkpoint
        self.sched["is_distilled"] = bool(pipe.get("is_distilled", False))
        self.model.text_layers = transformer.config.num_text_layers
        return transformer


def Krea2():  # noqa: N802 - reads as the family's class at get_family's call site
    return Krea2Family(Krea2Model())
