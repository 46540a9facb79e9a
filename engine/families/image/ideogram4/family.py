"""Ideogram 4 LoRA: diffusers `Ideogram4Transformer2DModel` (the conditional one), trained by flow matching
(engine/families/image/base.py).

Ideogram 4 is a single-stream DiT (34 blocks, 18 heads × 256 = 4608 wide, SwiGLU 12288, tanh-gated AdaLN) over one
packed sequence [text][image], conditioned per token on 13 hidden states of Qwen3-VL-8B concatenated (53248 features),
with the FLUX.2 VAE. Inference is asymmetric classifier-free guidance: a second, separately trained
`unconditional_transformer` denoises the image tokens alone, and the pipeline blends v = g·v_cond + (1 − g)·v_uncond.
LoRA trains the conditional `transformer` only (diffusers' Ideogram4LoraLoaderMixin loads into it alone; musubi-tuner
and ai-toolkit train the same one). What is Ideogram 4's own, all through diffusers' `Ideogram4Pipeline`:

- Latents: the VAE's posterior mode cut into 2×2 patches in the pipeline's order (patch row, patch column, channel:
  the inverse of its decode's view/permute) and normalised by the VAE's batch-norm running statistics — the inverse
  of what `__call__` decodes. The cache stores that normalised latent unpatched, [C, h, w], so flips, masks and
  buckets see a plain latent grid; `pack` is the patching, [B, C, h, w] → [B, h/2·w/2, 4C].
- Text: the pipeline's `encode_prompt` (the caption in Qwen3-VL's chat template, the hidden states of decoder layers
  0, 3, …, 33, 35 concatenated per token), run at the caption's own length (its left padding changes no real
  token); the cache keeps the real tokens, [L, 13·D], in the encoder's dtype. A batch is padded
  and `predict` lays each sample out as the pipeline does: text left-padded to the batch's longest caption, then
  the image tokens, with the pipeline's own `_prepare_ids` (text positions 0…n−1, image positions (0, row, col) +
  65536, a segment mask that keeps padding apart, the role indicator). Padding never changes a real token.
- Time and sign: the transformer runs in model time t = 1 − σ (0 noise, 1 data) and predicts x0 − ε; the pipeline
  steps its scheduler with −v, and `predict` negates it likewise, so the loss is the shared MSE against ε − x0 on
  the image tokens.
- Timesteps: the pipeline's inference schedule is logit-normal around μ = 0.5·log(pixels / 512²) (its
  `_resolution_aware_mu`, base μ 0) with std 1.5. `shift` moves uniform t by e^μ with that same μ (logit σ =
  logit t + μ); `sigmoid` is the unshifted logit-normal. musubi-tuner's `ideogram4_shift` draws the pipeline's
  logit-normal itself; lorad keeps its three kinds (and train.timestep_bias) for every family.
- Caption dropout trains the conditional transformer on the empty caption's tokens; the unconditional transformer
  is never trained (no text at all), so guidance at inference is unchanged by the LoRA's dropout.
- LoRA targets (DEFAULT_TARGETS): every block's attention to_q/to_k/to_v/to_out.0 and SwiGLU w1/w2/w3 (musubi-tuner's
  set; the per-block adaln_modulation and the embedders are left alone unless lora.targets names them).

Export (alpha / r folded into lora_B in the diffusers file; `.alpha` keys in the ComfyUI file):

`pytorch_lora_weights.safetensors` (diffusers; export.py's diffusers_lora_file, as for FLUX.2 and Krea 2):

    transformer.<module path>.lora_A.weight   [r, in]
    transformer.<module path>.lora_B.weight   [out, r]   × alpha / r (folded)
    metadata "lora_adapter_metadata"          LoraConfig with lora_alpha = r

read by `Ideogram4Pipeline.load_lora_weights` (Ideogram4LoraLoaderMixin, no network alphas) at scale 1.

`ideogram4_lora_comfyui.safetensors` (ComfyUI), under the original checkpoint's names (Comfy-Org's single-file
`ideogram4_*.safetensors`, which musubi-tuner loads strictly into a model with these names, and the names diffusers'
`_convert_non_diffusers_ideogram4_lora_to_diffusers` reads):

    layers.i.attention.to_q | to_k | to_v     layers.i.attention.qkv   (one fused linear, rows q, k, v)
    layers.i.attention.to_out.0               layers.i.attention.o
    layers.i.feed_forward.w1 | w2 | w3        layers.i.feed_forward.w1 | w2 | w3
    layers.i.adaln_modulation                 layers.i.adaln_modulation
    input_proj, llm_cond_proj, adaln_proj,    the same names
    t_embedding.mlp_in | mlp_out, final_layer.linear | adaln_modulation

and the file is

    diffusion_model.<name>.lora_A.weight   [k·r, in]    k = the fused parts trained (3 for qkv, else 1)
    diffusion_model.<name>.lora_B.weight   [out, k·r]   block-diagonal over q, k, v for qkv
    diffusion_model.<name>.alpha           k·alpha (so alpha' / rank' = alpha / r)

ComfyUI's generic rule (comfy/lora.py, model_lora_keys_unet: `diffusion_model.<state-dict path>` → that
`.weight`) maps each key onto the checkpoint's weight, scale alpha / rows of lora_A; the fused q, k, v update is
exact (stacked downs, block-diagonal up: flux_export.py). UNVERIFIED against ComfyUI itself: the ComfyUI source this
was written from (the stored snapshot of comfy/lora.py, comfy/model_detection.py) has no Ideogram 4 model, so the
names come from the checkpoint, not from ComfyUI's model file. diffusers reads the same file (its converter strips
`diffusion_model.`, splits qkv's up in thirds and folds `.alpha`) — for block modules only: it refuses keys outside
layers.i (the embedders), so lora.targets beyond the blocks gives a file diffusers' loader rejects.

lora.type: DoRA goes in the diffusers file only (lora_magnitude_vector beside A and B; diffusers loads it as DoRA).
LoKr and LoHa are refused: the checkpoint fuses q, k and v, and a Kronecker or Hadamard update of each apart is no
LyCORIS update of the fused linear.

Samples: `Ideogram4Pipeline.__call__` encodes its prompt itself, so the sampler is the pipeline with `encode_prompt`
answered from the cache (CachedPromptIdeogram4); the unconditional transformer is loaded from the model directory
beside the training one (in fp8 when the base is), and sample.guidance is the pipeline's constant guidance_scale (no negative prompt: the
unconditional pass has no text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.errors import JobInvalid
from engine.families.image.base import ImageFamily
from engine.families.image.base import sample_pipeline as plain_sample_pipeline
from engine.families.image.export import comfyui_state_dict, lora_modules, output_files, save
from engine.families.image.model import tokenizer_text_len

DEFAULT_TARGETS = r"^layers\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.(w1|w2|w3))$"
# Kept in the model dtype under fp8: the image embedder, the timestep path and the final layer (small, once per
# step; diffusers keeps t_embedding and adaln_proj out of its layerwise casting too). llm_cond_proj (53248 wide,
# 0.25 B) is not small.
FP8_SKIP = r"^(input_proj|t_embedding|adaln_proj|embed_image_indicator|final_layer)(\.|$)"
COMFYUI_FILE = "ideogram4_lora_comfyui.safetensors"
MAX_TEXT_LEN = 2048  # the pipeline's max_sequence_length
PIXELS_PER_TOKEN = 16 * 16  # 8x VAE, 2x2 patches

_QKV = ("attention.to_q", "attention.to_k", "attention.to_v")
_BLOCK_NAMES = {**{p: ("attention.qkv", _QKV) for p in _QKV}, "attention.to_out.0": ("attention.o", None),
                **{f"feed_forward.{w}": (f"feed_forward.{w}", None) for w in ("w1", "w2", "w3")},
                "adaln_modulation": ("adaln_modulation", None)}
_TOP_NAMES = {"input_proj", "llm_cond_proj", "adaln_proj", "t_embedding.mlp_in", "t_embedding.mlp_out",
              "final_layer.linear", "final_layer.adaln_modulation"}


def comfyui_target(module: str) -> tuple[str, tuple[str, ...] | None]:
    """(the checkpoint's / ComfyUI's name, the diffusers parts fused into it in row order, or None) of a diffusers
    Ideogram 4 module path (the docstring's table)."""
    head, _, rest = module.partition(".")
    if head == "layers":
        i, _, part = rest.partition(".")
        if i.isdigit() and part in _BLOCK_NAMES:
            name, parts = _BLOCK_NAMES[part]
            return f"layers.{i}.{name}", parts
    if module in _TOP_NAMES:
        return module, None
    raise ValueError(f"no ComfyUI name for Ideogram 4 module {module!r}")


def comfyui_name(module: str) -> str:
    """The ComfyUI key (without `diffusion_model.`) a diffusers module's LoRA is written under."""
    return comfyui_target(module)[0]


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h/2·w/2, 4C], each token's features in (patch row, patch column, channel) order: the
    inverse of Ideogram4Pipeline's decode (view(B, gh, gw, 2, 2, C).permute(0, 5, 1, 3, 2, 4))."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """pack's inverse: [B, h/2·w/2, 4C] → [B, C, h, w] (the pipeline's decode layout)."""
    b, _n, f = tokens.shape
    c = f // 4
    return tokens.view(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


class CachedCaption(str):
    """A sample prompt whose text features come from the cache: a str (the pipeline's check_inputs wants one)
    carrying its [L, features] tensor."""

    features: torch.Tensor

    def __new__(cls, features: torch.Tensor):
        obj = super().__new__(cls, "<cached caption>")
        obj.features = features
        return obj


def cached_prompt_pipeline(base):
    """Ideogram4Pipeline with encode_prompt answered from a CachedCaption, laid out by the pipeline's own _prepare_ids
    (max_sequence_length = the caption's length: no padding)."""
    from diffusers import Ideogram4Pipeline

    class CachedPromptIdeogram4(Ideogram4Pipeline):
        def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
            feats = prompt.features.to(device, torch.float32)
            n = feats.shape[0]
            pos, seg, ind = self._prepare_ids([n], grid_h, grid_w, max_sequence_length, device)
            emb = feats.new_zeros(1, max_sequence_length + grid_h * grid_w, feats.shape[1])
            emb[0, max_sequence_length - n : max_sequence_length] = feats
            return emb, pos, seg, ind

    return CachedPromptIdeogram4(**base.components)


class Ideogram4Model:
    """The Ideogram 4 half of an ImageFamily (see the module docstring)."""

    name = "ideogram4"
    default_targets = DEFAULT_TARGETS
    fp8_skip = FP8_SKIP

    def transformer_class(self) -> type:
        from diffusers import Ideogram4Transformer2DModel

        return Ideogram4Transformer2DModel

    def text_max_len(self, model_path: str, revision: str | None) -> int:
        """Tokens per caption: the pipeline's 2048, capped by the tokenizer's own limit (the tiny one has 96)."""
        return tokenizer_text_len(model_path, revision, MAX_TEXT_LEN)

    def encode_latents(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2 import retrieve_latents

        vae = pipe.vae
        lat = retrieve_latents(vae.encode(pixels), sample_mode="argmax")  # [1, C, h, w]
        mean = vae.bn.running_mean.to(lat)
        std = torch.sqrt(vae.bn.running_var.to(lat) + vae.config.batch_norm_eps)
        h, w = lat.shape[-2:]
        return unpack((pack(lat) - mean) / std, h, w)[0]

    def encode_text(self, pipe, text: str, max_len: int, device: torch.device) -> torch.Tensor:
        """The caption's real tokens, [L, 13·D], through the pipeline's encode_prompt at the caption's own length:
        its left padding to max_len changes no real token (the text encoder is causal and masks it) but would run
        the 8 B encoder over 2048 positions per caption."""
        from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR

        tok = pipe.tokenizer  # counted as encode_prompt tokenizes: the chat template, no special tokens added
        chat = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                       add_generation_prompt=True, tokenize=False)
        n = len(tok(chat, add_special_tokens=False)["input_ids"])
        if n > max_len:
            raise JobInvalid(f"data: a caption is too long for Ideogram 4 ({n} tokens with its chat template; the "
                             f"pipeline reads at most {max_len}): {text[:80]!r}")
        emb, _pos, _seg, ind = pipe.encode_prompt(text, grid_h=1, grid_w=1, max_sequence_length=n, device=device)
        # In the encoder's dtype: encode_prompt hands back float32, which would double a bf16 cache (106 KB per token
        # in bf16) for nothing — the pipeline casts the features to the transformer's dtype anyway.
        return emb[0, :n][ind[0, :n] == LLM_TOKEN_INDICATOR].to(pipe.text_encoder.dtype)

    def shift_mu(self, sched: dict[str, Any], image_seq_len: int) -> float:
        """μ of the pipeline's schedule for an image of `image_seq_len` tokens (base μ 0, its default)."""
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu

        return _resolution_aware_mu(height=image_seq_len * PIXELS_PER_TOKEN, width=1, base_mu=0.0)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return pack(x)

    def predict(self, model, inner, x_t, sigma, embeds, mask, cfg: JobConfig) -> torch.Tensor:
        from diffusers import Ideogram4Pipeline

        dtype, device = inner.dtype, x_t.device
        b, c, h, w = x_t.shape
        n_img, n_txt = (h // 2) * (w // 2), embeds.shape[1]
        lengths = [int(n) for n in mask.sum(dim=1)]
        # The pipeline's layout: each caption left-padded to the longest, then the image tokens.
        text = torch.zeros(b, n_txt + n_img, embeds.shape[-1], device=device, dtype=dtype)
        for i, n in enumerate(lengths):
            text[i, n_txt - n : n_txt] = embeds[i, :n].to(device, dtype)
        pos, seg, ind = Ideogram4Pipeline._prepare_ids(lengths, h // 2, w // 2, n_txt, device)
        hidden = torch.cat([torch.zeros(b, n_txt, 4 * c, device=device, dtype=dtype), pack(x_t.to(dtype))], dim=1)
        out = model(hidden_states=hidden, timestep=(1 - sigma).to(device, dtype), encoder_hidden_states=text,
                    position_ids=pos, segment_ids=seg, indicator=ind, return_dict=False)[0]
        return -out[:, n_txt:]  # x0 − ε in model time → the scheduler's ε − x0

    def sample_pipeline(self, model_path: str, cfg: JobConfig, transformer):
        from engine.frozen_base.precision import apply_base_precision
        from engine.training.dtypes import torch_dtype

        pipe = cached_prompt_pipeline(plain_sample_pipeline(model_path, cfg, transformer))
        # The unconditional transformer (as large as the trained one) in the base's fp8 when training's is: on a
        # 24 GB card the two fit side by side only so.
        if cfg.model.effective_base_precision == "fp8":
            apply_base_precision(pipe.unconditional_transformer, "fp8", transformer.device,
                                 compute_dtype=torch_dtype(cfg.model.dtype), skip=FP8_SKIP)
        pipe.unconditional_transformer.to(transformer.device)
        return pipe

    def sample_kwargs(self, emb, negative, device, dtype, cfg: JobConfig) -> dict[str, Any]:
        # sample.guidance is the constant guidance_scale (the pipeline's default is a per-step schedule, which
        # check_inputs refuses beside a scale); a negative prompt has no place (the unconditional pass sees no text).
        feats = emb["prompt_embeds"]
        return {"prompt": CachedCaption(feats), "max_sequence_length": feats.shape[0], "guidance_schedule": None}

    def export(self, model, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        def comfyui(md: dict[str, str]) -> str:
            sd = comfyui_state_dict(model, lora_modules(model), cfg.lora.rank, cfg.lora.alpha, target=comfyui_target,
                                    swap_halves=set(), key=lambda name: f"diffusion_model.{name}",
                                    suffixes=("lora_A.weight", "lora_B.weight"))
            kohya = {"ss_network_dim": str(cfg.lora.rank), "ss_network_alpha": str(cfg.lora.alpha),
                     "ss_base_model_version": "ideogram4"}
            return save(sd, Path(out_dir) / COMFYUI_FILE, {**md, **kohya})

        return output_files(model, cfg, Path(out_dir), meta, comfyui)


def Ideogram4():  # noqa: N802 - reads as the family's class at get_family's call site
    return ImageFamily(Ideogram4Model())
