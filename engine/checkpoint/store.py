"""Crash-safe checkpoints: atomic commit, verified load that walks back, pruning (the background writer that
commits them while training goes on: engine/checkpoint/writer.py).

Layout of one checkpoint (`checkpoints/step-00000420/`):

    adapter.safetensors     trainable (LoRA) parameters by name
    optimizer.safetensors   every tensor of the optimizer state (8-bit states, qmaps, absmax, moments)
    optimizer.json          the rest of the optimizer state (steps, param groups), tensors referenced by key
    rng.safetensors         torch CPU / CUDA / data-generator RNG states
    state.json              step, data cursor, python/numpy RNG, anything else the loop needs
    ema.safetensors         only with train.ema: the averaged adapter weights (any optional NAME.safetensors
                            is listed in the manifest and verified like the rest)
    export/                 the step's LoRA in the user's formats, as output/ would hold it
                            (engine/checkpoint/exports.py; listed and verified like the rest)
    manifest.json           written last: size and sha256 of every file above, step, config hash

A sharded checkpoint (train.sharding: fsdp, engine/distributed/fsdp.py) holds the adapter and the optimizer in
`shards/` instead (torch.distributed.checkpoint: `.metadata` and one `__R_0.distcp` per rank, written by
every rank into the same temporary directory) beside rng.safetensors and state.json; rank 0 commits it
after a barrier, its manifest listing and checksumming every shard like any other file.

Commit: write everything into `step-N.tmp-*/`, fsync each file, fsync the
directory, rename it to `step-N/`, fsync `checkpoints/`. A directory without a
manifest that verifies is not a checkpoint. We write this ourselves because
no training library commits checkpoints this way (they write in place,
without fsync), and the tests drive it through a recording file layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.checkpoint.host_copy import CopyDone
from engine.errors import ConfigMismatch, NewerCheckpoint
from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
EXPORT_DIR = "export"  # the user-format files of the step (engine/checkpoint/exports.py)
KEEP_INVALID = 2  # newest set-aside invalid checkpoint directories kept for inspection


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken at an optimizer-step boundary."""

    step: int
    adapter: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_tree: Any
    rng_tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    extra: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # optional NAME.safetensors files
    ready: CopyDone = field(default_factory=CopyDone)  # when the device→host copies are complete
    sharded: bool = False  # adapter and optimizer are in the ranks' shards/, not in this snapshot
    # Writes the step's user-format files into the directory it is given (on the writer's thread, after the
    # copies are complete); committed, listed and checksummed with the rest.
    export: Callable[[Path], list[str]] | None = None

    def files(self) -> dict[str, bytes]:
        self.ready.wait()  # on the writer's thread: the training loop never waits for the copies
        whole = {} if self.sharded else {
            "adapter.safetensors": st_save(self.adapter),
            "optimizer.safetensors": st_save(self.optimizer_tensors),
            "optimizer.json": json.dumps(self.optimizer_tree).encode(),
        }
        return {
            **{f"{name}.safetensors": st_save(tensors) for name, tensors in self.extra.items()},
            **whole,
            "rng.safetensors": st_save(self.rng_tensors),
            # No indent: with indent json falls back to its pure-Python encoder, which is slow on the
            # RNG states (python's 625 and numpy's 624 integers).
            "state.json": json.dumps(self.state, separators=(",", ":")).encode(),
        }


@dataclass
class Loaded:
    step: int
    path: Path
    adapter: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_tree: Any
    rng_tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    extra: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    shards: Path | None = None  # a sharded checkpoint: adapter and optimizer are there (engine/distributed/fsdp.py loads them)


@dataclass
class Skipped:
    name: str
    reason: str


