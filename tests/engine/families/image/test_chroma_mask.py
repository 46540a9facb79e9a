"""Chroma attends to each caption's tokens and one padding token (ChromaPipeline's mask), whatever the batch."""

from __future__ import annotations

import torch

from engine.config.job import parse_job
from tests.helpers.images import make_images

CAPTIONS = ("a green tower", "a red square on grass")


def test_a_padded_batch_predicts_for_each_caption_what_it_predicts_alone(tmp_path):
    """The cache keeps the tokens the pipeline's mask keeps (the caption's and the first padding token); a batch
    padded beyond its longest caption (as one with the empty caption is) predicts what each sample does unpadded."""
    from diffusers import ChromaPipeline

    from engine.builtin.tiny_chroma import build_tiny_chroma
    from engine.families.image.chroma import ChromaModel
    from engine.families.image.dataset import pad_texts

    build_tiny_chroma(tmp_path / "model")
    pipe = ChromaPipeline.from_pretrained(tmp_path / "model", vae=None)
    cfg = parse_job({"name": "m", "model": {"family": "chroma", "path": str(tmp_path / "model"), "dtype": "float32"},
                     "data": {"path": str(make_images(tmp_path / "data", [("a.png", 32, 32, "x")]))}}, tmp_path)
    chroma, transformer = ChromaModel(), pipe.transformer
    texts = [chroma.encode_text(pipe, t, 32, torch.device("cpu")) for t in CAPTIONS]
    assert [t.shape[0] for t in texts] == [len(pipe.tokenizer(t).input_ids) + 1 for t in CAPTIONS]
    g = torch.Generator().manual_seed(0)
    x_t, sigma = torch.randn(2, 4, 4, 6, generator=g), torch.tensor([0.3, 0.8])
    embeds, mask = pad_texts(texts, 30)
    with torch.no_grad():
        batch = chroma.predict(transformer, transformer, x_t, sigma, embeds, mask, cfg)
        alone = [chroma.predict(transformer, transformer, x_t[i:i + 1], sigma[i:i + 1], texts[i][None],
                                torch.ones(1, texts[i].shape[0]), cfg) for i in range(2)]
    torch.testing.assert_close(batch, torch.cat(alone), rtol=1e-5, atol=1e-6)
