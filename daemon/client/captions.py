"""`lorad captions ID --to DIR [--force]`: a job's captions (data.captions: auto, files-else-auto) written out as
DIR/<image path>.txt, one per image, ready to go beside the images or into another trainer.

Captions live in lorad's cache, never in the user's data folder; the caption stage writes the job's own list to
HOME/jobs/ID/captions.json (engine/captioning/stage.py), which this reads with no model loaded and no daemon
needed. Each file is written aside, fsynced and renamed into place; files already in DIR are refused before
anything is written, unless --force.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path, PurePosixPath

from daemon import protocol as p
from daemon.client import render
from daemon.client.export import local_job
from daemon.client.verbs import call, fail, out
from daemon.supervisor.caption_edits import CAPTIONS_FILE, MAX_CAPTIONS_BYTES, skipped_files
from daemon.system.paths import default_home
from daemon.system.safe_files import open_at, opened_dir
from engine.storage.fsio import RealFs, ensure_dir_durable, write_file_durable

MOST_SKIPS_NAMED = 10


def cmd_captions(args: argparse.Namespace) -> int:
    home = Path(args.home) if args.home else default_home()
    job, workdir = local_job(home, args.job)  # a ProtocolError (not_found) is the CLI's one line, exit 1
    try:
        with opened_dir(workdir) as d:
            fd = open_at(d, CAPTIONS_FILE)
        with open(fd, "rb") as f:
            captions = json.loads(f.read(MAX_CAPTIONS_BYTES))
    except FileNotFoundError:
        return fail(False, "not_found", f"job {job} has no captions yet (data.captions: auto or files-else-auto "
                                        f"writes them as its first stage)", 1)
    except (OSError, ValueError) as e:
        return fail(False, "corrupt", f"job {job}: {workdir / CAPTIONS_FILE} is unreadable ({e})", 1)
    dest = Path(args.to)
    files = {}
    for rel, text in sorted(captions.items()):
        parts = PurePosixPath(rel).with_suffix(".txt").parts
        if not isinstance(text, str) or ".." in parts or PurePosixPath(rel).is_absolute():
            return fail(False, "corrupt", f"job {job}: {CAPTIONS_FILE} names {rel!r}, not an image of data.path", 1)
        files[dest.joinpath(*parts)] = text
    if (taken := [str(f) for f in files if f.exists()]) and not args.force:
        return fail(False, "exists", f"{len(taken)} caption file(s) already in {dest} ({', '.join(taken[:3])}); "
                                     f"nothing written — use --force to overwrite", 1)
    fs = RealFs()
    for path, text in files.items():
        ensure_dir_durable(fs, path.parent)
        write_file_durable(fs, path, (text + "\n").encode("utf-8"))
    print(f"job {job}: {len(files)} caption(s) written to {dest}")
    if skipped := skipped_files(workdir):
        names = ", ".join(skipped[:MOST_SKIPS_NAMED]) + (" …" if len(skipped) > MOST_SKIPS_NAMED else "")
        print(render.term_safe(f"job {job}: {len(skipped)} file(s) could not be read and have no caption (why: "
                               f"`lorad logs {job}`, caption_skipped): {names}"))
    return 0


def cmd_caption(args: argparse.Namespace) -> int:
    """`lorad caption JOB IMAGE TEXT`: the dashboard's caption edit, through the daemon (before training starts)."""
    data = call(args, p.EditCaption(job=args.job, image=args.image, caption=args.text))
    reply = p.JobActionReply.model_validate(data)
    return out(args, data, lambda d: print(render.term_safe(f"{reply.job}: {reply.message}")))


def add_parser(sub, common) -> None:
    p_ = sub.add_parser("captions", parents=[common], help="write a job's generated captions out as .txt files")
    p_.add_argument("job", type=str)
    p_.add_argument("--to", metavar="DIR", required=True, help="where to write IMAGE.txt for each image")
    p_.add_argument("--force", action="store_true", help="overwrite caption files already in DIR")
    p_.set_defaults(fn=cmd_captions)
    p_ = sub.add_parser("caption", parents=[common], help="edit one image's caption before the job trains")
    p_.add_argument("job", type=str)
    p_.add_argument("image", type=str, help="the image's path under data.path, as `lorad captions` names it")
    p_.add_argument("text", type=str, help="its caption (the trigger word is not added: write it)")
    p_.set_defaults(fn=cmd_caption)



