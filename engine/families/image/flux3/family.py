"""FLUX.3 LoRA (FLUX.3 and FLUX.3 distilled): diffusers `Flux3Transformer2DModel`, trained by flow matching
(engine/families/image/base.py).

diffusers 0.42.1 drives FLUX.3 through modular pipelines only: `Flux3ModularPipeline` over `Flux3AutoBlocks`, and
`Flux3DistilledModularPipeline` over `Flux3DistilledAutoBlocks` for the step-distilled checkpoint. A directory is
read with `ModularPipeline.from_pretrained` (its modular_model_index.json) and only the components a step needs are
loaded (`load_components`). What is FLUX.3's own, all from those pipelines' blocks (diffusers/modular_pipelines/flux3):

- Latents: `AutoencoderKLFlux2`; `Flux3VaeEncoderStep` itself makes the cached latent — the posterior mode, cut
  into 2×2 patches (`_patchify_latents`, 4× the channels at half the size) and normalised by the VAE's batch-norm
  statistics — the inverse of what `Flux3DecodeStep` decodes.
- Tokens and positions: one token per patchified latent pixel, in row order (`Flux3PrepareLatentsStep`'s
  `flatten(2).transpose(1, 2)`, which diffusers writes inline: `pack` is that line); image ids from the blocks'
  `_prepare_image_ids` with the step's `image_rope_scale` (0.5), text ids from `Flux3TextRoPEInputsStep._prepare_text_ids`.
- Text: `Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds` — Qwen3-VL over the caption in the chat template, 8
  hidden states stacked along the channels, right-padded to a window of a multiple of 80 tokens (the step's
  `pad_multiple`). The transformer attends to that padding and takes no mask, so the cache keeps each caption's
  whole window; a batch whose windows differ runs the transformer once per window length, so no caption sees a
  window the pipeline would not give it (DDP allows one forward per backward: there such a batch stops the job
  with exit 65, naming train.batch_size; not run on several GPUs here).
- Time and sign: the transformer takes σ (the pipeline's t / 1000) and predicts the velocity ε − x0 that the
  scheduler integrates, so the loss is the shared rectified-flow MSE unchanged.
- Timesteps: `shift` is the static shift of the pipeline's scheduler, `Flux3SetTimestepsStep().shift` (6.93),
  σ = s·t / (1 + (s − 1)·t), for both variants (a from-config component: a directory's scheduler config is not read).
- FLUX.3 and FLUX.3 distilled: the same transformer class; the distilled one is a flow map (`flow_map: true`) that
  also takes the timestep each step jumps to. Training gives it target = σ, its instantaneous velocity, the only
  jump for which ε − x0 is the right target; how far such a LoRA carries over to the 16-step jumps is not measured.
  FLUX.3 samples with the pipeline's classifier-free guidance (`sample.guidance`, against the negative prompt);
  the distilled one has no CFG (no negative prompt). train.guidance is not read (no guidance embedding).
- LoRA targets (DEFAULT_TARGETS): attention to_q/to_k/to_v/to_out.0 and the feed-forward linear_in/linear_out of
  the text and image per-mode blocks and of every joint single block. The reference-image mode blocks are left
  alone: text-to-image training never runs them. Both layouts below name every target.

Export (alpha / r is the scale):

`pytorch_lora_weights.safetensors` (diffusers; export.py's diffusers_lora_file, alpha / r folded into lora_B,
lora_alpha = r in its metadata): `transformer.<module path>.lora_A.weight` / `.lora_B.weight`, which
`Flux3LoraLoaderMixin.load_lora_weights` reads as they are.

`flux3_lora_comfyui.safetensors`: `diffusion_model.<BFL name>.lora_A.weight` / `.lora_B.weight`, alpha / r folded
into lora_B as in the diffusers file, and no `.alpha` keys: diffusers' FLUX.3 loader refuses a file that has them
("all LoRA param names contain 'lora'"), and a loader that reads none applies scale 1, the trained strength. The
BFL names are those of the original FLUX.3 checkpoint, the inverse of diffusers' own converter for that format
(lora_conversion_utils._convert_non_diffusers_flux3_lora_to_diffusers, which `Flux3LoraLoaderMixin` applies to
`diffusion_model.` keys), so diffusers loads this file too:

    mode_blocks.image.i.…                     content_mode_blocks.image.i.…
    single_transformer_blocks.i.…              single_blocks.i.…
    txt_mode_blocks.i.…                        txt_mode_blocks.i.…
    attn.to_q | to_k | to_v | to_out.0         q_proj | k_proj | v_proj | attn_out
    ff.linear_in | ff.linear_out               mlp_in | mlp_out

Each `<BFL name>.weight` is also a weight of the original checkpoint: diffusers' single-file converter
(single_file_utils.convert_flux3_transformer_checkpoint_to_diffusers) maps it to that module's weight.

Unverified: the stored copy of ComfyUI's source has no FLUX.3 model (no comfy/ldm/flux3 in any stored version; its
one stored comfy/lora.py predates FLUX.3; the whole repository was too large to fetch), so no FLUX.3 rule of
ComfyUI's was read. The file follows ComfyUI's generic rule, read in that comfy/lora.py: a key
`diffusion_model.<module>` + `.lora_A/B.weight` patches the model's `diffusion_model.<module>.weight`, at scale 1
without an `.alpha`. That holds for FLUX.3 if ComfyUI keeps the original checkpoint's names, as its FLUX.1 and
FLUX.2 models do; not known.

lora.type: DoRA goes in the diffusers file only (lora_magnitude_vector beside A and B; Flux3LoraLoaderMixin loads
it as DoRA). LoKr and LoHa go in the ComfyUI file only, as LyCORIS tensors with their `.alpha` under the same
`diffusion_model.<BFL name>` keys (export.folded_comfyui_file): ComfyUI's LoKr and LoHa adapters read
`<key>.lokr_w1`, ... for every key its LoRA key map holds, so they rest on the LoRA key rule above and share its
caveat; diffusers reads neither type.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.export import folded_comfyui_file, output_files

_BLOCK = r"(txt_mode_blocks\.\d+|mode_blocks\.image\.\d+|single_transformer_blocks\.\d+)"
DEFAULT_TARGETS = rf"^{_BLOCK}\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.(linear_in|linear_out))$"
# Kept in the model dtype under fp8: the embedders, the modulation heads and the output layers (small, run once
# per step, and they set the scale of everything else).
FP8_SKIP = (r"^(x_embedders|context_embedder|timestep_embedder|target_timestep_embedder|early_stream_modulations"
            r"|single_stream_modulations|norm_out|proj_out)(\.|$)")
COMFYUI_FILE = "flux3_lora_comfyui.safetensors"
MAX_TEXT_LEN = 8192  # the text encoder step's max_sequence_length

_TO_BFL = [(r"^mode_blocks\.", "content_mode_blocks."), (r"^single_transformer_blocks\.", "single_blocks."),
           (r"\.attn\.to_q$", ".q_proj"), (r"\.attn\.to_k$", ".k_proj"), (r"\.attn\.to_v$", ".v_proj"),
           (r"\.attn\.to_out\.0$", ".attn_out"), (r"\.ff\.linear_in$", ".mlp_in"), (r"\.ff\.linear_out$", ".mlp_out")]


def bfl_name(module: str) -> str:
    """The original FLUX.3 checkpoint's name of a diffusers module path (the module docstring's table)."""
    for pattern, repl in _TO_BFL:
        module = re.sub(pattern, repl, module)
    return module


def load_modular(model_path: str, revision: str | None, names: list[str], dtype: torch.dtype, drop=()):
    """The directory's modular pipeline with only the components `names` loaded, less the sub-blocks `drop`."""
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(model_path, revision=revision)
    if drop:
        blocks = pipe.blocks  # a copy: ours to edit, and the one the new pipeline runs
        for name in drop:
            blocks.sub_blocks.pop(name, None)
        pipe = type(pipe)(blocks=blocks, pretrained_model_name_or_path=model_path, revision=revision)
        pipe.own_blocks = blocks
    pipe.load_components(names=names, dtype=dtype)
    return pipe


