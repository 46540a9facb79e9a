"""Small models lorad can build offline, for the quickstart, demos and tests, and where a job's model lives.

`model.path: builtin:tiny-llama` materialises a randomly initialised
Llama-architecture model (fixed seed, so every machine builds the same
weights) and a byte-level tokenizer into a directory with `save_pretrained`,
then the normal loader reads it back — the real loading code runs, and
nothing is downloaded. `builtin:tiny-flux` does the same for a FLUX.1-shaped
pipeline (engine/builtin/tiny_flux.py), `builtin:tiny-flux2` and `builtin:tiny-qwen-image`
for FLUX.2 and Qwen-Image (engine/builtin/tiny_pipelines.py), `builtin:tiny-z-image` for Z-Image
(engine/builtin/tiny_z_image.py), `builtin:tiny-chroma`
for Chroma (engine/builtin/tiny_chroma.py), `builtin:tiny-flux3` for FLUX.3 (engine/builtin/tiny_flux3.py; a modular
pipeline, so its marker is modular_model_index.json).
`builtin:tiny-krea2` for Krea 2 (engine/builtin/tiny_krea2.py). `builtin:tiny-wan22-5b` and `builtin:tiny-wan22-a14b`
for Wan 2.2 (engine/builtin/tiny_video.py), `builtin:tiny-hunyuan-video15` for HunyuanVideo 1.5
(engine/builtin/tiny_hunyuan_video.py). The edit models: `builtin:tiny-flux-kontext`
(tiny_flux.py), `builtin:tiny-qwen-image-edit` and `-plus` (tiny_pipelines.py); FLUX.2 takes references as is.

Importable without torch: job validation (engine/config/paths.py) reads BUILTIN_MODELS.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.storage.fsio import RealFs, ensure_dir_durable

BUILTIN_PREFIX = "builtin:"

TINY_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class BuiltinModel:
    family: str                         # the model.family it belongs to
    description: str
    marker: str                         # the file whose presence means the directory is complete
    build: Callable[[Path], None]       # writes the model directory to the given (temporary) path
    pipeline: str | None = None         # its model_index.json's pipeline class, where job validation needs it


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte symbols plus <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_llama(dest: Path, seed: int = 1234) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0, **TINY_LLAMA)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def _build_tiny_flux(dest: Path) -> None:
    from engine.builtin.tiny_flux import build_tiny_flux

    build_tiny_flux(dest)


def _build_tiny_flux_kontext(dest: Path) -> None:
    from engine.builtin.tiny_flux import build_tiny_flux

    build_tiny_flux(dest, kontext=True)


def _build_tiny_flux2(dest: Path) -> None:
    from engine.builtin.tiny_pipelines import build_tiny_flux2

    build_tiny_flux2(dest)


def _build_tiny_chroma(dest: Path) -> None:
    from engine.builtin.tiny_chroma import build_tiny_chroma

    build_tiny_chroma(dest)


def _build_tiny_qwen_image(dest: Path) -> None:
    from engine.builtin.tiny_pipelines import build_tiny_qwen_image

    build_tiny_qwen_image(dest)


def _build_tiny_qwen_image_edit(dest: Path) -> None:
    from engine.builtin.tiny_pipelines import build_tiny_qwen_image_edit

    build_tiny_qwen_image_edit(dest)


def _build_tiny_qwen_image_edit_plus(dest: Path) -> None:
    from engine.builtin.tiny_pipelines import build_tiny_qwen_image_edit

    build_tiny_qwen_image_edit(dest, plus=True)


def _build_tiny_z_image(dest: Path) -> None:
    from engine.builtin.tiny_z_image import build_tiny_z_image

    build_tiny_z_image(dest)


def _build_tiny_flux3(dest: Path) -> None:
    from engine.builtin.tiny_flux3 import build_tiny_flux3

    build_tiny_flux3(dest)


def _build_tiny_krea2(dest: Path) -> None:
    from engine.builtin.tiny_krea2 import build_tiny_krea2

    build_tiny_krea2(dest)


def _build_tiny_wan22_5b(dest: Path) -> None:
    from engine.builtin.tiny_video import build_tiny_wan22_5b

    build_tiny_wan22_5b(dest)


def _build_tiny_wan22_a14b(dest: Path) -> None:
    from engine.builtin.tiny_video import build_tiny_wan22_a14b

    build_tiny_wan22_a14b(dest)


def _build_tiny_hunyuan_video15(dest: Path) -> None:
    from engine.builtin.tiny_hunyuan_video import build_tiny_hunyuan_video15

    build_tiny_hunyuan_video15(dest)


BUILTIN_MODELS = {
    "tiny-llama": BuiltinModel(
        "causal_lm", "A 4-layer, 256-wide Llama with random weights and a byte-level tokenizer (~3M parameters).",
        "config.json", build_tiny_llama),
    "tiny-flux": BuiltinModel(
        "flux", "A FLUX.1-shaped pipeline (1 double + 1 single block, tiny VAE, CLIP and T5) with random weights.",
        "model_index.json", _build_tiny_flux),
    "tiny-flux-kontext": BuiltinModel(
        "flux", "A FLUX.1-Kontext-shaped edit pipeline (tiny-flux's layout, FluxKontextPipeline) with random weights.",
        "model_index.json", _build_tiny_flux_kontext, pipeline="FluxKontextPipeline"),
    "tiny-flux2": BuiltinModel(
        "flux2", "A FLUX.2-klein-shaped pipeline (2 double + 2 single blocks, tiny VAE, Qwen3) with random weights.",
        "model_index.json", _build_tiny_flux2, pipeline="Flux2KleinPipeline"),
    "tiny-qwen-image": BuiltinModel(
        "qwen_image", "A Qwen-Image-shaped pipeline (4 blocks, tiny video VAE, Qwen2.5-VL) with random weights.",
        "model_index.json", _build_tiny_qwen_image),
    "tiny-qwen-image-edit": BuiltinModel(
        "qwen_image", "A Qwen-Image-Edit-shaped pipeline (tiny-qwen-image's layout, a vision-capable processor) with "
        "random weights.", "model_index.json", _build_tiny_qwen_image_edit, pipeline="QwenImageEditPipeline"),
    "tiny-qwen-image-edit-plus": BuiltinModel(
        "qwen_image", "tiny-qwen-image-edit as Qwen-Image-Edit-Plus (several control images per target).",
        "model_index.json", _build_tiny_qwen_image_edit_plus, pipeline="QwenImageEditPlusPipeline"),
    "tiny-z-image": BuiltinModel(
        "z_image", "A Z-Image-shaped pipeline (4 layers + 2 refiner blocks, tiny FLUX.1-style VAE, Qwen3) with random "
        "weights.", "model_index.json", _build_tiny_z_image),
    "tiny-chroma": BuiltinModel(
        "chroma", "A Chroma-shaped pipeline (2 double + 2 single blocks, approximator, tiny VAE, T5) with random weights.",
        "model_index.json", _build_tiny_chroma),
    "tiny-flux3": BuiltinModel(
        "flux3", "A FLUX.3-shaped modular pipeline (1 block per mode + 4 single blocks, tiny FLUX.2 VAE, Qwen3-VL) "
        "with random weights.", "modular_model_index.json", _build_tiny_flux3),
    "tiny-krea2": BuiltinModel(
        "krea2", "A Krea-2-shaped pipeline (4 single-stream blocks + 2 + 2 text-fusion blocks, tiny Qwen-Image VAE, "
        "Qwen3-VL) with random weights.", "model_index.json", _build_tiny_krea2),
    "tiny-wan22-5b": BuiltinModel(
        "wan", "A Wan-2.2-TI2V-5B-shaped pipeline (2 blocks, tiny residual VAE, UMT5) with random weights.",
        "model_index.json", _build_tiny_wan22_5b),
    "tiny-wan22-a14b": BuiltinModel(
        "wan", "A Wan-2.2-T2V-A14B-shaped pipeline (two 2-block experts split at boundary 0.875, tiny VAE, UMT5) "
        "with random weights.", "model_index.json", _build_tiny_wan22_a14b),
    "tiny-hunyuan-video15": BuiltinModel(
        "hunyuan_video", "A HunyuanVideo-1.5-shaped t2v pipeline (2 blocks, tiny 16x VAE, Qwen2.5-VL text model, ByT5) "
        "with random weights.", "model_index.json", _build_tiny_hunyuan_video15),
}


def materialise(name: str, cache_dir: Path, registry: dict[str, BuiltinModel] = BUILTIN_MODELS) -> Path:
    """Build builtin model `name` (of `registry`) under cache_dir once (atomically) and return its directory."""
    model = registry[name]
    dest = Path(cache_dir) / name
    if (dest / model.marker).exists():
        return dest
    fs = RealFs()
    ensure_dir_durable(fs, dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dest.parent))
    try:
        model.build(tmp)
        for root, _dirs, files in os.walk(tmp):
            for f in files:
                fs.fsync(Path(root) / f)
            fs.fsync_dir(Path(root))
        try:
            os.rename(tmp, dest)
        except OSError:
            pass  # another process built an identical copy first
        fs.fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model_path(model_path: str, workdir: Path) -> str:
    """`model.path` to load from: a local directory or hub id as given; builtin:NAME is built once under workdir."""
    if model_path.startswith(BUILTIN_PREFIX):
        return str(materialise(model_path[len(BUILTIN_PREFIX):], Path(workdir) / "builtin-models"))
    return model_path
