"""SDXL's two text encoders trained with the UNet (`lora.text_encoder: true`).

Without it the encoders are frozen: each caption is encoded once, before training, and the cache holds the
embeddings (family.py). With it the cache holds each caption's token ids instead (both tokenizers, padded to their
77 tokens, as `encode_prompt` tokenises), under keys of their own kind ("sdxl_tokens": never mistaken for an
embedding entry of the same caption), and every step encodes them through the encoders with their LoRA:

- CLIP ViT-L (`text_encoder`, CLIPTextModel) and OpenCLIP bigG (`text_encoder_2`, CLIPTextModelWithProjection),
  as the pipeline's `encode_prompt` uses them: each encoder's penultimate hidden state (`hidden_states[-2]`),
  side by side (768 + 1280), and the second encoder's projected pooled output (`text_embeds`, 1280).
- LoRA (or lora.type's adapter) on every encoder layer's attention q/k/v/out_proj and MLP fc1/fc2 (TE_TARGETS):
  what kohya's text-encoder LoRA trains, and exactly the linears ComfyUI's CLIP key map names (export.py).
  Embeddings, layer norms and bigG's text_projection stay frozen.
- The encoders train with the UNet in one optimizer (one checkpoint, one exact resume), at train.lr or at
  lora.text_encoder_lr (their own parameter group, following train.schedule at that multiple); they stay in
  the job's dtype (model.base_precision quantises the UNet only: they are 0.8 B parameters together).

The trained model is one module, SDXLWithText, holding the three under the pipeline's names (`unet`,
`text_encoder`, `text_encoder_2`): its parameters, checkpoints and exports say which part each belongs to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# transformers 5 names CLIPTextModel's layers encoder.layers.N (no text_model.), the projection model's
# text_model.encoder.layers.N; the files always say text_model.encoder.layers.N (export.py: file_path)
TE_TARGETS = r"^(text_model\.)?encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$"
IDS = ("input_ids", "input_ids_2")
ENCODERS = ("text_encoder", "text_encoder_2")
TOKENS_KIND = "sdxl_tokens"  # the text cache entries' kind (engine/families/image/cache.py: text_key)


def open_tokenizers(model_path: str, revision: str | None) -> Callable[[str], dict[str, torch.Tensor]]:
    """The cache's text encoder when the encoders train: a caption -> its two tokenizers' ids (77 each, padded
    and truncated as encode_prompt does)."""
    from transformers import CLIPTokenizer

    toks = [CLIPTokenizer.from_pretrained(model_path, subfolder=sub, revision=revision)
            for sub in ("tokenizer", "tokenizer_2")]

    def encode(text: str) -> dict[str, torch.Tensor]:
        return {name: tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True,
                          return_tensors="pt").input_ids[0]
                for name, tok in zip(IDS, toks, strict=True)}

    return encode


def load_text_encoders(path: str, cfg, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Both encoders, frozen in the job's dtype, each with lora.type's adapter ("default") on TE_TARGETS; with
    lora.text_encoder_lr their adapter's parameters carry its ratio to train.lr (the optimizer's groups)."""
    from peft import inject_adapter_in_model
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from engine.training.adapters import peft_config, set_adapter_dtype
    from engine.training.dtypes import torch_dtype

    out = []
    for sub, cls in zip(ENCODERS, (CLIPTextModel, CLIPTextModelWithProjection), strict=True):
        te = cls.from_pretrained(path, subfolder=sub, revision=cfg.model.revision, dtype=torch_dtype(cfg.model.dtype))
        te.requires_grad_(False)
        conf = peft_config(cfg.lora, TE_TARGETS)
        # peft itself, not transformers' add_adapter (which asks for a newer peft than the lock's); peft_config
        # kept where the exports read it, as add_adapter keeps it
        inject_adapter_in_model(conf, te, adapter_name="default")
        te.peft_config = {"default": conf}
        set_adapter_dtype(te, cfg.lora.dtype)
        te.to(device)
        if cfg.lora.text_encoder_lr is not None:
            from engine.training.optim import LR_SCALE

            for p in te.parameters():
                if p.requires_grad:
                    setattr(p, LR_SCALE, cfg.lora.text_encoder_lr / cfg.train.lr)
        out.append(te)
    return out[0], out[1]


class SDXLWithText(torch.nn.Module):
    """The UNet and both text encoders, each with its LoRA; forward = encode the token ids, then the UNet."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module, text_encoder_2: torch.nn.Module):
        super().__init__()
        self.unet, self.text_encoder, self.text_encoder_2 = unet, text_encoder, text_encoder_2

    @property
    def dtype(self) -> torch.dtype:
        return self.unet.dtype

    @property
    def device(self) -> torch.device:
        return self.unet.device

    @property
    def config(self):
        return self.unet.config

    def encode(self, input_ids: torch.Tensor, input_ids_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [b, 77, 768 + 1280], pooled_prompt_embeds [b, 1280]) as encode_prompt makes them."""
        one = self.text_encoder(input_ids.to(self.text_encoder.device), output_hidden_states=True)
        two = self.text_encoder_2(input_ids_2.to(self.text_encoder_2.device), output_hidden_states=True)
        return torch.cat([one.hidden_states[-2], two.hidden_states[-2]], dim=-1), two.text_embeds

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, *, input_ids: torch.Tensor,
                input_ids_2: torch.Tensor, time_ids: torch.Tensor, return_dict: bool = False):
        embeds, pooled = self.encode(input_ids, input_ids_2)
        dtype = self.unet.dtype
        return self.unet(sample, timestep, encoder_hidden_states=embeds.to(dtype),
                         added_cond_kwargs={"text_embeds": pooled.to(dtype), "time_ids": time_ids},
                         return_dict=return_dict)

    def set_adapters_enabled(self, enabled: bool) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for mod in self.modules():
            if isinstance(mod, BaseTunerLayer):
                mod.enable_adapters(enabled)

    # train.dop's preservation loss turns the whole adapter off and on (engine/families/image/dop.py)
    def disable_adapters(self) -> None:
        self.set_adapters_enabled(False)

    def enable_adapters(self) -> None:
        self.set_adapters_enabled(True)


def file_path(module: str) -> str:
    """A text encoder's module path as the LoRA files name it: text_model.encoder.layers.N.<m>."""
    return module if module.startswith("text_model.") else f"text_model.{module}"


def parts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The trained networks by their pipeline names: the UNet alone, or the UNet and both encoders."""
    if isinstance(model, SDXLWithText):
        return {"unet": model.unet, "text_encoder": model.text_encoder, "text_encoder_2": model.text_encoder_2}
    return {"unet": model}