class ModularSampler:
    """What the SampleRenderer calls (DiffusionPipeline's keywords, `.images`) over a FLUX.3 modular pipeline built
    without its prompt upsampler, text encoder and image encoder: prompts arrive as cached embeddings."""

    def __init__(self, pipe):
        self.pipe = pipe

    @property
    def transformer(self):
        return self.pipe.transformer

    @transformer.setter
    def transformer(self, transformer):
        self.pipe.update_components(transformer=transformer)

    def set_progress_bar_config(self, **kwargs):
        # The pipeline's own reaches only its top-level blocks; the denoising loop sits inside the denoise step.
        todo = [self.pipe.own_blocks]  # the blocks it runs (its `blocks` property hands out a copy)
        while todo:
            block = todo.pop()
            if hasattr(block, "set_progress_bar_config"):
                block.set_progress_bar_config(**kwargs)
            todo.extend(getattr(block, "sub_blocks", {}).values())

    def __call__(self, prompt_embeds, negative_prompt_embeds, height, width, num_inference_steps, guidance_scale,
                 generator, output_type="pil"):
        from diffusers import ClassifierFreeGuidance

        # sample.guidance is the pipeline's CFG scale (its guider, 3.5 by default; off at 1 or below).
        self.pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
        return self._run(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, height=height,
                         width=width, num_inference_steps=num_inference_steps, generator=generator,
                         output_type=output_type)

    def _run(self, **kwargs):
        return SimpleNamespace(images=self.pipe(**kwargs, output="images"))


