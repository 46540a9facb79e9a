"""The Flux latent and text-embedding cache under WORKDIR/cache/ (`lorad cache JOB`, and before training).

Training a Flux LoRA never needs the VAE encoder, CLIP or T5 at step time:
every image is encoded once per bucket to VAE latents, and every caption (and
the empty caption used for caption dropout, and every sample prompt) once to
T5 sequence embeddings + the CLIP pooled embedding. Then the encoders are
freed.

    cache/manifest.json                {"format": 1, "entries": {KEY: {file, size, sha256, kind, source}}}
    cache/latent-KEY.safetensors       latent [C, h, w] (+ latent_flip with data.flip), scaled and shifted
    cache/text-KEY.safetensors         prompt_embeds [L, D] (T5), pooled [D'] (CLIP)

A key is a hash of everything the tensor depends on: for a latent the image
bytes, the bucket, the flip flag, the model (path@revision) and dtype; for a
text the final caption text, the model, the T5 length and dtype. So an edited
caption re-encodes that caption only, a new image only that image, a new
bucket list only what moved. Each file is committed atomically (temp name,
fsync, rename, fsync the directory) before the manifest that names it is
rewritten the same way; a file whose size or sha256 does not match the
manifest is reported (`cache_corrupt`) and encoded again.

Latents are the VAE posterior mean, `(mean - shift_factor) * scaling_factor`,
as the Flux pipeline expects them; sampling the posterior would add noise
that flow matching adds anyway.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.config import JobConfig
from engine.data.images import Item, load_for_bucket
from engine.fsio import FileLayer, RealFs, ensure_dir_durable, write_file_durable

FORMAT = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_id(cfg: JobConfig, model_path: str) -> str:
    return f"{model_path}@{cfg.model.revision or 'main'}"


def _key(**parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def latent_key(item: Item, flip: bool, mid: str, dtype: str) -> str:
    return _key(kind="latent", image=item.record.sha256, bucket=list(item.bucket), flip=flip, model=mid, dtype=dtype)


def text_key(text: str, mid: str, max_len: int, dtype: str) -> str:
    return _key(kind="text", text=text, model=mid, max_len=max_len, dtype=dtype)


def t5_length(model_path: str, revision: str | None) -> int:
    """T5 tokens per caption: what the pipeline uses (512 for dev), capped by the tokenizer's own limit."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer_2", revision=revision)
    limit = getattr(tok, "model_max_length", 512) or 512
    return int(min(512, limit))


@dataclass
class CacheReport:
    latents_encoded: list[str]
    texts_encoded: list[str]
    reused: int
    corrupt: list[str]
    seconds: float


