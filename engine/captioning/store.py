"""Captions on disk: HOME/cache/captions/CAPTIONER/AB/SHA256.txt, one file per image, written aside, fsynced and
renamed into place (engine/storage/fsio.py), so a caption is either whole or absent. CAPTIONER is the captioner's
identity (model files, prompt, style, token budget): another captioner never reads these. A file the captioner
could not be shown (its bytes do not decode: frames.py's Unseeable) is recorded the same way, AB/SHA256.skipped
holding why, so no later job decodes it again; a fixed file has another sha256, and is captioned. They never go into the
user's data folder; `lorad captions ID --to DIR` copies a job's out (the job's captions.json names them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable, write_file_durable

MAX_CAPTION_BYTES = 64 << 10  # far above any max_tokens; a file larger than this is not ours


def captioner_identity(settings: dict, model_dir: Path) -> str:
    """sha256 of the captioner's settings and its model files (config, and each weight file's name and size: a
    fine-tuned copy under the same name is another captioner)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    model_dir = Path(model_dir)
    for name in ("config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json"):
        if (model_dir / name).is_file():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    for f in sorted(model_dir.iterdir()):
        if f.suffix in (".safetensors", ".bin") and f.is_file():
            h.update(f"{f.name}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()[:32]


class CaptionStore:
    def __init__(self, root: Path, identity: str, fs: FileLayer | None = None):
        self.dir = Path(root) / identity
        self.fs = fs or RealFs()

    def _path(self, sha256: str, kind: str = "txt") -> Path:
        return self.dir / sha256[:2] / f"{sha256}.{kind}"

    def get(self, sha256: str) -> str | None:
        return self._read(sha256, "txt")

    def skipped(self, sha256: str) -> str | None:
        """Why the file of this content was not captioned, if it was recorded as skipped."""
        return self._read(sha256, "skipped")

    def _read(self, sha256: str, kind: str) -> str | None:
        try:
            with open(self._path(sha256, kind), "rb") as f:
                raw = f.read(MAX_CAPTION_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if len(raw) > MAX_CAPTION_BYTES:
            return None
        return raw.decode("utf-8", errors="replace")

    def put_all(self, captions: dict[str, str], skipped: dict[str, str] | None = None) -> None:
        """Commit a batch's captions and skips (sha256 → why): each one whole or absent after a kill or a power
        cut; the stage redoes a batch until every one of its files has either."""
        entries = [(sha, "skipped", why) for sha, why in (skipped or {}).items()]
        for sha, kind, text in entries + [(sha, "txt", text) for sha, text in captions.items()]:
            path = self._path(sha, kind)
            ensure_dir_durable(self.fs, path.parent)
            write_file_durable(self.fs, path, text.encode("utf-8"))
