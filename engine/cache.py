"""A content-keyed cache of encoded tensors under WORKDIR/cache/: what a family encodes once before training.

    cache/manifest.json          {"format": 1, "entries": {KEY: {file, size, sha256, kind, source}}}
    cache/KIND-KEY.safetensors   the tensors of one entry

A key is a hash of everything an entry's tensors depend on (`content_key`);
the family picks the parts (engine/families/flux_encode.py: the image bytes,
bucket, model and dtype of a latent; the text, model and length of a text
embedding), so a changed input re-encodes only its own entries. Each file is
committed atomically (temp name, fsync, rename, fsync the directory) before the
manifest that names it is rewritten the same way; a file whose size or sha256
does not match the manifest is reported (`cache_corrupt`) and encoded again;
entries the job no longer needs are pruned.

`ensure` is the skeleton a family fills in: the entries the job needs, in
groups of one kind, each group with an encoder that loads its model, encodes
what is missing and lets the model go when it returns.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.fsio import FileLayer, RealFs, ensure_dir_durable, write_file_durable

FORMAT = 1
MANIFEST = "manifest.json"
SOURCE_CHARS = 200  # of an entry's source kept in the manifest
LABEL_CHARS = 60  # of an entry's label in progress events


def content_key(**parts: Any) -> str:
    """The key of an entry: a hash of everything its tensors depend on (JSON-serialisable parts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


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


@dataclass(frozen=True)
class Need:
    """One entry a job needs: its key, what its encoder reads, and how it is named."""

    key: str
    source: str  # in the manifest (cut to SOURCE_CHARS) and in the report, e.g. "a.png@64x48" or the caption
    payload: Any  # what the group's encoder encodes (an image and a flip flag, a text, ...)
    label: str | None = None  # in progress events; the source when None


# encode(todo, done): load the model, call done(need, tensors) for each need in turn, let the model go on return.
Done = Callable[[Need, dict[str, torch.Tensor]], None]
Encoder = Callable[[list[Need], Done], None]


@dataclass
class Group:
    """The entries of one kind (the file prefix, e.g. "latent") and the encoder that makes them."""

    kind: str
    needs: dict[str, Need]  # by key
    encode: Encoder


@dataclass
class CacheReport:
    encoded: dict[str, list[str]]  # kind -> sources encoded by this call, sorted
    reused: int
    corrupt: list[str]
    seconds: float


def _release() -> None:
    """Give an encoder's memory back (called after it returned, so nothing holds its model any more)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _missing(cache: Cache, needs: dict[str, Need], corrupt: list[str], log) -> dict[str, Need]:
    """The needs whose entry is absent or fails verification (those are logged and listed in `corrupt`)."""
    out = {}
    for key, need in needs.items():
        why = cache.verify(key)
        if why is None:
            continue
        if why != "not cached":
            corrupt.append(cache.entries[key]["file"])
            log.warning("cache_corrupt", file=cache.entries[key]["file"], reason=why, message="encoding it again")
        out[key] = need
    return out


def ensure(root: Path, groups: list[Group], log, bar=None, fs: FileLayer | None = None) -> tuple[Cache, CacheReport]:
    """Make every entry of `groups` present and valid under `root`, encoding only what is not; prune the rest.

    Groups are encoded in order, each encoder's model freed before the next loads. `bar(done, total, label)`
    is called after each entry, as is a `cache_progress` event.
    """
    t0 = time.monotonic()
    cache = Cache(root, fs)
    corrupt: list[str] = []
    todo = {g.kind: _missing(cache, g.needs, corrupt, log) for g in groups}
    total = sum(len(t) for t in todo.values())
    reused = sum(len(g.needs) for g in groups) - total
    log.info("cache_start", to_encode=total, **{f"{g.kind}s": len(todo[g.kind]) for g in groups}, reused=reused,
             dir=str(cache.root))
    progress = itertools.count(1)

    def commit(kind: str, need: Need, tensors: dict[str, torch.Tensor]) -> None:
        cache.put(need.key, kind, need.source[:SOURCE_CHARS], tensors)
        cache.flush()  # after every entry: a kill loses at most the one being encoded
        done, label = next(progress), (need.label or need.source)[:LABEL_CHARS]
        log.info("cache_progress", done=done, total=total, item=label)
        if bar is not None:
            bar(done, total, label)

    for g in groups:
        if todo[g.kind]:
            g.encode(list(todo[g.kind].values()), functools.partial(commit, g.kind))
            _release()
    cache.prune({key for g in groups for key in g.needs})
    report = CacheReport(encoded={g.kind: sorted(n.source for n in todo[g.kind].values()) for g in groups},
                         reused=reused, corrupt=corrupt, seconds=round(time.monotonic() - t0, 3))
    log.info("cache_done", **{f"{g.kind}s_encoded": len(report.encoded[g.kind]) for g in groups}, reused=reused,
             corrupt=len(corrupt), seconds=report.seconds)
    return cache, report
