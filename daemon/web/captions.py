"""The job page's captions (data.captions: auto, files-else-auto): each image beside its caption, and a form to
edit a caption until training starts.

What is shown: WORKDIR/captions.json (the caption stage's, edits applied) overlaid with WORKDIR/caption_edits.json
(the edits made since), both read by descriptor and size-capped (the trainer user may replace either). An edit is
the `caption` verb (daemon/supervisor/caption_edits.py), posted to /jobs/ID/caption with the session's CSRF token as
every other action. An image is served only under a name captions.json lists, from the accepted job's data.path
(state.db, never the job.yaml the trainer user may rewrite), and only if it stays inside that folder.

The section sits outside the page's live part, so a poll never clobbers a caption being typed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from daemon.supervisor.caption_edits import CAPTIONS_FILE, MAX_CAPTIONS_BYTES, held, skipped_files, why_not
from daemon.system.safe_files import read_bytes
from daemon.web.pages import e
from engine.config.caption_edits import EDITS_FILE, MAX_EDITS_BYTES
from engine.config.reading import YamlProblem, read_yaml

CLIP_SUFFIXES = (".mp4", ".webm", ".mov")  # shown as <video>: engine/data/videos.py's clips that are not images
MOST_SHOWN = 500  # images on the page; the rest are named by `lorad captions ID --to DIR`
MOST_SKIPS_NAMED = 50


def _read_map(path: Path, limit: int) -> dict[str, str]:
    try:
        raw = read_bytes(path, limit)
        data = json.loads(raw) if len(raw) <= limit else {}
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(data, dict) else {}


def job_captions(workdir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(the caption stage's captions, the edits made on them)."""
    return _read_map(workdir / CAPTIONS_FILE, MAX_CAPTIONS_BYTES), _read_map(workdir / EDITS_FILE, MAX_EDITS_BYTES)


def data_path(accepted_text: str | None) -> Path | None:
    """data.path of the accepted job (None when it cannot be read)."""
    try:
        doc = read_yaml(accepted_text or "", 100)
    except YamlProblem:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    path = data.get("path") if isinstance(data, dict) else None
    return Path(path) if isinstance(path, str) else None


def image_file(root: Path | None, captions: dict[str, str], rel: str) -> Path | None:
    """The image `rel` of a job: listed in its captions and inside its data.path (None otherwise)."""
    if root is None or rel not in captions:
        return None
    root = root.resolve()
    path = (root / rel).resolve()
    return path if root in path.parents and path.is_file() else None


def section(j: dict[str, Any], csrf: str) -> str:
    """The captions section of a job page ('' for a job without a caption stage's captions)."""
    captions, edits = job_captions(Path(j["workdir"]))
    if not captions:
        return ""
    why = why_not(j)
    base = f"/jobs/{quote(j['id'])}"
    note = (f"<p class=note id=captions-locked>{e(why)}</p>" if why else
            "<p>Edit a caption before training starts: the edit wins over the generated caption and is part of "
            "the job's identity.</p>")
    if held(j):  # data.captioner.hold_for_review: the job waits for this page's Resume
        note += ("<p class=note id=captions-held>Held for review: training starts when you resume the job, on the "
                 "captions as they are then.</p>")
    rows = []
    for i, (rel, text) in enumerate(sorted(captions.items())[:MOST_SHOWN]):
        shown = edits.get(rel, text)
        tag = " <small class=edited>(edited)</small>" if rel in edits and edits[rel] != text else ""
        src = f"{base}/images/{quote(rel)}"
        img = (f"<video src='{src}' muted loop autoplay playsinline preload=metadata style='max-width:160px'></video>"
               if Path(rel).suffix.lower() in CLIP_SUFFIXES else  # a video job's clip (its GIFs and WebPs animate)
               f"<img src='{src}' alt='{e(rel)}' loading=lazy style='max-width:160px'>")
        if why:
            cell = f"<span class=caption>{e(shown)}</span>"
        else:
            cell = (f"<form method=post action='{base}/caption'><input type=hidden name=csrf value='{e(csrf)}'>"
                    f"<input type=hidden name=image value='{e(rel)}'>"
                    f"<textarea name=caption id=caption-{i} maxlength=4000 style='height:4.5em;box-sizing:border-box;"
                    f"font:13px sans-serif'>{e(shown)}</textarea><br><button id=save-caption-{i}>Save</button></form>")
        rows.append(f"<tr data-image='{e(rel)}'><td>{img}</td><td>{e(rel)}{tag}</td>"
                    f"<td style='width:60%'>{cell}</td></tr>")
    more = f"<p>… and {len(captions) - MOST_SHOWN} more</p>" if len(captions) > MOST_SHOWN else ""
    return (f"<section id=captions><h2>Captions ({len(captions)} images)</h2>{note}"
            f"{skipped_note(Path(j['workdir']))}<table><thead><tr><th>image</th>"
            f"<th>file</th><th>caption</th></tr></thead><tbody>{''.join(rows)}</tbody></table>{more}</section>")


def skipped_note(workdir: Path) -> str:
    """The files the caption stage could not read (not decodable, unreadable): not captioned, not trained on, until
    the file changes. Named here so that nobody finds out from the count alone; why, in the job's events."""
    skipped = skipped_files(workdir)
    if not skipped:
        return ""
    names = ", ".join(e(rel) for rel in skipped[:MOST_SKIPS_NAMED])
    more = f" … and {len(skipped) - MOST_SKIPS_NAMED} more" if len(skipped) > MOST_SKIPS_NAMED else ""
    return (f"<p class=note id=captions-skipped>{len(skipped)} file{'s' if len(skipped) != 1 else ''} could not be "
            f"read and {'were' if len(skipped) != 1 else 'was'} skipped (not captioned, not trained on until the "
            f"file changes; why: the job's <code>caption_skipped</code> events): {names}{more}</p>")