CHECKPOINT_FILES = ("adapter.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "state.json")
SHARDS = "shards"  # a sharded checkpoint's torch.distributed.checkpoint directory
SHARDED_FILES = (f"{SHARDS}/.metadata", "rng.safetensors", "state.json")


def changed_keys(was: dict[str, Any] | None, now: dict[str, Any] | None, limit: int = 4) -> str:
    """'train.lr 0.002 → 0.001, lora.rank 32 → 16' for the dotted keys that differ; '' if either is unknown."""
    if not isinstance(was, dict) or not isinstance(now, dict):
        return ""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(was), flat(now)
    diffs = [f"{k} {a.get(k, '(default)')} → {b.get(k, '(default)')}" for k in sorted(a.keys() | b.keys())
             if a.get(k) != b.get(k)]
    return ", ".join(diffs[:limit]) + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _debug_delay() -> float:
    # Fault-injection hook for tests: widen the window in which a checkpoint is half-written.
    try:
        return float(os.environ.get("LORAD_DEBUG_CKPT_WRITE_DELAY_S", "0"))
    except ValueError:
        return 0.0


class CheckpointStore:
    def __init__(self, root: Path, config_hash: str, keep: int, fs: FileLayer | None = None,
                 identity: dict[str, Any] | None = None):
        """identity: the settings behind config_hash, kept in each manifest so a mismatch can name the keys."""
        self.root = Path(root)
        self.config_hash = config_hash
        self.keep = keep
        self.fs = fs or RealFs()
        self.identity = identity

    # ---------------------------------------------------------------- commit
    def begin(self, step: int) -> Path:
        """A new temporary directory for checkpoint `step`, for other processes to write their shards into before
        `commit(snap, tmp=...)`."""
        ensure_dir_durable(self.fs, self.root)
        tmp = self.root / f"{step_dir_name(step)}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        self.fs.mkdir(tmp)
        return tmp

    def commit(self, snap: Snapshot, tmp: Path | None = None) -> Path:
        """Write `snap` as checkpoint step-N atomically; return its final path.

        tmp: the directory `begin` made, where the ranks already wrote a sharded save's `shards/`: those files are
        fsynced, listed and checksummed in the manifest with the rest, and the whole directory is committed."""
        fs = self.fs
        final = self.root / step_dir_name(snap.step)
        if tmp is None:
            tmp = self.begin(snap.step)
        try:
            files = snap.files()
            if snap.export is not None:
                snap.export(tmp / EXPORT_DIR)
            # Files already in tmp: the ranks' shards/, the export/.
            written = {p.relative_to(tmp).as_posix(): p.read_bytes() for p in sorted(tmp.rglob("*")) if p.is_file()}
            for name in written:
                fs.fsync(tmp / name)
            for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):  # deepest first
                fs.fsync_dir(d)
            files = {**written, **files}
            manifest = {
                "format": FORMAT_VERSION,
                "step": snap.step,
                "config_hash": self.config_hash,
                **({"identity": self.identity} if self.identity is not None else {}),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in files.items()},
            }
            delay = _debug_delay()
            for name, data in files.items():
                if name in written:
                    continue
                fs.write(tmp / name, [data])
                fs.fsync(tmp / name)
                if delay:
                    time.sleep(delay)
            fs.write(tmp / MANIFEST, [json.dumps(manifest, indent=1).encode()])
            fs.fsync(tmp / MANIFEST)
            fs.fsync_dir(tmp)
            if final.exists():
                # Only an invalid leftover can sit here (a valid one would have been resumed from).
                self._set_aside(final, "replaced")
            fs.rename(tmp, final)
            fs.fsync_dir(self.root)
        except BaseException:
            fs.rmtree(tmp)
            raise
        self.prune(protect=snap.step)
        return final

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(f"{path.name}.invalid-{why}-{time.time_ns()}")
        self.fs.rename(path, aside)
        self.fs.fsync_dir(path.parent)

    # ---------------------------------------------------------------- load
    def steps(self) -> list[tuple[int, Path]]:
        """Checkpoint-named directories, newest first (validity not checked)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out, reverse=True)

    def verify(self, path: Path) -> tuple[dict | None, dict[str, bytes], str | None]:
        """(manifest, file bytes, None) for a valid checkpoint, else (None, {}, reason)."""
        mpath = path / MANIFEST
        if not mpath.exists():
            return None, {}, "no manifest.json (the save never finished)"
        try:
            manifest = json.loads(mpath.read_bytes())
            fmt = manifest.get("format")
            if isinstance(fmt, int) and fmt > FORMAT_VERSION:
                raise NewerCheckpoint(
                    f"checkpoint {path} was written by a newer lorad (checkpoint format {fmt}; this lorad reads "
                    f"{FORMAT_VERSION}): upgrade lorad to resume it — it is left untouched")
            if fmt != FORMAT_VERSION:
                return None, {}, f"manifest format {fmt!r} is not {FORMAT_VERSION}"
            step = int(manifest["step"])
            if step_dir_name(step) != path.name:
                return None, {}, f"manifest says step {step}, directory says {path.name}"
            files_meta = manifest["files"]
            missing = [n for n in (SHARDED_FILES if SHARDED_FILES[0] in files_meta else CHECKPOINT_FILES)
                       if n not in files_meta]
            if missing:
                return None, {}, f"manifest.json lists no {missing[0]}"
            blobs: dict[str, bytes] = {}
            for name, meta in files_meta.items():
                fpath = path / name
                if not fpath.is_file():
                    return None, {}, f"{name} is missing"
                data = fpath.read_bytes()
                if len(data) != meta["size"]:
                    return None, {}, f"{name} is {len(data)} bytes, manifest says {meta['size']} (truncated?)"
                if _sha256(data) != meta["sha256"]:
                    return None, {}, f"{name} fails its sha256 checksum (corrupted)"
                blobs[name] = data
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # Valid JSON of the wrong shape (a flipped bit in a key) is as unreadable as broken JSON.
            return None, {}, f"manifest.json is unreadable ({type(e).__name__}: {e})"
        return manifest, blobs, None

    def load_latest(self, set_aside_invalid: bool = True) -> tuple[Loaded | None, list[Skipped]]:
        """Walk back from the newest step to the first checkpoint that verifies.

        Invalid directories are renamed aside (`*.invalid-*`) so a later commit
        of the same step never collides with them; nothing is deleted here.
        """
        skipped: list[Skipped] = []

        def skip(path: Path, reason: str) -> None:
            skipped.append(Skipped(path.name, reason))
            if set_aside_invalid:
                try:
                    self._set_aside(path, "skipped")
                except OSError:
                    pass

        for step, path in self.steps():
            manifest, blobs, reason = self.verify(path)
            if reason is not None:
                skip(path, reason)
                continue
            if manifest["config_hash"] != self.config_hash:
                changed = changed_keys(manifest.get("identity"), self.identity)
                what = (f"changed since: {changed}" if changed else
                        f"config hash {manifest['config_hash']}, this job {self.config_hash}")
                raise ConfigMismatch(
                    f"checkpoint {path} was written by a job with different model/lora/data/train settings "
                    f"({what}); put them back, or give the job a new name or remove that job directory"
                )
            sharded = SHARDED_FILES[0] in blobs
            try:
                loaded = Loaded(
                    step=step,
                    path=path,
                    adapter={} if sharded else st_load(blobs["adapter.safetensors"]),
                    optimizer_tensors={} if sharded else st_load(blobs["optimizer.safetensors"]),
                    optimizer_tree=None if sharded else json.loads(blobs["optimizer.json"]),
                    rng_tensors=st_load(blobs["rng.safetensors"]),
                    state=json.loads(blobs["state.json"]),
                    extra={n.removesuffix(".safetensors"): st_load(b) for n, b in blobs.items()
                           if n.endswith(".safetensors") and n not in CHECKPOINT_FILES and "/" not in n},
                    shards=path / SHARDS if sharded else None,
                )
            except Exception as e:  # noqa: BLE001 — checksums matched files the writer itself got wrong: walk back
                skip(path, f"its files do not parse ({type(e).__name__}: {e})"[:300])
                continue
            return loaded, skipped
        return None, skipped

    # ---------------------------------------------------------------- prune
    def prune(self, protect: int | None = None) -> list[str]:
        """Keep the newest `keep` checkpoints by step (and `protect`); remove stale temp dirs of this store."""
        removed = []
        for i, (step, path) in enumerate(self.steps()):
            if i >= self.keep and step != protect:
                self.fs.rmtree(path)
                removed.append(path.name)
        if self.root.is_dir():
            for p in self.root.iterdir():
                if ".tmp-" in p.name and not p.name.split(".tmp-")[1].startswith(f"{os.getpid()}-"):
                    self.fs.rmtree(p)
                    removed.append(p.name)
            # Set-aside invalid directories are kept for a look at what went wrong, but not forever:
            # a disk that keeps corrupting saves must not fill up with them.
            aside = sorted(self.root.glob("step-*.invalid-*"), key=_set_aside_time)
            for p in aside[: max(0, len(aside) - KEEP_INVALID)]:
                self.fs.rmtree(p)
                removed.append(p.name)
        return removed


def _set_aside_time(path: Path) -> int:
    """The time_ns suffix _set_aside gave the directory (0 for a name it did not make)."""
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0
