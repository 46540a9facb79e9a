"""HiDream-I1 LoRA (Full, Dev, Fast): diffusers `HiDreamImageTransformer2DModel`, trained by flow matching
(engine/families/image/base.py).

HiDream-I1 is a 17 B mixture-of-experts DiT: 16 double-stream blocks (an image and a text stream, joint attention)
then 32 single-stream blocks, 2560 wide (20 heads × 128); every block's image feed-forward is a mixture of experts
(a softmax router picks 2 of 4 routed SwiGLU experts per token, plus one shared expert every token passes). Four
text encoders condition it. What is HiDream's own, all through diffusers' `HiDreamImagePipeline`:

- Latents: FLUX.1's VAE (`AutoencoderKL`, 16 channels); the posterior mode normalised (z − shift_factor) ·
  scaling_factor, the inverse of what the pipeline decodes (diffusers' HiDream training script normalises the
  same way; it samples the posterior, the cache keeps the mode as every family here does).
- Tokens and positions: none here. The transformer takes [B, C, h, w] latents, cuts the 2×2 patches and builds
  the (0, row, col) ids itself; a non-square latent is padded to `max_seq` tokens (max_resolution², 4096 for the
  real model: at most a 1024² image) with a mask, and the output comes back as [B, C, h, w].
- Text: the pipeline's `encode_prompt` — the pooled, projected outputs of its two CLIPs (concatenated), T5-XXL's
  last hidden state and *every* hidden state of Llama 3.1 8B Instruct (stacked; each block reads the one its
  `llama_layers` names). T5 and Llama are padded to the same fixed length (min(128, each tokenizer's limit)) and
  the transformer reads them unmasked, padding included, so the cache keeps them whole: one [L + 1, W] tensor per
  caption, row t < L holding T5's token t then Llama's token t of every layer (W = T5 width + layers · Llama
  width), row L the pooled vector zero-padded to W. `predict` unpacks it. Every caption has the same length, so a
  batch never pads and its mask is all ones.
- Time and sign: the transformer is conditioned on t = 1000 · σ (the scheduler's timesteps, as the pipeline and
  diffusers' script pass them) and predicts x0 − ε; the pipeline negates it into the scheduler's velocity ε − x0,
  and so do diffusers' training script (`model_pred * -1`, target noise − x0) and `predict`, so the loss is the
  shared rectified-flow MSE against ε − x0.
- Timesteps: `shift` is the scheduler's: a static shift (`shift` of FlowMatchEulerDiscreteScheduler, 3.0 for Dev
  and Fast; `flow_shift` of the UniPC scheduler Full may ship), or, where a directory turns dynamic shifting on,
  `calculate_shift` of the transformer's max_seq, the one μ the pipeline passes at every resolution.
- The mixture of experts. diffusers' HiDream training script loads the transformer with
  `force_inference_output=True`: the router adds no auxiliary loss and the output comes back as [B, C, h, w];
  but the routed experts then run `moe_infer`, under `torch.no_grad`, so no gradient reaches them or flows back
  through them. lorad keeps that forward — the same routing, the same outputs, no auxiliary loss
  (`load_model`: the config's `force_inference_output` on, and each router's) — and runs the routed experts
  through the feed-forward's training branch while training, which computes the same sum with autograd: the
  gradient is the loss's own. (Samples and the validation loss run in eval mode: `moe_infer`.)
- LoRA targets (DEFAULT_TARGETS): in every double and single block, attention's to_q / to_k / to_v / to_out and
  the text stream's to_q_t / to_k_t / to_v_t / to_out_t, the image feed-forward's shared expert (w1 / w2 / w3:
  every token passes it) and the double blocks' text feed-forward ff_t (w1 / w2 / w3). The routed experts
  (`ff_i.experts.j.w1 | w2 | w3`) carry no LoRA by default: each sees only the tokens the frozen router sends it
  (the router's weight is a plain parameter, not a linear, and is never adapted); lora.targets may name them,
  and they then train (see above). Both loaders below map every linear of the transformer.
- Full, Dev and Fast: the same transformer class and the same loss (Dev and Fast are guidance-distilled; their
  samples want `sample.guidance` ≤ 1, which turns the pipeline's CFG pass off; Full samples with CFG, 5.0 by the
  pipeline's default). The pipeline renders every sample at its fixed area (128 latents², 1024² pixels);
  `sample_pipeline` sets that area from sample.width × sample.height, so a sample is rendered at the size asked.

Export (both formats keep diffusers' module paths, which are HiDream's original ones; alpha / r folded into
lora_B; no `.alpha` keys):

`pytorch_lora_weights.safetensors` (diffusers; export.py's diffusers_lora_file):

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)
    metadata "lora_adapter_metadata"          LoraConfig with lora_alpha = r

read by `HiDreamImagePipeline.load_lora_weights` (`HiDreamImageLoraLoaderMixin`) at scale 1.

`hidream_lora_comfyui.safetensors` (ComfyUI):

    diffusion_model.<module path>.lora_A.weight   [r, in]
    diffusion_model.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)

ComfyUI's HiDream model (comfy/ldm/hidream/model.py) has the original checkpoint's module names, and they are
diffusers' (`double_stream_blocks.i.block.attn1.to_q`, `…block.ff_i.experts.j.w1`, `…block.ff_i.shared_experts.w2`,
`…block.ff_t.w3`, `caption_projection.i.linear`, `final_layer.linear`, `final_layer.adaLN_modulation.1`,
`t_embedder.timestep_embedder.linear_1`, `p_embedder.pooled_embedder.linear_2`, `x_embedder.proj`): comfyui_name is
the identity. ComfyUI's LoRA key map (comfy/lora.py, model_lora_keys_unet) maps, for a HiDream model and a weight
`diffusion_model.<path>.weight`:

    diffusion_model.<path>           the generic rule, every model
    transformer.<path>               its HiDream branch ("SimpleTuner regular format")
    lycoris_<path, dots as _>        its HiDream branch ("SimpleTuner lycoris format")

and its LoRA adapter reads `<key>.lora_A.weight` / `<key>.lora_B.weight`, with `<key>.alpha` when there is one,
else scale 1: the trained strength, since alpha / r is folded. So ComfyUI reads both files. The alpha is folded
rather than written because diffusers reads the ComfyUI file too: `HiDreamImageLoraLoaderMixin.lora_state_dict`
turns `diffusion_model.` into `transformer.` (`_convert_non_diffusers_hidream_lora_to_diffusers`), and
`load_lora_weights` refuses a key without "lora" in it, an `.alpha` included. (The stored ComfyUI snapshot's
comfy/lora.py predates HiDream; the HiDream branch above is read from later copies of that file in the code index,
and ComfyUI itself is not run here: the ComfyUI side is checked against these rules as written, not in ComfyUI.)

lora.type: DoRA goes in the diffusers file only (lora_magnitude_vector beside A and B, which
HiDreamImageLoraLoaderMixin loads as DoRA). LoKr and LoHa go in the ComfyUI file only, as LyCORIS tensors with their
`.alpha` under the same `diffusion_model.<module path>` keys (export.folded_comfyui_file): ComfyUI's LoKr and LoHa
adapters read `<key>.lokr_w1`, ... for every key its LoRA key map holds; diffusers reads neither type.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.families.image.base import ImageFamily
from engine.families.image.base import sample_pipeline as base_sample_pipeline
from engine.families.image.export import folded_comfyui_file, output_files
from engine.families.image.model import pipeline_shift_mu

_BLOCK = r"^(double_stream_blocks|single_stream_blocks)\.\d+\.block\."
DEFAULT_TARGETS = (_BLOCK + r"(attn1\.(to_q|to_k|to_v|to_out)(_t)?|ff_i\.shared_experts\.(w1|w2|w3)"
                   r"|ff_t\.(w1|w2|w3))$")
# Kept in the model dtype under fp8: the embedders, the caption projections (run once per step on the text) and the
# final layer.
FP8_SKIP = r"^(t_embedder|p_embedder|x_embedder|caption_projection|final_layer)(\.|$)"
COMFYUI_FILE = "hidream_lora_comfyui.safetensors"
MAX_TEXT_LEN = 128  # the pipeline's max_sequence_length: T5 and Llama are padded to it


def comfyui_name(module: str) -> str:
    """ComfyUI's name of a diffusers HiDream module path: the same (the module docstring)."""
    return module


