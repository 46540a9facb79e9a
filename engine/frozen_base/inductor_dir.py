"""HOME/cache/compile/KEY.d: inductor's own cache directory for one compile key, committed with a manifest
(engine/frozen_base/compiling.py keeps the artifacts file KEY.bin beside it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from engine.storage import cache_evict
from engine.storage.fsio import FileLayer, RealFs, write_file_durable


class InductorDir:
    """HOME/cache/compile/KEY.d: inductor's own cache directory (TORCHINDUCTOR_CACHE_DIR) for this key, committed.

    The artifacts file holds inductor's graphs and, on a GPU, their Triton kernels, but not the C++ kernels
    inductor builds for the CPU (shared objects in its cache directory): without them a CPU resume compiles
    again whatever the artifacts say. So the directory itself lives in the home too, and is committed like a
    checkpoint: after a step that compiled something every file in it is fsynced and MANIFEST (each file's size
    and sha256) is written last, atomically. At start a file the manifest does not list (written after it, by a
    process killed before the next commit) is removed, and a listed file that is missing, short or changed makes
    the whole directory go: a cold compile, never a half-written kernel loaded.
    """

    MANIFEST = cache_evict.MANIFEST  # removed first by an eviction (engine/storage/cache_evict.py)

    def __init__(self, path: Path, log=None, fs: FileLayer | None = None):
        self.path, self.log, self.fs = Path(path), log, fs or RealFs()

    def adopt(self) -> str:
        """Check the directory against its manifest and make it this process's inductor cache; the status."""
        status = self._check()
        self.path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.path)  # read by inductor at each use
        if self.log is not None:
            self.log.info("compile_cache", status=status, dir=str(self.path))
        return status

    def _check(self) -> str:
        try:
            listed = json.loads((self.path / self.MANIFEST).read_text())["files"]
        except FileNotFoundError:
            listed = None
        except (OSError, ValueError, KeyError, TypeError):
            return self._wipe("an unreadable manifest")
        if listed is None:
            return self._wipe("no manifest") if self.path.exists() and any(self.path.iterdir()) else "cold"
        for rel, (size, digest) in listed.items():
            f = self.path / rel
            try:
                if f.stat().st_size != size or _sha256(f) != digest:
                    return self._wipe(f"{rel} changed since it was committed")
            except OSError:
                return self._wipe(f"{rel} is missing")
        for f in self._files():
            if f.relative_to(self.path).as_posix() not in listed and f.name != self.MANIFEST:
                f.unlink(missing_ok=True)  # written after the last commit
        if not listed:
            return "cold"
        cache_evict.touch(self.path / self.MANIFEST)  # used now: the last to be evicted
        return "warm"

    def _wipe(self, why: str) -> str:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.log is not None:
            self.log.warning("compile_cache", status="corrupt", dir=str(self.path), reason=why,
                             message=f"compile cache directory {self.path.name} not used ({why}): compiling cold")
        return "corrupt"

    def _files(self) -> list[Path]:
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not p.is_symlink())

    def commit(self) -> None:
        files = {}
        for f in self._files():
            rel = f.relative_to(self.path).as_posix()
            if rel == self.MANIFEST or ".tmp" in f.name:
                continue
            try:
                files[rel] = [f.stat().st_size, _sha256(f)]
                self.fs.fsync(f)
            except FileNotFoundError:  # inductor replaced it meanwhile: the next commit lists it
                continue
        dirs = {self.path / p for rel in files for p in Path(rel).parents}  # every directory up to the root
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            self.fs.fsync_dir(d)
        write_file_durable(self.fs, self.path / self.MANIFEST, json.dumps({"files": files}).encode())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
