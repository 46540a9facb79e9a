"""`lorad submit --from MIRROR/KEY`: a mirrored job brought onto this machine, to train on from its newest
complete remote checkpoint.

The remote checkpoints are tried newest first. One without its manifest is an upload cut short and is never
used; one whose files are missing, short or fail their checksum is skipped with its reason (walking back, as a
local resume does). Each candidate is downloaded into a staging folder and read by the engine's own walk-back
(engine/checkpoint/store.py, CheckpointStore.load_latest): the same checksums, the same format rule (a newer
lorad's checkpoint is refused) and the same identity check (a checkpoint of other model/lora/data/train settings
is refused, naming the keys that changed). The one that passes is moved into the new job's directory before the
job is queued, so the trainer resumes from it like from any local checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from daemon.mirror.remote import Remote
from daemon.mirror.uploader import STEP_DIR
from engine.errors import ConfigMismatch, JobInvalid, NewerCheckpoint


@dataclass
class Restored:
    text: str  # the job (its normalised YAML) to submit
    checkpoints: Path  # staging/checkpoints: holds the chosen step-N/ alone (empty: none was usable)
    step: int | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (step-N, why it was not used), newest first


def _inside(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


def fetch(remote: Remote, key: str, staging: Path, validate: Callable[[str], object], text: str | None = None,
          ) -> Restored:
    """Download the newest usable checkpoint of KEY into staging/checkpoints/.

    validate: the job text → its JobConfig (the daemon's intake checks). text: a job file the user gave (its
    identity must match the checkpoint's); None: the mirror's own job.yaml."""
    from engine.checkpoint.store import CheckpointStore  # torch: only when a job is restored

    if text is None:
        try:
            text = remote.get(f"{key}/job.yaml").decode("utf-8")
        except FileNotFoundError as e:
            raise JobInvalid(f"mirror {remote.name!r} has no job {key!r} (no {key}/job.yaml there: {e})") from None
        except UnicodeDecodeError:
            raise JobInvalid(f"mirror {remote.name!r}: {key}/job.yaml is not UTF-8 text") from None
    cfg = validate(text)
    root = staging / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(root, cfg.identity_hash(), cfg.checkpoint.keep, identity=cfg.identity())
    names = sorted((n for n in remote.listdir(f"{key}/checkpoints") if STEP_DIR.match(n)), reverse=True)
    skipped: list[tuple[str, str]] = []
    for name in names:
        why = _download(remote, f"{key}/checkpoints/{name}", root / name)
        if why is None:
            try:
                loaded, bad = store.load_latest(set_aside_invalid=False)
            except (ConfigMismatch, NewerCheckpoint) as e:
                raise JobInvalid(f"mirror {remote.name!r}, {key}/checkpoints/{name}: {e}") from None
            if loaded is not None:
                return Restored(text, root, loaded.step, skipped)
            why = bad[0].reason if bad else "not a checkpoint"
        skipped.append((name, why))
        shutil.rmtree(root / name, ignore_errors=True)
    return Restored(text, root, None, skipped)


def _download(remote: Remote, rel: str, dest: Path) -> str | None:
    """One remote checkpoint into dest; the reason it cannot be one, or None (then the engine verifies it)."""
    try:
        manifest = remote.get(f"{rel}/manifest.json")
    except FileNotFoundError:
        return "no manifest.json (its upload never finished)"
    dest.mkdir(parents=True)
    (dest / "manifest.json").write_bytes(manifest)
    try:
        files = json.loads(manifest)["files"]
        names = list(files)
    except (ValueError, KeyError, TypeError):
        return None  # the engine's verify names what is wrong with it
    for name in names:
        if not _inside(name):
            return f"its manifest names {name!r}, outside the checkpoint"
        try:
            data = remote.get(f"{rel}/{name}")
        except FileNotFoundError:
            continue  # verify says "NAME is missing"
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    return None


def describe(restored: Restored) -> str:
    """One line for the job's events and the submitter: what was chosen, and what was passed over and why."""
    chosen = f"step {restored.step}" if restored.step is not None else "no usable checkpoint: starts from step 0"
    passed = "; ".join(f"{n}: {why}" for n, why in restored.skipped)
    return chosen + (f" (walked back past {passed})" if passed else "")