def comfyui_lora_keys(weight: str) -> list[str]:
    """The LoRA keys ComfyUI's key map sends to `weight` (diffusion_model.<path>.weight) of a HiDream model (the
    docstring's table: the generic rule, then its HiDream branch)."""
    path = weight.removeprefix("diffusion_model.").removesuffix(".weight")
    return [f"diffusion_model.{path}", f"transformer.{path}", "lycoris_" + path.replace(".", "_")]


def text_max_len(model_path: str, revision: str | None) -> int:
    """Tokens of T5 and of Llama: the pipeline's 128, capped by both tokenizers' own limits (one length for both,
    so that the cache's rows hold a T5 token and a Llama token each)."""
    from transformers import AutoTokenizer

    n = MAX_TEXT_LEN
    for sub in ("tokenizer_3", "tokenizer_4"):
        tok = AutoTokenizer.from_pretrained(model_path, subfolder=sub, revision=revision)
        n = min(n, int(getattr(tok, "model_max_length", n) or n))
    return n


def pack_text(t5: torch.Tensor, llama: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """One caption's T5 [L, D5], Llama [layers, L, D4] and pooled [P] → the cached [L + 1, D5 + layers · D4]."""
    rows = torch.cat([t5, llama.permute(1, 0, 2).flatten(1)], dim=1)
    if pooled.shape[0] > rows.shape[1]:
        raise ValueError(f"HiDream's pooled text ({pooled.shape[0]}) is wider than its token rows ({rows.shape[1]})")
    return torch.cat([rows, torch.nn.functional.pad(pooled, (0, rows.shape[1] - pooled.shape[0]))[None]])


def unpack_text(embeds: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, L + 1, W] cached captions → (T5 [B, L, D5], Llama [layers, B, L, D4], pooled [B, P]) as the
    transformer takes them (its caption_channels are [D5, D4], its text_emb_dim P)."""
    d5, d4 = config.caption_channels
    rows = embeds[:, :-1]
    llama = rows[..., d5:].unflatten(-1, (-1, d4)).permute(2, 0, 1, 3)
    return rows[..., :d5], llama, embeds[:, -1, : config.text_emb_dim]


def check_llama(model_path: str) -> None:
    """Refuse (naming model.path) a directory whose model_index.json names no Llama (text_encoder_4, tokenizer_4):
    the pipeline cannot encode a caption without it, and lorad fetches nothing the directory does not name."""
    from engine.errors import JobInvalid
    from engine.registry.facts import read_config

    index = read_config(Path(model_path) / "model_index.json")
    missing = [k for k in ("text_encoder_4", "tokenizer_4") if index and not (index.get(k) or [None])[-1]]
    if missing:
        raise JobInvalid(f"model.path: {model_path} names no {' or '.join(missing)} in its model_index.json: "
                         "HiDream-I1 encodes captions with Llama 3.1 8B Instruct too; put it in text_encoder_4/ and "
                         "tokenizer_4/ and name them there")


def check_token_limit(cfg: JobConfig, model_path: str) -> None:
    """Refuse (naming data.resolution) a resolution with a non-square bucket of more image tokens than the
    transformer pads to (max_resolution² / patch²: 4096, a 1024² image, for the real model): its forward would fail.
    Before anything is cached, so the job fails as invalid (never retried), not as a crash."""
    from engine.config.buckets import buckets_for
    from engine.errors import JobInvalid
    from engine.registry.facts import read_config
    from engine.registry.families import spatial_multiple

    conf = read_config(Path(model_path) / "transformer" / "config.json")
    if not conf:
        return  # a hub id not yet downloaded: the trainer asks again with the directory
    rows, cols = conf.get("max_resolution", (128, 128))
    patch = conf.get("patch_size") or 2
    max_seq = rows * cols // (patch * patch)
    multiple = spatial_multiple("hidream", model_path)
    for res in cfg.data.resolution:
        over = [(w, h) for w, h in buckets_for(res, multiple)
                if w != h and (w // multiple) * (h // multiple) > max_seq]
        if over:
            w, h = max(over, key=lambda b: b[0] * b[1])
            fits = int(math.isqrt(max_seq)) * multiple
            raise JobInvalid(f"data.resolution: {res} gives buckets such as {w}x{h}, "
                             f"{(w // multiple) * (h // multiple)} image tokens; HiDream-I1 pads a non-square "
                             f"image to its transformer's {max_seq} image tokens and takes no more: use at most {fits}")


class HiDreamModel:
    """The HiDream-I1 half of an ImageFamily (see the module docstring)."""

    name = "hidream"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP
    config = None  # the transformer's config, once HiDreamFamily.load_model has read it (sample_kwargs)

    def transformer_class(self) -> type:
        from diffusers import HiDreamImageTransformer2DModel

        return HiDreamImageTransformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        return text_max_len(model_path, revision)

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

        vae = pipe.vae
        lat = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        return ((lat - vae.config.shift_factor) * vae.config.scaling_factor)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(text, device=device, do_classifier_free_guidance=False,
                                                        max_sequence_length=max_len)
        return pack_text(t5[0], llama[:, 0], pooled[0])

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        """μ = log of the scheduler's static shift; or, dynamic, calculate_shift of the transformer's max_seq (the
        pipeline's one μ), which load_model puts in `sched`."""
        from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift

        if sched.get("use_dynamic_shifting", False):
            return pipeline_shift_mu(calculate_shift, {}, sched.get("max_seq", image_seq_len))
        return math.log(sched.get("flow_shift") or sched.get("shift", 1.0))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the transformer patchifies inside its forward and hands back [B, C, h, w]

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        dtype, device = inner.dtype, x_t.device
        t5, llama, pooled = unpack_text(embeds.to(device, dtype), inner.config)
        out = model(hidden_states=x_t.to(dtype), timesteps=(sigma * 1000).to(device, torch.float32),
                    encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama, pooled_embeds=pooled,
                    return_dict=False)[0]
        return -out

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is the pipeline's CFG scale against the negative prompt (the empty caption by default);
        # at 1 or below the pipeline makes no negative pass (Dev, Fast).
        out = {}
        for prefix, e in (("", emb), ("negative_", negative)):
            t5, llama, pooled = unpack_text(e["prompt_embeds"][None].to(device, dtype), self.config)
            out.update({f"{prefix}prompt_embeds_t5": t5, f"{prefix}prompt_embeds_llama3": llama,
                        f"{prefix}pooled_prompt_embeds": pooled})
        return out

    def sample_pipeline(self, model_path: str, cfg: JobConfig, transformer):
        """The pipeline with its fixed rendering area set to the sample's: HiDreamImagePipeline scales every size to
        (default_sample_size · vae_scale_factor)² pixels."""
        pipe = base_sample_pipeline(model_path, cfg, transformer)
        pipe.default_sample_size = max(1, round(math.sqrt(cfg.sample.width * cfg.sample.height)
                                                / pipe.vae_scale_factor))
        return pipe

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        # hidream_lora_comfyui.safetensors: diffusion_model.<module path>, alpha / r folded into B.
        return output_files(model, cfg, out_dir, meta, lambda md: folded_comfyui_file(
            model, cfg, out_dir, md, COMFYUI_FILE, "hidream", comfyui_name))


class HiDreamFamily(ImageFamily):
    """ImageFamily, plus the mixture of experts' training forward and the transformer's config the cached text's
    layout and the dynamic shift read (the module docstring)."""

    def prepare(self, cfg: JobConfig, workdir: Path, log, bar=None) -> None:
        from engine.builtin.models import resolve_model_path

        path = resolve_model_path(cfg.model.path, workdir)
        check_llama(path)
        check_token_limit(cfg, path)
        super().prepare(cfg, workdir, log, bar=bar)

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        from diffusers.models.transformers.transformer_hidream_image import MoEGate

        transformer = super().load_model(cfg, workdir, device, log)
        # The output in [B, C, h, w] in both modes, and no router's auxiliary loss (diffusers' script's setting);
        # the experts keep their own flag off, so training runs their differentiable branch.
        transformer.register_to_config(force_inference_output=True)
        for m in transformer.modules():
            if isinstance(m, MoEGate):
                m._force_inference_output = True
        self.sched["max_seq"] = transformer.max_seq
        self.model.config = transformer.config
        return transformer


def HiDream():  # noqa: N802 - reads as the family's class at get_family's call site
    return HiDreamFamily(HiDreamModel())
