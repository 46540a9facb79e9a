"""The `caption` verb (the dashboard's caption edit): a person's caption for one image of a job's caption stage,
written to WORKDIR/caption_edits.json before training starts (engine/config/caption_edits.py reads and applies it).

Refused, naming why: a job that has ended; a job whose training has begun (a step reported or a checkpoint
committed: an edit then would train part of the job on one caption and the rest on another, and the checkpoint's
identity, which holds the edits, would no longer match); a running trainer past its caption stage (it has read
the captions); a job with no captions yet, or an image its captions do not name.

A job held for review after its caption stage (data.captioner.hold_for_review: paused, its stage
HELD_FOR_REVIEW) is released by `lorad resume`: `release` writes WORKDIR/captions_reviewed.json, which the trainer
looks for before it holds again.

The daemon reads jobs/ID/captions.json and writes caption_edits.json there by descriptor, never following a
symlink (daemon/system/safe_files.py): the trainer user may replace anything in that directory. One lock orders
the edits, so two at once both land.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.store import states
from daemon.supervisor.exit_policy import HELD_FOR_REVIEW
from daemon.system.paths import JOB_FILE_MODE
from daemon.system.safe_files import read_bytes, write_durable
from engine.config.caption_edits import EDITS_FILE, MAX_EDITS_BYTES, REVIEWED_FILE, clean

CAPTIONS_FILE = "captions.json"  # engine/captioning/stage.py's
MAX_CAPTIONS_BYTES = 64 << 20
SKIPS_FILE = "captions_skipped.json"  # engine/captioning/stage.py's: the files it could not read, path → sha256
MAX_SKIPS_BYTES = 4 << 20
_LOCK = threading.Lock()


def skipped_files(workdir: Path) -> list[str]:
    """The files the caption stage skipped (unreadable: not captioned, not trained on until they change), sorted;
    [] when none, or when the file cannot be read (the trainer user may replace it)."""
    try:
        raw = read_bytes(Path(workdir) / SKIPS_FILE, MAX_SKIPS_BYTES)
        said = json.loads(raw) if len(raw) <= MAX_SKIPS_BYTES else {}
    except (OSError, ValueError):
        return []
    return sorted(k for k in said if isinstance(k, str)) if isinstance(said, dict) else []


def _refused(message: str) -> p.ProtocolError:
    return p.ProtocolError("refused", message)


def why_not(job: dict[str, Any]) -> str | None:
    """Why the job's captions can no longer be edited (None: they can)."""
    jid, st = job["id"], job["state"]
    if st in states.FINAL:
        return f"job {jid} is {st}: its captions can no longer change what it trained"
    if job.get("checkpoint_step") is not None or (job.get("step") or 0) > 0:
        return (f"job {jid} has begun training (step {job.get('step') or job.get('checkpoint_step')}): an edit now "
                f"would train part of it on one caption and the rest on another; submit it again to change a caption")
    stage = re.fullmatch(r"captioning (\d+)/(\d+)", job.get("stage") or "")
    if st == states.RUNNING and not (stage and int(stage[1]) < int(stage[2])):  # the stage reads edits at its end
        return (f"job {jid}'s trainer has read its captions and is preparing to train; pause the job, edit, then "
                f"resume it (captions can be edited until its first step)")
    return None


def _read_json(path: Path, limit: int) -> Any:
    raw = read_bytes(path, limit)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return json.loads(raw)


def edit(job: dict[str, Any], req: p.EditCaption) -> p.JobActionReply:
    if (why := why_not(job)) is not None:
        raise _refused(why)
    workdir = Path(job["workdir"])
    try:
        captions = _read_json(workdir / CAPTIONS_FILE, MAX_CAPTIONS_BYTES)
    except FileNotFoundError:
        raise _refused(f"job {job['id']} has no captions yet: its caption stage (data.captions: auto or "
                       f"files-else-auto) writes them before training") from None
    except (OSError, ValueError) as e:
        raise _refused(f"job {job['id']}: {CAPTIONS_FILE} is unreadable ({e})") from None
    if not isinstance(captions, dict) or req.image not in captions:
        raise _refused(f"job {job['id']} has no image {req.image!r} among its captions")
    text = clean(req.caption)
    if not text:
        raise _refused("a caption needs at least one printable character")
    with _LOCK:
        try:
            edits = _read_json(workdir / EDITS_FILE, MAX_EDITS_BYTES)
        except FileNotFoundError:
            edits = {}
        except (OSError, ValueError):
            edits = {}  # not the daemon's writing (the trainer user's): replaced by the daemon's own
        edits = {k: v for k, v in edits.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(edits, dict) else {}
        edits[req.image] = text
        write_durable(workdir / EDITS_FILE, json.dumps(edits, indent=1, ensure_ascii=False).encode(), JOB_FILE_MODE)
    return p.JobActionReply(job=job["id"], state=job["state"],
                            message=f"caption of {req.image} edited; it trains with the job")


def held(job: dict[str, Any]) -> bool:
    """Paused after its caption stage, for a person to review the captions (the store says so, not a file)."""
    return job["state"] == states.PAUSED and job.get("stage") == HELD_FOR_REVIEW


def release(job: dict[str, Any]) -> None:
    """The person is done reviewing: the trainer trains next time instead of holding again."""
    write_durable(Path(job["workdir"]) / REVIEWED_FILE, b"{}\n", JOB_FILE_MODE)
