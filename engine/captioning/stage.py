"""The caption stage: every image that needs a caption gets one from the captioner, before the latent cache.

Which images: all of them (data.captions: auto) or those without a caption file (files-else-auto), in the
scan's order. They are cut into batches of data.captioner.batch_size by position in that list, and a batch is
generated only when one of its images has no committed caption yet; a batch's captions are committed together
(store.py). So a kill loses at most the batch in flight, a resumed job generates exactly the batches an
uninterrupted one would have left (same images, same batch, same greedy captions), and a second job on the same
images and captioner generates nothing. Each committed batch is a `captions_committed` event (its images, done,
total, eta_s): the daemon's heartbeat during a long stage, and the count of what was generated.

The job's captions (relative path → caption) are written to WORKDIR/captions.json: what `lorad captions ID
--to DIR` writes out, with no model loaded.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from engine.captioning.captioner import Captioner, check, resolve
from engine.captioning.store import CaptionStore, captioner_identity
from engine.config.job import JobConfig
from engine.data.images import ImageRecord, make_caption
from engine.storage.fsio import RealFs, write_file_durable
from engine.storage.home import cache_dir
from engine.training.stop import debug_pause

CAPTIONS_FILE = "captions.json"


def needs_caption(mode: str, record: ImageRecord) -> bool:
    return mode == "auto" or (mode == "files-else-auto" and record.caption_missing)


def caption_records(cfg: JobConfig, records: list[ImageRecord], workdir: Path, log) -> list[ImageRecord]:
    """The records with their captions from the captioner where data.captions asks for them (generated now, or
    read back from the store)."""
    mode = cfg.data.caption_mode
    need = [r for r in records if needs_caption(mode, r)]
    if not need:
        return records
    c = cfg.data.captioner_or_default()
    model_dir = resolve(c.model, c.revision, workdir)
    check(model_dir, c.model)
    prompt = c.full_prompt(cfg.data.trigger)
    identity = captioner_identity({"model": c.model, "revision": c.revision, "prompt": prompt,
                                   "max_tokens": c.max_tokens}, model_dir)
    store = CaptionStore(cache_dir(workdir) / "captions", identity)
    batches = [need[i:i + c.batch_size] for i in range(0, len(need), c.batch_size)]
    todo = [b for b in batches if any(store.get(r.sha256) is None for r in b)]
    total = sum(len(b) for b in todo)
    log.info("captioning", images=len(need), cached=len(need) - total, to_caption=total, captioner=c.model,
             identity=identity)
    if todo:
        _generate(todo, store, model_dir, c, prompt, total, log)
    captions = {r.sha256: store.get(r.sha256) for r in need}
    if missing := [r.rel for r in need if captions[r.sha256] is None]:  # only a store that lost files meanwhile
        raise OSError(f"captions of {', '.join(missing[:5])} were committed and are gone from {store.dir}")
    out = [dataclasses.replace(r, caption=make_caption(captions[r.sha256], cfg.data.trigger), caption_missing=False)
           if needs_caption(mode, r) else r for r in records]
    write_file_durable(RealFs(), Path(workdir) / CAPTIONS_FILE, json.dumps(
        {r.rel: r.caption for r in out}, indent=1, ensure_ascii=False).encode("utf-8"))
    return out


def _generate(todo: list[list[ImageRecord]], store: CaptionStore, model_dir: Path, c, prompt: str, total: int,
              log) -> None:
    from engine.data.images import load_upright
    from engine.training.dtypes import pick_device

    captioner = Captioner(model_dir, c.model, pick_device())
    try:
        t0, done = time.monotonic(), 0
        for batch in todo:
            texts = captioner.caption([load_upright(r.path) for r in batch], prompt, c.max_tokens)
            store.put_all({r.sha256: t for r, t in zip(batch, texts, strict=True) if store.get(r.sha256) is None})
            done += len(batch)
            rate = (time.monotonic() - t0) / done
            log.info("captions_committed", images=[r.rel for r in batch], done=done, total=total,
                     eta_s=round(rate * (total - done), 1))
            debug_pause()  # tests: a kill between two batches lands before the stage ends
    finally:
        captioner.close()
