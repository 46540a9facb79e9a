"""The lorad version, from the installed package's metadata (pyproject.toml is the one place it is written).

One rule for the trainer (its `start` event, checkpoints' metadata, the exported files) and the daemon and
client (`lorad --version`, the ping reply). Imports nothing but the standard library: the client imports it.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def lorad_version() -> str:
    try:
        return version("lorad")
    except PackageNotFoundError:
        pass
    # Run from a source tree that was never installed: the version pyproject.toml declares, marked as such.
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', PYPROJECT.read_text(encoding="utf-8"), re.M)
    except OSError:
        m = None
    return f"{m.group(1)}+source" if m else "0+unknown"
