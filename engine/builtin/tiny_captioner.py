"""`builtin:tiny-captioner`: a LLaVA-shaped vision-language model with random weights, for the caption stage's
tests and demos (data.captioner.model). A 2-layer CLIP vision tower, a 2-layer Llama and the byte-level tokenizer,
saved with `save_pretrained` so the real loading code (AutoProcessor, AutoModelForImageTextToText) reads it;
its captions are random bytes, deterministic for a seed. Its image processor is the PIL one: no torchvision."""

from __future__ import annotations

from pathlib import Path

from engine.builtin.models import BuiltinModel, byte_level_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
IMAGE = 32  # pixels a side the vision tower sees
PATCH = 8


def build_tiny_captioner(dest: Path, seed: int = 4321) -> None:
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = byte_level_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=-1, vision_feature_select_strategy="default",  # the CLS feature dropped
                      image_seq_length=(IMAGE // PATCH) ** 2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(cfg)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}),
        tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1)  # CLIP's CLS: one feature more than patches, which "default" drops
    model.save_pretrained(dest)
    processor.save_pretrained(dest)


# Not training bases (BUILTIN_MODELS): the vision-language models data.captioner.model may name (engine/captioning/).
BUILTIN_CAPTIONERS = {
    "tiny-captioner": BuiltinModel(
        "captioner", "A LLaVA-shaped vision-language model (2-layer CLIP tower, 2-layer Llama) with random weights.",
        "config.json", build_tiny_captioner),
}
