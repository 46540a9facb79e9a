"""`lorad submit --from MIRROR/KEY`: a mirrored job brought onto this machine, to train on from its newest
complete remote checkpoint.

The remote checkpoints are tried newest first. One without its manifest is an upload cut short and is never
used; one whose files are missing, short, longer than their manifest says or fail their checksum is skipped with
its reason (walking back, as a local resume does). Each candidate's manifest is read first under the engine's
rules (engine/checkpoint/store.py verify): its format (a newer lorad's checkpoint is refused), its step, the files
a checkpoint needs, and its identity (a checkpoint of other model/lora/data/train settings is refused, naming the
keys that changed). Its files are then streamed into a staging folder, each one's size and sha256 checked as it
arrives, so the daemon's memory stays flat whatever the checkpoint's size (bench/mirror_memory.py); the tensors are
parsed by the trainer when it resumes. The one that passes is moved into the new job's directory before the job is
queued, so the trainer resumes from it like from any local checkpoint. KEY is a job id (daemon/mirror/remote.py
check_key), and nothing here writes to the mirror.

`probe` is what `lorad submit --from` checks at once (the job, the newest remote manifest's format and identity: a
listing and a few small files); `fetch`, the download itself, runs afterwards in the background
(daemon/mirror/fetcher.py), so a large checkpoint on a slow link never meets the client's socket timeout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from daemon.mirror.remote import Remote, TooLarge
from daemon.mirror.uploader import JOB_YAML_MAX, MANIFEST_MAX, debug_delay, remote_steps
from engine.errors import JobInvalid

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
        return remote.get(f"{key}/job.yaml", JOB_YAML_MAX).decode("utf-8")
    except FileNotFoundError as e:
        raise JobInvalid(f"mirror {remote.name!r} has no job {key!r} (no {key}/job.yaml there: {e})") from None
    except TooLarge:
        raise JobInvalid(f"mirror {remote.name!r}: {key}/job.yaml is larger than {JOB_YAML_MAX} bytes") from None
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
            manifest = json.loads(remote.get(f"{key}/checkpoints/{name}/manifest.json", MANIFEST_MAX))
            fmt, config_hash = manifest.get("format"), manifest.get("config_hash")
        except (FileNotFoundError, TooLarge, ValueError, AttributeError):
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
    text = job_text(remote, key, text)
    cfg = validate(text)
    root = staging / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    skipped: list[tuple[str, str]] = []
    for name in remote_steps(remote, key):
        why = _download(remote, key, name, root / name, cfg, progress)
        if why is None:
            return Restored(text, root, int(name[5:]), skipped)
        skipped.append((name, why))
        shutil.rmtree(root / name, ignore_errors=True)
    return Restored(text, root, None, skipped)


def _manifest(remote: Remote, key: str, name: str, cfg) -> tuple[dict[str, int], dict[str, str], bytes] | str:
    """The remote manifest of KEY/checkpoints/NAME: ({file: size}, {file: sha256}, its bytes), or why it cannot be
    used. The engine's rules (engine/checkpoint/store.py verify): format, step, the files a checkpoint needs; a
    newer lorad's or another job's raises JobInvalid."""
    from engine.checkpoint.store import (
        CHECKPOINT_FILES,
        FORMAT_VERSION,
        SHARDED_FILES,
        changed_keys,
        step_dir_name,
    )

    try:
        raw = remote.get(f"{key}/checkpoints/{name}/manifest.json", MANIFEST_MAX)
    except FileNotFoundError:
        return "no manifest.json (its upload never finished)"
    except TooLarge:
        return f"its manifest.json is larger than {MANIFEST_MAX} bytes"
    where = f"mirror {remote.name!r}, {key}/checkpoints/{name}"
    try:
        manifest = json.loads(raw)
        fmt = manifest.get("format")
        if isinstance(fmt, int) and fmt > FORMAT_VERSION:
            raise JobInvalid(f"{where} was written by a newer lorad (checkpoint format {fmt}; this lorad reads "
                             f"{FORMAT_VERSION}): upgrade lorad to resume it")
        if fmt != FORMAT_VERSION:
            return f"manifest format {fmt!r} is not {FORMAT_VERSION}"
        if step_dir_name(int(manifest["step"])) != name:
            return f"manifest says step {manifest['step']}, directory says {name}"
        files = manifest["files"]
        sizes = {n: int(meta["size"]) for n, meta in files.items()}
        sums = {n: str(meta["sha256"]) for n, meta in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"manifest.json is unreadable ({type(e).__name__}: {e})"[:300]
    missing = [n for n in (SHARDED_FILES if SHARDED_FILES[0] in sizes else CHECKPOINT_FILES) if n not in sizes]
    if missing:
        return f"manifest.json lists no {missing[0]}"
    if bad := next((n for n, size in sizes.items() if not _inside(n) or size < 0), None):
        return f"its manifest names {bad[:200]!r}, outside the checkpoint (or with a negative size)"
    if manifest.get("config_hash") != cfg.identity_hash():
        changed = changed_keys(manifest.get("identity"), cfg.identity())
        raise JobInvalid(f"{where}: checkpoint was written by a job with different model/lora/data/train settings "
                         f"({f'changed since: {changed}' if changed else 'another config hash'})")
    return sizes, sums, raw


def _download(remote: Remote, key: str, name: str, dest: Path, cfg, progress: Progress | None = None) -> str | None:
    """One remote checkpoint into dest, streamed: each file's size (never more than its manifest says: nothing
    beyond is read) and sha256 checked as it arrives, the manifest written last. The reason it cannot be one, or
    None. The tensors are parsed by the trainer when it resumes (memory here stays flat in checkpoint size)."""
    got = _manifest(remote, key, name, cfg)
    if isinstance(got, str):
        return got
    sizes, sums, raw = got
    dest.mkdir(parents=True)
    delay, done_bytes, total = debug_delay("LORAD_DEBUG_MIRROR_FETCH_DELAY_S"), 0, sum(sizes.values())
    for i, (rel, size) in enumerate(sizes.items(), 1):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with open(target, "wb") as f:
            def sink(chunk: bytes, f=f, h=h) -> None:
                h.update(chunk)
                f.write(chunk)

            try:
                n = remote.read_to(f"{key}/checkpoints/{name}/{rel}", sink, size)
            except FileNotFoundError:
                return f"{rel} is missing"
            except TooLarge:
                return f"{rel} is larger than its manifest says ({size} bytes): refused"
        if n != size:
            return f"{rel} is {n} bytes, manifest says {size} (truncated?)"
        if h.hexdigest() != sums[rel]:
            return f"{rel} fails its sha256 checksum (corrupted)"
        done_bytes += n
        if progress is not None:
            progress(name, i, len(sizes), done_bytes, total)
        if delay:
            time.sleep(delay)
    (dest / "manifest.json").write_bytes(raw)  # last: what is in dest counts once it is there
    return None


def describe(restored: Restored) -> str:
    """One line for the job's events and the submitter: what was chosen, and what was passed over and why."""
    chosen = f"step {restored.step}" if restored.step is not None else "no usable checkpoint: starts from step 0"
    passed = "; ".join(f"{n}: {why}" for n, why in restored.skipped)
    return chosen + (f" (walked back past {passed})" if passed else "")

