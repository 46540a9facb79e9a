"""What a warm trainer imported, as one string: lorad's version, the Python executable, and the size and mtime of
every source file under engine/ and daemon/. The zygote records it before its imports; the daemon compares it
with the files on disk before each use, so an upgrade underneath a warm trainer means a cold start."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from engine.version import lorad_version

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "daemon")


def fingerprint(root: Path = REPO) -> str:
    h = hashlib.sha256(f"{lorad_version()}\0{sys.executable}\0".encode())
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(root / pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()