class DistilledSampler(ModularSampler):
    """The distilled pipeline: no guider, no negative prompt (the renderer warns when a prompt names one)."""

    def __call__(self, prompt_embeds, height, width, num_inference_steps, generator, output_type="pil"):
        return self._run(prompt_embeds=prompt_embeds, height=height, width=width,
                         num_inference_steps=num_inference_steps, generator=generator, output_type=output_type)


class Flux3Model:
    """The FLUX.3 half of an ImageFamily (see the module docstring)."""

    name = "flux3"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import Flux3Transformer2DModel

        return Flux3Transformer2DModel

    def load_pipeline(self, model_path: str, revision: str | None, dtype: torch.dtype, keep: tuple[str, ...]):
        """The cache's encoders' pipeline (dataset.PipelineEncoder): the modular one with only `keep` loaded."""
        names = [n for n in ("vae", "text_encoder", "tokenizer") if n.startswith(keep)]
        return load_modular(model_path, revision, names, dtype)

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        """Tokens per caption: the pipeline's 8192, capped by the tokenizer's own limit (the tiny one has 512)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer", revision=revision)
        tok = getattr(tok, "tokenizer", tok)
        return int(min(MAX_TEXT_LEN, getattr(tok, "model_max_length", MAX_TEXT_LEN) or MAX_TEXT_LEN))

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.modular_pipelines import PipelineState
        from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

        state = PipelineState()
        state.set("condition_images", [pixels])
        _, state = Flux3VaeEncoderStep()(pipe, state)
        return state.get("image_cond_latents")[0][0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        step = Flux3TextEncoderStep()
        return step._get_qwen3_vl_prompt_embeds(pipe.text_encoder, pipe.tokenizer, text, device=device,
                                                max_sequence_length=max_len, pad_multiple=step.pad_multiple)[0]

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        """μ = log of the pipeline scheduler's static shift (both variants' set-timesteps step configures 6.93)."""
        from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep

        return math.log(Flux3SetTimestepsStep().shift)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)  # Flux3PrepareLatentsStep's packing: [B, C, h, w] → [B, h·w, C]

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        from diffusers.modular_pipelines.flux3.before_denoise import (
            Flux3PrepareLatentsStep,
            Flux3TextRoPEInputsStep,
            _prepare_image_ids,
        )

        dtype, device = inner.dtype, x_t.device
        _b, _c, h, w = x_t.shape
        tokens, sigma = self.pack(x_t.to(dtype)), sigma.to(device, dtype)
        img_ids = _prepare_image_ids(h, w, Flux3PrepareLatentsStep().image_rope_scale).to(device)
        lengths = mask.to(device).sum(1)
        windows = sorted(set(lengths.tolist()))
        if len(windows) > 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise JobInvalid("train.batch_size: this batch's captions have FLUX.3 text windows of "
                             f"{[int(w) for w in windows]} tokens, one forward each, and DDP allows one forward per "
                             "backward; use train.batch_size: 1 (and train.grad_accum) on several GPUs")
        order, preds = [], []
        for length in windows:  # one forward per text window in the batch (docstring)
            idx = (lengths == length).nonzero().flatten()
            text = embeds.to(device)[idx, : int(length)].to(dtype)
            t = sigma[idx]
            preds.append(model(hidden_states=tokens[idx], encoder_hidden_states=text, timestep=t, img_ids=img_ids,
                               txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text).to(device),
                               target_timestep=t if inner.config.flow_map else None, return_dict=False)[0])
            order.append(idx)
        if len(preds) == 1:
            return preds[0]
        return torch.cat(preds)[torch.argsort(torch.cat(order))]

    def sample_pipeline(self, model_path: str, cfg: JobConfig, transformer):
        """The pipeline the SampleRenderer drives: the directory's blocks less prompt upsampling and encoding."""
        from engine.training.dtypes import torch_dtype

        pipe = load_modular(model_path, cfg.model.revision, ["vae"], torch_dtype(cfg.model.dtype),
                            drop=("prompt_upsampler", "text_encoder", "vae_encoder"))
        pipe.update_components(transformer=transformer)
        pipe.vae.to(transformer.device)
        return (DistilledSampler if transformer.config.flow_map else ModularSampler)(pipe)

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        return {"prompt_embeds": emb["prompt_embeds"][None].to(device, dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(device, dtype)}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        # Both files: alpha / r folded into lora_B, no `.alpha` keys (diffusers' FLUX.3 loader refuses them).
        return output_files(model, cfg, out_dir, meta, lambda md: folded_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "flux3", bfl_name))


def Flux3():  # noqa: N802 - reads as the family's class at get_family's call site
    from engine.families.image.base import ImageFamily

    return ImageFamily(Flux3Model())
