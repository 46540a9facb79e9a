"""The caption stage: every image that needs a caption gets one from the captioner, before the latent cache.

Which images: all of them (data.captions: auto) or those without a caption file (files-else-auto), in the
scan's order. They are cut into batches of data.captioner.batch_size by position in that list, and a batch is
generated only when one of its images has no committed caption yet; a batch's captions are committed together
(store.py). So a kill loses at most the batch in flight, a resumed job generates exactly the batches an
uninterrupted one would have left (same images, same batch, same greedy captions), and a second job on the same
images and captioner generates nothing. Each committed batch is a `captions_committed` event (its images, done,
total, eta_s): the daemon's heartbeat during a long stage, and the count of what was generated.

Clips (the video families) are captioned the same way, each from data.captioner.frames frames sampled evenly
over it (frames.py), keyed by the clip's sha256 and an identity that adds the frame sampling.

A file the captioner cannot be shown (an image that does not decode, a clip that breaks before its last sampled
frame) keeps its caption file or trigger (a clip's broken windows are left out by video/cache.py). When its
bytes are at fault (frames.py's Unseeable.lasting) its skip is committed with its batch, keyed like a caption
(store.py), so its batch counts as done: no later attempt or job decodes it again or regenerates its batch-mates.
A fixed file has another sha256 and is captioned. A `caption_skipped` warning names it once per job (recorded in
WORKDIR/captions_skipped.json, so a resumed attempt that reads the skip back does not say it again).

With data.captioner.hold_for_review the job then stops, held (`captions_ready`, HeldForReview: exit 75), until
the daemon writes WORKDIR/captions_reviewed.json when the person resumes it (engine/config/caption_edits.py).

A person's edits (WORKDIR/caption_edits.json, written by the daemon: engine/config/caption_edits.py) win over the generated captions.
The job's captions (relative path → caption, edits applied) are written to WORKDIR/captions.json: what `lorad
captions ID --to DIR` writes out, with no model loaded, and what the dashboard shows.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from engine.captioning.captioner import Captioner, check, resolve
from engine.captioning.frames import SAMPLING, Unseeable, images_of
from engine.captioning.store import CaptionStore, captioner_identity
from engine.config.caption_edits import APPLIED_FILE, read_edits, reviewed
from engine.config.declare import VIDEO_FAMILIES
from engine.config.job import JobConfig
from engine.data.images import ImageRecord, make_caption
from engine.errors import HeldForReview
from engine.storage.fsio import RealFs, write_file_durable
from engine.storage.home import cache_dir
from engine.training.stop import debug_pause

CAPTIONS_FILE = "captions.json"
SKIPS_FILE = "captions_skipped.json"  # the skips this job has warned of: relative path → sha256


def needs_caption(mode: str, record: ImageRecord) -> bool:
    return mode == "auto" or (mode == "files-else-auto" and record.caption_missing)


def caption_records(cfg: JobConfig, records: list[ImageRecord], workdir: Path, log) -> list[ImageRecord]:
    """The records with their captions from the captioner where data.captions asks for them (generated now, or
    read back from the store)."""
    mode = cfg.data.caption_mode
    need = [r for r in records if needs_caption(mode, r)]
    if not need:
        return records
    edits = read_edits(workdir)  # read once: what this attempt trains on (recorded below for the identity)
    c = cfg.data.captioner_or_default()
    model_dir = resolve(c.model, c.revision, workdir)
    check(model_dir, c.model)
    clips = cfg.model.family in VIDEO_FAMILIES
    prompt = c.full_prompt(cfg.data.trigger, clips=clips)
    settings = {"model": c.model, "revision": c.revision, "prompt": prompt, "max_tokens": c.max_tokens}
    if clips:  # which frames the model sees decides the caption (an image job's identity stays as it was)
        settings["clip_frames"] = {"frames": c.frames, "fps": cfg.data.fps, "sampling": SAMPLING}
    identity = captioner_identity(settings, model_dir)
    store = CaptionStore(cache_dir(workdir) / "captions", identity)
    batches = [need[i:i + c.batch_size] for i in range(0, len(need), c.batch_size)]
    recorded = {r.sha256: why for r in need if store.get(r.sha256) is None and (why := store.skipped(r.sha256))}
    # A batch is done when each of its files has a caption or a recorded skip.
    todo = [b for b in batches if any(store.get(r.sha256) is None and r.sha256 not in recorded for r in b)]
    total, todo_ids = sum(len(b) for b in todo), {id(b) for b in todo}
    cached = sum(r.sha256 not in recorded for b in batches if id(b) not in todo_ids for r in b)
    log.info("captioning", images=len(need), cached=cached, skipped=len(recorded), to_caption=total,
             captioner=c.model, identity=identity)
    skips = _Skips(Path(workdir), log)
    for r in need:  # skipped by an earlier attempt or job: not decoded again
        if r.sha256 in recorded:
            skips.warn(r, recorded[r.sha256], "skipped before: not tried again until the file changes")
    if todo:
        _generate(todo, store, model_dir, c, prompt, total, cfg.data.fps, log, recorded, skips)
    skipped = skips.rels
    captions = {r.sha256: store.get(r.sha256) for r in need}
    if missing := [r.rel for r in need if captions[r.sha256] is None and r.rel not in skipped]:
        raise OSError(f"captions of {', '.join(missing[:5])} were committed and are gone from {store.dir}")
    out = [dataclasses.replace(r, caption=make_caption(captions[r.sha256], cfg.data.trigger), caption_missing=False)
           if needs_caption(mode, r) and captions[r.sha256] is not None else r for r in records]
    # What this attempt applies (none: {}, so no earlier attempt's record stays) is what its identity holds.
    write_file_durable(RealFs(), Path(workdir) / APPLIED_FILE, json.dumps(edits, ensure_ascii=False).encode())
    if edits:  # a person's edit wins over the generated caption and over a caption file
        out = [dataclasses.replace(r, caption=edits[r.rel], caption_missing=False) if r.rel in edits else r
               for r in out]
        log.info("caption_edits", images=sorted(set(edits) & {r.rel for r in out}),
                 unknown=sorted(set(edits) - {r.rel for r in out}))
    write_file_durable(RealFs(), Path(workdir) / CAPTIONS_FILE, json.dumps(
        {r.rel: r.caption for r in out}, indent=1, ensure_ascii=False).encode("utf-8"))
    if c.hold_for_review and not reviewed(workdir):
        log.info("captions_ready", images=len(out), captions=str(Path(workdir) / CAPTIONS_FILE),
                 message="captions ready for review (data.captioner.hold_for_review): edit them on the dashboard "
                         "or with `lorad caption ID IMAGE TEXT`, then `lorad resume ID` trains on them")
        raise HeldForReview(f"captions of {len(out)} file(s) are ready for review in {Path(workdir) / CAPTIONS_FILE}")
    return out


def _still_scanned(r: ImageRecord) -> bool:
    """Whether the file still holds the bytes its record's sha256 was taken from."""
    import hashlib

    try:
        with open(r.path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == r.sha256
    except OSError:
        return False


class _Skips:
    """The `caption_skipped` warnings, once per job (its WORKDIR/captions_skipped.json), and this attempt's skips."""

    def __init__(self, workdir: Path, log):
        self.path, self.log, self.rels = workdir / SKIPS_FILE, log, set()
        try:
            self.said = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.said = {}

    def warn(self, r: ImageRecord, why: str, note: str) -> None:
        self.rels.add(r.rel)
        if self.said.get(r.rel) == r.sha256:
            return
        self.log.warning("caption_skipped", file=r.rel, reason=why, message=f"{r.rel} is not captioned: it {why} ({note})")
        self.said[r.rel] = r.sha256  # after the warning: a kill in between says it again rather than never
        write_file_durable(RealFs(), self.path, json.dumps(self.said, indent=1, ensure_ascii=False).encode())


def _generate(todo: list[list[ImageRecord]], store: CaptionStore, model_dir: Path, c, prompt: str, total: int,
              fps: float, log, recorded: dict[str, str], skips: _Skips) -> None:
    """Caption and commit the batches, with the skips of the files whose bytes are at fault."""
    from engine.training.dtypes import pick_device

    captioner = Captioner(model_dir, c.model, pick_device())
    try:
        t0, done = time.monotonic(), 0
        for batch in todo:
            seen, fresh = [], []
            for r in batch:
                if r.sha256 in recorded:  # already said at the stage's start
                    continue
                try:
                    seen.append((r, images_of(r, fps, c.frames)))
                except Unseeable as e:
                    fresh.append((r, e))
            texts = captioner.caption([ims for _r, ims in seen], prompt, c.max_tokens) if seen else []
            # Only the lasting skips are committed, and only under the bytes that broke: a file the machine failed
            # to read, or one changed since the scan, is tried by the next job.
            lasting = [(r, e) for r, e in fresh if e.lasting and _still_scanned(r)]
            store.put_all({r.sha256: t for (r, _ims), t in zip(seen, texts, strict=True)
                           if store.get(r.sha256) is None},
                          {r.sha256: str(e) for r, e in lasting})
            for r, e in fresh:  # before the batch's event: a kill after that event finds them said
                skips.warn(r, str(e), "recorded: not tried again until the file changes" if (r, e) in lasting else
                           "not recorded: it could not be read as scanned, the next job tries again")
            done += len(batch)
            rate = (time.monotonic() - t0) / done
            log.info("captions_committed", images=[r.rel for r, _ims in seen], done=done, total=total,
                     eta_s=round(rate * (total - done), 1))
            debug_pause()  # tests: a kill between two batches lands before the stage ends
    finally:
        captioner.close()
