"""`lorad import` (another trainer's config → a lorad job file) and `lorad check` (what a job will do, before it
runs). Both work here, without the daemon and without the training stack: the importers and the job validator
are torch-free (engine/importers/, engine/config/).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

EXIT_INVALID = 65


def _problem_lines(message: str) -> list[str]:
    """One validation message (problems joined by `; `) as one line per problem: split only where the next
    part starts with a key (`train.lr: ...`), never inside a problem's own words."""
    return [p.strip() for p in re.split(r"; (?=[\w.\[\]/-]+: )", message) if p.strip()]


def cmd_import(args: argparse.Namespace) -> int:
    from engine.config.job import parse_job
    from engine.config.reading import read_yaml
    from engine.errors import JobInvalid
    from engine.importers import import_file

    src = Path(args.file)
    try:
        result = import_file(src, Path(args.dataset) if args.dataset else None)
        # lorad's own validation of what was written, paths and all, resolved as the file will be read
        parse_job(read_yaml(result.text), src.parent.resolve(), source=src.name)
    except JobInvalid as e:
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "problems": _problem_lines(" ".join(str(e).split()))}))
        else:
            print(f"lorad: cannot import: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_INVALID
    dest = Path(args.to) if args.to else None
    if getattr(args, "json", False):
        if dest is not None:
            dest.write_text(result.text)
        imp = result.imported
        print(json.dumps({"ok": True, "tool": imp.tool, "source": imp.source, "job": imp.job, "origin": imp.origin,
                          "not_carried": [{"key": k, "value": v, "why": why} for k, v, why in imp.dropped],
                          "notes": imp.notes, "written": str(dest) if dest else None}, default=str))
        return 0
    if dest is None:
        sys.stdout.write(result.text)
    else:
        dest.write_text(result.text)
    imp = result.imported
    print(f"lorad: imported {src.name} from {imp.tool}: {len(imp.origin)} keys carried, "
          f"{len(imp.dropped)} not carried over" + (f"; wrote {dest}" if dest else ""), file=sys.stderr)
    for n in imp.notes:
        if n.startswith("model:"):
            print(f"lorad: {n}", file=sys.stderr)
    return 0


# ================================================================ lorad check
def dataset_summary(cfg) -> dict[str, Any]:
    """Images, their captions and buckets as the image families read them (engine/data/images.py's rules)."""
    from engine.config.buckets import assign_bucket
    from engine.config.declare import IMAGE_FAMILIES, VIDEO_FAMILIES
    from engine.config.sources import list_images, list_media

    if cfg.model.family not in IMAGE_FAMILIES:
        return {"path": cfg.data.path}
    folder = Path(cfg.data.path)
    video = cfg.model.family in VIDEO_FAMILIES
    files = list_media(folder) if video else list_images(folder)
    missing = [str(p.relative_to(folder)) for p in files
               if not p.with_suffix("." + cfg.data.caption_ext).is_file()]
    buckets: Counter[str] = Counter()
    if not video:
        for size in _sizes(files):
            for res in cfg.data.resolution:
                bw, bh = assign_bucket(*size, res)
                buckets[f"{bw}x{bh}"] += 1
    items = len(files) * (1 if video else len(cfg.data.resolution))
    counts = caption_counts(cfg, folder, files, set(missing), cfg.data.fps if video else None)
    if video:
        counts["media"] = "clips and stills"
    return {**counts, "path": cfg.data.path, "files": len(files), "items": items, "repeats": cfg.data.repeats,
            "samples_per_epoch": items * cfg.data.repeats, "buckets": dict(sorted(buckets.items())),
            "captions_missing": len(missing), "captions_missing_files": missing[:20],
            "trigger": cfg.data.trigger, "caption_ext": cfg.data.caption_ext}


def caption_counts(cfg, folder: Path, files: list[Path], missing: set[str], fps: float | None = None) -> dict[str, Any]:
    """The caption stage's counts (docs/captions.md): images, captioned (by their files), to caption (by the
    captioner), and with data.dedupe the near-duplicate groups by name (the perceptual hashes computed here; of a
    video job's clips, with its fps, by their sampled frames)."""
    names = [str(p.relative_to(folder)) for p in files]
    out: dict[str, Any] = {"images": len(names), "caption_mode": cfg.data.caption_mode}
    dropped: set[str] = set()
    if cfg.data.dedupe_mode != "off":
        try:
            from engine.captioning.dedupe import near_duplicate_groups

            groups = near_duplicate_groups(list(zip(names, files, strict=True)), fps)
        except ImportError as e:  # the thin client: no Pillow or numpy
            groups = None
            out["duplicates_note"] = f"not computed here ({e.name} is not installed)"
        except OSError as e:
            groups = None
            out["duplicates_note"] = f"not computed: {e}"
        out["duplicate_groups"] = groups
        if groups is not None:
            dropped = {n for g in groups for n in g[1:]} if cfg.data.dedupe_mode == "skip" else set()
            out["duplicates"] = sum(len(g) for g in groups)
            out["skipped"] = sorted(dropped)
    kept = [n for n in names if n not in dropped]
    mode = cfg.data.caption_mode
    generated = kept if mode == "auto" else [n for n in kept if n in missing] if mode == "files-else-auto" else []
    out["to_caption"] = len(generated)
    out["captioned"] = sum(n not in missing for n in kept) if mode != "auto" else 0
    return out


def _sizes(files: list[Path]) -> list[tuple[int, int]]:
    """Each image's (w, h) from its header; none without Pillow (`pip install lorad`, no training stack)."""
    try:
        from PIL import Image
    except ImportError:
        return []
    out = []
    for p in files:
        try:
            with Image.open(p) as im:
                out.append(im.size)
        except OSError:
            continue
    return out


def _model_note(path: str) -> str:
    from engine.builtin.models import BUILTIN_PREFIX
    from engine.config.paths import looks_like_hub_id

    if path.startswith(BUILTIN_PREFIX):
        return "built in (made offline)"
    if Path(path).is_dir():
        return "a local directory"
    if looks_like_hub_id(path):
        return "a hub id; not looked at (offline is fine): the trainer fetches it"
    return "?"


def check_report(cfg, header) -> dict[str, Any]:
    from engine.config.job import dump_job
    from engine.config.reading import read_yaml

    data = dataset_summary(cfg)
    per_epoch = data.get("samples_per_epoch")
    g = cfg.global_batch()
    return {
        "ok": True, "name": cfg.name, "family": cfg.model.family, "model": cfg.model.path,
        "model_note": _model_note(cfg.model.path),
        "imported_from": header.tool if header else None,
        "not_carried_over": header.dropped if header else [],
        "steps": cfg.train.steps, "global_batch": g,
        "epochs": round(cfg.train.steps * g / per_epoch, 2) if per_epoch else None,
        # lorad times a job from its own first steps (lorad status: ETA): no guess before one has run here
        "estimated_time": None, "estimated_time_note": "known after the first steps (lorad status shows the ETA)",
        "output_formats": list(cfg.output.formats),
        "memory_plan": "decided at start, from the GPU's free memory (resources.vram_gb where set)",
        "dataset": data,
        "job": read_yaml(dump_job(cfg)),
    }


def _caption_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    if "images" not in d:
        return []
    rows = [("captions", f"{d['images']} {d.get('media', 'images')}: {d['captioned']} captioned (files), "
                         f"{d['to_caption']} to caption "
                         f"(data.captions: {d['caption_mode']})")]
    if "duplicate_groups" in d:
        groups = d["duplicate_groups"]
        rows.append(("duplicates", d.get("duplicates_note") if groups is None else "none" if not groups else
                     f"{d['duplicates']} {d.get('media', 'images')} in {len(groups)} group(s): "
                     + "; ".join(", ".join(g) for g in groups)
                     + (f" ({len(d['skipped'])} left out: data.dedupe skip)" if d["skipped"] else "")))
    return rows


def cmd_check(args: argparse.Namespace) -> int:
    from engine.config.job import dump_job, parse_job
    from engine.config.reading import MAX_JOB_FILE_BYTES, decode_job_bytes, read_yaml
    from engine.errors import JobInvalid
    from engine.importers import detect, import_text, is_foreign_name, read_header

    path = Path(args.job)
    try:
        data = path.read_bytes()[: MAX_JOB_FILE_BYTES + 1]
        if len(data) > MAX_JOB_FILE_BYTES:
            raise JobInvalid(f"{path.name}: larger than the {MAX_JOB_FILE_BYTES}-byte limit")
        text = decode_job_bytes(data, path.name)
        if detect(text, path.name) is not None or is_foreign_name(path.name):  # another trainer's config: checked as it would be imported
            text = import_text(text, path.name, path.parent.resolve()).text
        cfg = parse_job(read_yaml(text, max_aliases=100), path.parent.resolve(), source=path.name)
    except (JobInvalid, OSError) as e:
        msg = str(e) if isinstance(e, JobInvalid) else f"{path.name}: cannot read: {e.strerror}"
        lines = _problem_lines(msg)
        if args.json:
            print(json.dumps({"ok": False, "problems": lines, "exit": EXIT_INVALID}, indent=1))
        for line in lines:
            print(f"lorad: {line}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as e:  # noqa: BLE001 - a YAML error the reader words (YamlProblem): one line, never a traceback
        print(f"lorad: {path.name}: {e}", file=sys.stderr)
        return EXIT_INVALID
    rep = check_report(cfg, read_header(text))
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
        return 0
    d = rep["dataset"]
    rows = [("job", rep["name"]), ("family", rep["family"]), ("model", f"{rep['model']} ({rep['model_note']})")]
    if rep["imported_from"]:
        rows.append(("imported from", f"{rep['imported_from']} ({len(rep['not_carried_over'])} settings not "
                                      "carried over: see the file's header)"))
    if "items" in d:
        rows += [("dataset", f"{d['path']}: {d['files']} files, {d['items']} items × {d['repeats']} repeats = "
                             f"{d['samples_per_epoch']} samples an epoch"),
                 ("buckets", ", ".join(f"{k} ({v})" for k, v in d["buckets"].items()) or "-"),
                 ("captions missing", f"{d['captions_missing']}" + (f" (their caption: the trigger {d['trigger']!r})"
                                                                    if d["captions_missing"] and d["trigger"] else ""))]
        rows += _caption_rows(d)
    else:
        rows.append(("dataset", d["path"]))
    rows += [("steps", f"{rep['steps']} steps of {rep['global_batch']} samples each" + (f" (≈ {rep['epochs']} epochs)"
                                                                             if rep["epochs"] else "")),
             ("estimated time", rep["estimated_time_note"]), ("outputs", ", ".join(rep["output_formats"])),
             ("memory plan", rep["memory_plan"])]
    for k, v in rows:
        print(f"{k:>16}: {v}")
    print("--- the job, normalised (defaults filled in):")
    sys.stdout.write(dump_job(cfg))
    return 0
