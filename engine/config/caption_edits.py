"""Caption edits: a person's corrections to a job's captions, made on the dashboard before training starts.
They are part of the job's identity, which is why they live here beside the job's settings.

The daemon writes them to WORKDIR/caption_edits.json ({image path: caption}, written aside, fsynced and renamed:
daemon/supervisor/caption_edits.py); the trainer only reads it. The caption stage applies them over the captions it
generated or read (an edit wins), records what it applied in WORKDIR/caption_edits.applied.json (the trainer's
own file), and those enter the job's identity (`with_edits`): a checkpoint written with other edits is not resumed
as if it were this job's. The identity reads what the stage applied, not the daemon's file again: an edit that
lands after the stage read it (the daemon refuses one once training has begun, but a running stage is seen a
heartbeat late) cannot give the checkpoints an identity their training did not have.

A job with data.captioner.hold_for_review stops after its caption stage until the daemon writes
WORKDIR/captions_reviewed.json, which it does when the person resumes the held job (`lorad resume`).
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path
from typing import Any

EDITS_FILE = "caption_edits.json"
APPLIED_FILE = "caption_edits.applied.json"
REVIEWED_FILE = "captions_reviewed.json"  # the daemon's: the person resumed the job held for review
MAX_EDITS_BYTES = 4 << 20
MAX_CAPTION_CHARS = 4000


def clean(text: str) -> str:
    """One line of printable text (as engine/captioning/captioner.py cleans a model's caption)."""
    return " ".join("".join(ch if unicodedata.category(ch)[0] != "C" else " " for ch in text).split())


def read_edits(workdir: Path, name: str = EDITS_FILE) -> dict[str, str]:
    """The job's edits ({} without any); a file that is not an object of strings is refused, naming it."""
    path = Path(workdir) / name
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_EDITS_BYTES + 1)
    except FileNotFoundError:
        return {}
    if len(raw) > MAX_EDITS_BYTES:
        raise OSError(f"{path} is larger than {MAX_EDITS_BYTES} bytes")
    edits = json.loads(raw)
    if not isinstance(edits, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in edits.items()):
        raise OSError(f"{path} must map image paths to captions")
    return {k: clean(v)[:MAX_CAPTION_CHARS] for k, v in edits.items()}


def reviewed(workdir: Path) -> bool:
    """Whether the person released the job's hold for review (its presence is the whole message)."""
    return (Path(workdir) / REVIEWED_FILE).is_file()


def with_edits(identity: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The job's identity with its caption edits (each one's sha256): unchanged when there are none, so a job
    without edits keeps its config hash."""
    edits = read_edits(workdir, APPLIED_FILE)
    if not edits:
        return identity
    return {**identity, "caption_edits": {k: hashlib.sha256(v.encode()).hexdigest()[:16]
                                          for k, v in sorted(edits.items())}}


def identity_hash(identity: dict[str, Any]) -> str:
    """As JobConfig.identity_hash, over an identity dict."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
