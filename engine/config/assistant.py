"""model.assistant_lora's file and its identity, torch-free (validation runs in the daemon); the merge itself is
engine/families/image/assistant.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from engine.errors import JobInvalid

KEY = "model.assistant_lora"
LORA_FILE = "pytorch_lora_weights.safetensors"  # what a folder (a lorad output/ or export/) is read for
_HASHED: dict[tuple[str, int, int], str] = {}


def local_file(value: str) -> Path | None:
    """The local file model.assistant_lora names (a file, or a folder's pytorch_lora_weights.safetensors), or
    None for a hub id. A local path that holds no such file is JobInvalid."""
    p = Path(value)
    if not p.is_absolute() and not p.exists():
        return None  # a hub id (engine/config/paths.py made every local path absolute)
    if p.is_dir():
        p = p / LORA_FILE
    if not p.is_file():
        raise JobInvalid(f"{KEY}: {value} is not a .safetensors file or a folder holding {LORA_FILE}")
    return p


def assistant_sha256(value: str) -> str | None:
    """A local assistant file's sha256 (the job's identity: the same path with other weights is another job),
    cached per (path, size, mtime) so a job's identity is hashed once per process; None for a hub id."""
    p = local_file(value)
    if p is None:
        return None
    st = os.stat(p)
    k = (str(p), st.st_size, st.st_mtime_ns)
    if k not in _HASHED:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        _HASHED[k] = h.hexdigest()
    return _HASHED[k]
