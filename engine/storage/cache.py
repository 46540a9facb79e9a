"""A content-keyed cache of encoded tensors: what a family encodes once before training, shared by a home's jobs.

    cache/KEY.entry.json              {"format": 2, key, file, size, sha256, kind, source}: one entry's commit
    cache/KIND-KEY-SHA.safetensors    the tensors of one entry (SHA: the first 16 hex digits of its sha256)

Where (engine/storage/home.py, `job_cache_dir`): HOME/cache for a job directory HOME/jobs/ID, one cache
shared by every job of the home — `lorad cache JOB` ahead of time fills what
the daemon's run of the job (in jobs/NAME-xxxx, a directory `lorad cache`
never saw) then reads, and two jobs on the same images share their latents;
WORKDIR/cache for a job directory anywhere else, and for a job whose process
cannot write the shared one (a warning, `cache_private`, says so).

A key is a hash of everything an entry's tensors depend on (`content_key`);
the family picks the parts (engine/families/image/flux_encode.py: the image bytes,
bucket, model and dtype of a latent; the text, model and length of a text
embedding), so a changed input re-encodes only its own entries.

Several writers at once (two jobs, or `lorad cache` beside a training job) and
a SIGKILL at any point are safe because nothing is rewritten in place and
every entry commits alone: the data file is written under a temporary name
(per process), fsynced and renamed to a name that carries its own sha256, then
the entry file that names it is committed the same way. A reader sees either
no entry, or an entry whose file is complete; two writers of one key each
commit a complete file, and the last entry renamed in wins. A kill leaves at
most a temp file or a data file no entry names: they are swept once older than
an hour (a live writer's are younger). A file whose size or sha256 does not
match its entry is reported (`cache_corrupt`) and encoded again. A job never
prunes entries it does not need (another job may); with the daemon's
`cache_max_bytes`, least-recently-used whole entries that no running job
holds are evicted after each fill (engine/storage/cache_evict.py). Deleting
HOME/cache while no job runs only costs re-encoding.

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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.storage import cache_evict
from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable, write_file_durable
from engine.storage.home import cache_dir

FORMAT = 2
ENTRY = ".entry.json"  # KEY.entry.json: one entry's commit record
STALE_S = 3600.0  # leftovers of a killed writer older than this are swept; a live writer's are younger
SOURCE_CHARS = 200  # of an entry's source kept in the manifest
LABEL_CHARS = 60  # of an entry's label in progress events


def job_cache_dir(workdir: Path, log) -> Path:
    """The cache a job uses: the home's shared one (engine/storage/home.py), or WORKDIR/cache when this process cannot
    write there (a `lorad cache` run by a user other than the daemon's trainer user), with a warning."""
    shared = cache_dir(workdir)
    try:
        shared.mkdir(parents=True, exist_ok=True)
        writable = os.access(shared, os.W_OK | os.X_OK)
    except PermissionError:
        writable = False
    if writable:
        return shared
    private = Path(workdir).resolve() / "cache"
    log.warning("cache_private", shared=str(shared), dir=str(private),
                message=f"cannot write the shared cache {shared}; this job caches in {private}")
    return private


def content_key(**parts: Any) -> str:
    """The key of an entry: a hash of everything its tensors depend on (JSON-serialisable parts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class Cache:
    """Reads and writes one cache directory; `ensure` encodes whatever is missing or corrupt."""

    def __init__(self, root: Path, fs: FileLayer | None = None):
        self.root = Path(root)
        self.fs = fs or RealFs()
        self.entries: dict[str, dict[str, Any]] = {}
        self.lease: cache_evict.Lease | None = None  # the keys this job uses, kept from eviction while it lives
        if self.root.is_dir():
            for p in self.root.glob("*" + ENTRY):
                self._read_entry(p.name[: -len(ENTRY)])

    def _read_entry(self, key: str) -> None:
        try:
            doc = json.loads((self.root / (key + ENTRY)).read_bytes())
            if doc.get("format") == FORMAT and doc.get("key") == key:
                self.entries[key] = doc
        except (OSError, ValueError, AttributeError):
            pass  # absent or unreadable: the entry is encoded (again)

    # ------------------------------------------------------------ reading
    def verify(self, key: str) -> str | None:
        """None when the entry's file exists and matches its size and sha256, else the reason."""
        e = self.entries.get(key)
        if e is None:
            self._read_entry(key)  # another writer may have committed it since this cache was opened
            e = self.entries.get(key)
        if e is None:
            return "not cached"
        p = self.root / e["file"]
        if not p.is_file():
            return f"{e['file']} is missing"
        data = p.read_bytes()
        if len(data) != e["size"]:
            return f"{e['file']} is {len(data)} bytes, its entry says {e['size']}"
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            return f"{e['file']} fails its sha256 checksum"
        return None

    def load(self, key: str) -> dict[str, torch.Tensor]:
        return st_load((self.root / self.entries[key]["file"]).read_bytes())

    # ------------------------------------------------------------ writing
    def put(self, key: str, kind: str, source: str, tensors: dict[str, torch.Tensor]) -> None:
        """Commit one entry: its data file (named by its own sha256), then the entry file naming it."""
        data = st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
        digest = hashlib.sha256(data).hexdigest()
        name = f"{kind}-{key}-{digest[:16]}.safetensors"
        ensure_dir_durable(self.fs, self.root)
        write_file_durable(self.fs, self.root / name, data)
        doc = {"format": FORMAT, "key": key, "file": name, "size": len(data), "sha256": digest, "kind": kind,
               "source": source}
        write_file_durable(self.fs, self.root / (key + ENTRY), json.dumps(doc, indent=1).encode())
        self.entries[key] = doc

    def close(self) -> None:
        """Give up this cache's lease: its entries may be evicted from now on (also when the process ends)."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove a killed writer's leftovers older than STALE_S: temp files, data files no entry names."""
        named = {e["file"] for e in self.entries.values()}
        return cache_evict.remove_stale(
            self.root, lambda n: ".tmp-" in n or (n.endswith(".safetensors") and n not in named), STALE_S,
            time.time() if now is None else now)


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
            cache_evict.touch(cache.root / (key + ENTRY))  # used now: the last to be evicted
            continue
        if why != "not cached":
            corrupt.append(cache.entries[key]["file"])
            log.warning("cache_corrupt", file=cache.entries[key]["file"], reason=why, message="encoding it again")
        out[key] = need
    return out


def ensure(root: Path, groups: list[Group], log, bar=None, fs: FileLayer | None = None) -> tuple[Cache, CacheReport]:
    """Make every entry of `groups` present and valid under `root`, encoding only what is not (nothing is pruned:
    another job may need what this one does not; a killed writer's old leftovers are swept). The job's keys are
    leased for as long as the returned Cache lives; then, with a size limit (cache_evict.set_limit), the least
    recently used entries no running job holds are evicted.

    Groups are encoded in order, each encoder's model freed before the next loads. `bar(done, total, label)`
    is called after each entry, as is a `cache_progress` event.
    """
    t0 = time.monotonic()
    cache = Cache(root, fs)
    ensure_dir_durable(cache.fs, cache.root)
    # Leased before anything is verified: an evicter either sees the lease or has finished before we look.
    cache.lease = cache_evict.Lease(cache.root, [k for g in groups for k in g.needs])
    corrupt: list[str] = []
    todo = {g.kind: _missing(cache, g.needs, corrupt, log) for g in groups}
    total = sum(len(t) for t in todo.values())
    reused = sum(len(g.needs) for g in groups) - total
    log.info("cache_start", to_encode=total, **{f"{g.kind}s": len(todo[g.kind]) for g in groups}, reused=reused,
             dir=str(cache.root))
    progress = itertools.count(1)

    def commit(kind: str, need: Need, tensors: dict[str, torch.Tensor]) -> None:
        cache.put(need.key, kind, need.source[:SOURCE_CHARS], tensors)  # committed alone: a kill loses one at most
        done, label = next(progress), (need.label or need.source)[:LABEL_CHARS]
        log.info("cache_progress", done=done, total=total, item=label)
        if bar is not None:
            bar(done, total, label)

    for g in groups:
        if todo[g.kind]:
            g.encode(list(todo[g.kind].values()), functools.partial(commit, g.kind))
            _release()
    for name in cache.sweep():
        log.info("cache_swept", file=name)
    if (max_bytes := cache_evict.limit()) is not None:
        cache_evict.evict(cache.root, max_bytes, log)
    report = CacheReport(encoded={g.kind: sorted(n.source for n in todo[g.kind].values()) for g in groups},
                         reused=reused, corrupt=corrupt, seconds=round(time.monotonic() - t0, 3))
    log.info("cache_done", **{f"{g.kind}s_encoded": len(report.encoded[g.kind]) for g in groups}, reused=reused,
             corrupt=len(corrupt), seconds=report.seconds)
    return cache, report
