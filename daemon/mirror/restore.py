"""`lorad submit --from MIRROR/KEY`: a mirrored job brought onto this machine, to train on from its newest
complete remote checkpoint.

The remote checkpoints are tried newest first. One without its manifest is an upload cut short and is never
used; one whose files are missing, short or fail their checksum is skipped with its reason (walking back, as a
local resume does). Each candidate is downloaded into a staging folder and read by the engine's own walk-back
(engine/checkpoint/store.py, CheckpointStore.load_latest): the same checksums, the same format rule (a newer
lorad's checkpoint is refused) and the same identity check (a checkpoint of other model/lora/data/train settings
is refused, naming the keys that changed). The one that passes is moved into the new job's directory before the
job is queued, so the trainer resumes from it like from any local checkpoint.

`probe` is what `lorad submit --from` checks at once (the job, the newest remote manifest's format and identity: a
listing and a few small files); `fetch`, the download itself, runs afterwards in the background
(daemon/mirror/fetcher.py), so a large checkpoint on a slow link never meets the client's socket timeout.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from daemon.mirror.remote import Remote
from daemon.mirror.uploader import debug_delay, remote_steps
from engine.errors import ConfigMismatch, JobInvalid, NewerCheckpoint

Progress = Callable[[str, int, int, int, int], None]  # (step-N, files done, files, bytes done, bytes)


@dataclass
class Restored:
    text: str  # the job (its normalised YAML) to submit
    checkpoints: Path  # staging/checkpoints: holds the chosen step-N/ alone (empty: none was usable)
    step: int | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (step-N, why it was not used), newest first


def _inside(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


def job_text(remote: Remote, key: str, text: str | None) -> str:
    """The job to restore: the one the user gave, else the mirror's own job.yaml."""
    if text is not None:
        return text
    try:
        return remote.get(f"{key}/job.yaml").decode("utf-8")
    except FileNotFoundError as e:
        raise JobInvalid(f"mirror {remote.name!r} has no job {key!r} (no {key}/job.yaml there: {e})") from None
    except UnicodeDecodeError:
        raise JobInvalid(f"mirror {remote.name!r}: {key}/job.yaml is not UTF-8 text") from None


def probe(remote: Remote, key: str, validate: Callable[[str], object], text: str | None = None,
          ) -> tuple[str, str | None]:
    """What submit can tell at once: (the job's text, the newest remote checkpoint with a manifest, or None).

    Refuses (JobInvalid) a job the daemon would refuse, and the newest manifest's format or identity when they
    do not match the job's (the same rules as the engine's walk-back; the download checks them again)."""
    from engine.checkpoint.store import FORMAT_VERSION, changed_keys  # torch: only when a job is restored

    text = job_text(remote, key, text)
    cfg = validate(text)
    for name in remote_steps(remote, key):
        try:
            manifest = json.loads(remote.get(f"{key}/checkpoints/{name}/manifest.json"))
            fmt, config_hash = manifest.get("format"), manifest.get("config_hash")
        except (FileNotFoundError, ValueError, AttributeError):
            continue  # torn or unreadable: the download walks back past it with its reason
        where = f"mirror {remote.name!r}, {key}/checkpoints/{name}"
        if isinstance(fmt, int) and fmt > FORMAT_VERSION:
            raise JobInvalid(f"{where} was written by a newer lorad (checkpoint format {fmt}; this lorad reads "
                             f"{FORMAT_VERSION}): upgrade lorad to resume it")
        if config_hash != cfg.identity_hash():
            changed = changed_keys(manifest.get("identity"), cfg.identity())
            raise JobInvalid(f"{where} was written by a job with different model/lora/data/train settings "
                             f"({f'changed since: {changed}' if changed else 'another config hash'})")
        return text, name
    return text, None


def fetch(remote: Remote, key: str, staging: Path, validate: Callable[[str], object], text: str | None = None,
          progress: Progress | None = None) -> Restored:
    """Download the newest usable checkpoint of KEY into staging/checkpoints/.

    validate: the job text → its JobConfig (the daemon's intake checks). text: a job file the user gave (its
    identity must match the checkpoint's); None: the mirror's own job.yaml. progress: told after each file."""
    from engine.checkpoint.store import CheckpointStore  # torch: only when a job is restored

    text = job_text(remote, key, text)
    cfg = validate(text)
    root = staging / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(root, cfg.identity_hash(), cfg.checkpoint.keep, identity=cfg.identity())
    names = remote_steps(remote, key)
    skipped: list[tuple[str, str]] = []
    for name in names:
        why = _download(remote, f"{key}/checkpoints/{name}", root / name, progress)
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


def _download(remote: Remote, rel: str, dest: Path, progress: Progress | None = None) -> str | None:
    """One remote checkpoint into dest; the reason it cannot be one, or None (then the engine verifies it)."""
    try:
        manifest = remote.get(f"{rel}/manifest.json")
    except FileNotFoundError:
        return "no manifest.json (its upload never finished)"
    dest.mkdir(parents=True)
    (dest / "manifest.json").write_bytes(manifest)
    try:
        files = json.loads(manifest)["files"]
        sizes = {name: int(meta.get("size") or 0) for name, meta in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # the engine's verify names what is wrong with it
    delay, done_bytes, total = debug_delay("LORAD_DEBUG_MIRROR_FETCH_DELAY_S"), 0, sum(sizes.values())
    for i, name in enumerate(sizes, 1):
        if not _inside(name):
            return f"its manifest names {name!r}, outside the checkpoint"
        try:
            data = remote.get(f"{rel}/{name}")
        except FileNotFoundError:
            continue  # verify says "NAME is missing"
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
        done_bytes += len(data)
        if progress is not None:
            progress(dest.name, i, len(sizes), done_bytes, total)
        if delay:
            time.sleep(delay)
    return None


def describe(restored: Restored) -> str:
    """One line for the job's events and the submitter: what was chosen, and what was passed over and why."""
    chosen = f"step {restored.step}" if restored.step is not None else "no usable checkpoint: starts from step 0"
    passed = "; ".join(f"{n}: {why}" for n, why in restored.skipped)
    return chosen + (f" (walked back past {passed})" if passed else "")