class Cache:
    """Reads and writes the cache directory; `ensure` encodes whatever is missing or corrupt."""

    def __init__(self, root: Path, fs: FileLayer | None = None):
        self.root = Path(root)
        self.fs = fs or RealFs()
        self.entries: dict[str, dict[str, Any]] = {}
        m = self.root / MANIFEST
        if m.is_file():
            try:
                data = json.loads(m.read_bytes())
                if data.get("format") == FORMAT:
                    self.entries = dict(data["entries"])
            except (ValueError, KeyError, TypeError):
                self.entries = {}  # an unreadable manifest only costs re-encoding

    # ------------------------------------------------------------ reading
    def verify(self, key: str) -> str | None:
        """None when the entry's file exists and matches its size and sha256, else the reason."""
        e = self.entries.get(key)
        if e is None:
            return "not cached"
        p = self.root / e["file"]
        if not p.is_file():
            return f"{e['file']} is missing"
        data = p.read_bytes()
        if len(data) != e["size"]:
            return f"{e['file']} is {len(data)} bytes, manifest says {e['size']}"
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            return f"{e['file']} fails its sha256 checksum"
        return None

    def load(self, key: str) -> dict[str, torch.Tensor]:
        return st_load((self.root / self.entries[key]["file"]).read_bytes())

    # ------------------------------------------------------------ writing
    def put(self, key: str, kind: str, source: str, tensors: dict[str, torch.Tensor]) -> None:
        data = st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
        name = f"{kind}-{key}.safetensors"
        ensure_dir_durable(self.fs, self.root)
        write_file_durable(self.fs, self.root / name, data)
        self.entries[key] = {"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                             "kind": kind, "source": source}

    def flush(self) -> None:
        ensure_dir_durable(self.fs, self.root)
        doc = {"format": FORMAT, "entries": dict(sorted(self.entries.items()))}
        write_file_durable(self.fs, self.root / MANIFEST, json.dumps(doc, indent=1).encode())

    def prune(self, keep: set[str]) -> None:
        """Forget entries no longer needed and remove files the manifest does not name (crash leftovers)."""
        self.entries = {k: v for k, v in self.entries.items() if k in keep}
        self.flush()
        named = {e["file"] for e in self.entries.values()} | {MANIFEST}
        for p in self.root.iterdir():
            if p.is_file() and p.name not in named:
                p.unlink()


@dataclass
class Plan:
    """What the job needs from the cache: latent keys per item, text keys per distinct text."""

    latents: dict[str, tuple[Item, bool]]   # key -> (item, flip)
    texts: dict[str, str]                   # key -> text
    item_latent: list[str]                  # per item index
    item_text: list[str]                    # per item index
    empty_text: str                         # key of "" (caption dropout)
    prompt_texts: list[str]                 # keys of sample.prompts, in order


def plan(cfg: JobConfig, items: list[Item], model_path: str, max_len: int) -> Plan:
    mid, dt = model_id(cfg, model_path), cfg.model.dtype
    latents: dict[str, tuple[Item, bool]] = {}
    texts: dict[str, str] = {}
    item_latent, item_text = [], []
    for it in items:
        k = latent_key(it, cfg.data.flip, mid, dt)
        latents.setdefault(k, (it, cfg.data.flip))
        item_latent.append(k)
        t = text_key(it.record.caption, mid, max_len, dt)
        texts.setdefault(t, it.record.caption)
        item_text.append(t)
    empty = text_key("", mid, max_len, dt)
    texts.setdefault(empty, "")
    prompts = []
    for p in cfg.sample.prompts:
        k = text_key(p, mid, max_len, dt)
        texts.setdefault(k, p)
        prompts.append(k)
    return Plan(latents, texts, item_latent, item_text, empty, prompts)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _release() -> None:
    """Give the encoders' memory back (called after the encode functions, whose locals held them, return)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def encode_latents(cache: Cache, todo: dict[str, tuple[Item, bool]], model_path: str, cfg: JobConfig,
                   tick: Callable[[str], None]) -> None:
    import numpy as np
    from diffusers import AutoencoderKL

    device = _device()
    vae = AutoencoderKL.from_pretrained(model_path, subfolder="vae", revision=cfg.model.revision,
                                        dtype=DTYPES[cfg.model.dtype]).to(device).eval()
    shift = vae.config.shift_factor or 0.0
    scale = vae.config.scaling_factor
    for key, (item, flip) in todo.items():
        out = {}
        for name, flipped in [("latent", False)] + ([("latent_flip", True)] if flip else []):
            im = load_for_bucket(item.record.path, item.bucket, flip=flipped)
            x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1.0
            with torch.no_grad():
                mean = vae.encode(x[None].to(device, vae.dtype)).latent_dist.mean
            out[name] = ((mean - shift) * scale)[0].to(DTYPES[cfg.model.dtype])
        cache.put(key, "latent", f"{item.record.rel}@{item.bucket[0]}x{item.bucket[1]}", out)
        cache.flush()  # after every entry: a kill loses at most the one being encoded
        tick(item.record.rel)


def encode_texts(cache: Cache, todo: dict[str, str], model_path: str, cfg: JobConfig, max_len: int,
                 tick: Callable[[str], None]) -> None:
    from diffusers import FluxPipeline

    device = _device()
    # The pipeline's own encode_prompt, so cached embeddings are exactly what inference computes.
    pipe = FluxPipeline.from_pretrained(model_path, transformer=None, vae=None, revision=cfg.model.revision,
                                        dtype=DTYPES[cfg.model.dtype])
    pipe.text_encoder.to(device)
    pipe.text_encoder_2.to(device)
    for key, text in todo.items():
        with torch.no_grad():
            embeds, pooled, _ids = pipe.encode_prompt(text, prompt_2=None, device=device, max_sequence_length=max_len)
        cache.put(key, "text", text[:200], {"prompt_embeds": embeds[0], "pooled": pooled[0]})
        cache.flush()
        tick(text[:60])


def ensure(cfg: JobConfig, items: list[Item], workdir: Path, model_path: str, log, bar=None,
           fs: FileLayer | None = None) -> tuple[Cache, Plan, CacheReport]:
    """Make every latent and text embedding the job needs present and valid; encode only what is not."""
    t0 = time.monotonic()
    cache = Cache(Path(workdir) / "cache", fs)
    max_len = t5_length(model_path, cfg.model.revision)
    p = plan(cfg, items, model_path, max_len)
    corrupt: list[str] = []

    def missing(keys: dict) -> dict:
        out = {}
        for k, v in keys.items():
            why = cache.verify(k)
            if why is None:
                continue
            if why != "not cached":
                corrupt.append(cache.entries[k]["file"])
                log.warning("cache_corrupt", file=cache.entries[k]["file"], reason=why, message="encoding it again")
            out[k] = v
        return out

    lat_todo, txt_todo = missing(p.latents), missing(p.texts)
    total = len(lat_todo) + len(txt_todo)
    reused = len(p.latents) + len(p.texts) - total
    log.info("cache_start", to_encode=total, latents=len(lat_todo), texts=len(txt_todo), reused=reused,
             dir=str(cache.root))
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        log.info("cache_progress", done=done, total=total, item=what)
        if bar is not None:
            bar(done, total, what)

    if lat_todo:
        encode_latents(cache, lat_todo, model_path, cfg, tick)
        _release()
    if txt_todo:
        encode_texts(cache, txt_todo, model_path, cfg, max_len, tick)
        _release()
    cache.prune(set(p.latents) | set(p.texts))
    report = CacheReport(
        latents_encoded=sorted(f"{it.record.rel}@{it.bucket[0]}x{it.bucket[1]}" for it, _ in lat_todo.values()),
        texts_encoded=sorted(txt_todo.values()), reused=reused, corrupt=corrupt,
        seconds=round(time.monotonic() - t0, 3),
    )
    log.info("cache_done", latents_encoded=len(report.latents_encoded), texts_encoded=len(report.texts_encoded),
             reused=reused, corrupt=len(corrupt), seconds=report.seconds)
    return cache, p, report
