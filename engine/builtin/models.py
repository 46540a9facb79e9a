"""Small models lorad can build offline, for the quickstart, demos and tests, and where a job's model lives.

`model.path: builtin:tiny-llama` materialises a randomly initialised
Llama-architecture model (fixed seed, so every machine builds the same
weights) and a byte-level tokenizer into a directory with `save_pretrained`,
then the normal loader reads it back — the real loading code runs, and
nothing is downloaded. `builtin:tiny-flux` does the same for a FLUX.1-shaped
pipeline (engine/builtin/tiny_flux.py); each family declares its own
(its package's `Offline` entries: engine/registry/facts.py), built by a function here or in the family's package
(engine/builtin/tiny_*.py for the families that came before the registry).

Importable without torch: job validation (engine/config/paths.py) reads BUILTIN_MODELS.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.registry.facts import Offline
from engine.registry.families import offline_models
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


def _build(offline: Offline, dest: Path) -> None:
    from engine.registry.families import resolve

    resolve(offline.build)(dest, **dict(offline.kwargs))


# Derived from the families' declarations (their packages' `Offline` entries), in the families' order.
BUILTIN_MODELS = {
    name: BuiltinModel(facts.name, o.description, o.marker, functools.partial(_build, o), o.pipeline)
    for name, (facts, o) in offline_models().items()
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
