"""`lorad export ID [--step N] [--to DIR] [--force]`: the LoRA files of a saved step, listed or copied out.

The daemon names the job's committed checkpoints and, from each manifest, its export files with their sizes and
sha256 (the `exports` verb). Without --step the steps are listed; with it each file is copied into DIR (default
./ID-step-N/), its sha256 checked as it is read, written aside, fsynced and renamed into place, then DIR is
fsynced: a copy cut short leaves no file under a final name. Files already in DIR are refused before anything
is copied, unless --force. The checkpoint's files are opened by descriptor, never through a symlink (the trainer
user writes the job directory). A checkpoint pruned (checkpoint.keep) is no longer offered.

With no daemon serving the home (a job trained with `lorad run`, or the daemon stopped), the same listing is
read straight from HOME/jobs/ID with the same checks: committed checkpoints only, sha256 verified while
copying, no symlink followed, atomic writes. A daemon that answers is always asked first: it knows the job's
state and resolves id prefixes against its store.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
from pathlib import Path

from daemon import protocol as p
from daemon.client.connection import DaemonDown
from daemon.client.render import term_safe
from daemon.client.verbs import call, fail, out
from daemon.supervisor.disk_progress import open_export, saved_exports
from daemon.system.paths import default_home
from engine.storage.fsio import RealFs, ensure_dir_durable

CHUNK = 1 << 20


ON_DISK = "on disk, no daemon"  # the state shown when the listing was read from the job directory


def cmd_export(args: argparse.Namespace) -> int:
    reply = _listing(args)
    if args.step is None:
        return out(args, reply.model_dump(), lambda d: _print_steps(reply))
    saved = reply.steps[0]
    dest = Path(args.to) if args.to is not None else Path(f"{reply.job}-step-{saved.step}")
    taken = [f.name for f in saved.files if (dest / f.name).exists()]
    if taken and not args.force:
        return fail(args.json, "exists", f"{dest} already holds {', '.join(taken)} (job {reply.job} step "
                                         f"{saved.step}); nothing copied — use --force to overwrite", 1)
    workdir = Path(saved.path).parent.parent
    try:
        for f in saved.files:
            _copy(workdir, saved.step, f, dest)
    except _Mismatch as e:
        return fail(args.json, "corrupt", f"job {reply.job} step {saved.step}: {e} — the checkpoint fails "
                                          f"verification; choose another step", 1)
    except OSError as e:
        return fail(args.json, "io", f"job {reply.job} step {saved.step}: cannot copy "
                                     f"{e.filename or ''} ({e.strerror or e})", 1)
    done = {"job": reply.job, "step": saved.step, "to": str(dest), "files": [f.name for f in saved.files]}
    if args.json:
        print(json.dumps(done, indent=1))
    else:
        print(term_safe(f"job {reply.job} step {saved.step}: {len(saved.files)} file(s) copied to {dest}"))
    return 0


def _listing(args: argparse.Namespace) -> p.ExportsReply:
    try:
        return p.ExportsReply.model_validate(call(args, p.Exports(job=args.job, step=args.step)))
    except DaemonDown:
        if getattr(args, "socket", None) or os.environ.get("LORAD_SOCKET"):
            raise  # a socket named on purpose: that daemon was wanted, not the files of some home
        home = Path(args.home) if getattr(args, "home", None) else default_home()
        try:
            job, workdir = local_job(home, args.job)
        except p.ProtocolError as e:
            raise p.ProtocolError(e.code, f"the daemon is not running, and {e.message}") from None
        try:
            saved = saved_exports(workdir, args.step)
        except LookupError as e:
            raise p.ProtocolError("not_found", f"job {job} {e}") from None
        return p.ExportsReply.of(job, ON_DISK, saved)


def local_job(home: Path, ref: str) -> tuple[str, Path]:
    """HOME/jobs/REF, or the one job directory whose name starts with REF; never through a symlink."""
    jobs = home / "jobs"
    try:
        names = sorted(e.name for e in os.scandir(jobs) if e.is_dir(follow_symlinks=False))
    except OSError:
        names = []
    match = [ref] if ref in names else [n for n in names if n.startswith(ref)]
    if len(match) != 1:
        which = "no job" if not match else f"{len(match)} jobs ({', '.join(match[:6])})"
        raise p.ProtocolError("not_found", f"{jobs} holds {which} named {ref!r}")
    return match[0], jobs / match[0]  # open_export reaches its files by descriptor, never through a symlink


class _Mismatch(Exception):
    pass


def _copy(workdir: Path, step: int, f: p.ExportFile, dest: Path) -> None:
    """One file into dest/NAME, durably (written aside, checked, fsynced, renamed, directory fsynced)."""
    target = dest / f.name
    ensure_dir_durable(RealFs(), target.parent)  # each directory made for it fsynced in its parent
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    src = open_export(workdir, step, f.name)
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(src, "rb", closefd=False) as r, open(tmp, "xb") as w:
            while chunk := r.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                w.write(chunk)
            w.flush()
            os.fsync(w.fileno())
        if size != f.size or digest.hexdigest() != f.sha256:
            raise _Mismatch(f"export/{f.name} is {size} bytes with sha256 {digest.hexdigest()[:12]}…, its manifest "
                            f"says {f.size} bytes, {f.sha256[:12]}…")
        os.replace(tmp, target)
    finally:
        os.close(src)
        tmp.unlink(missing_ok=True)
    RealFs().fsync_dir(target.parent)  # the new name


def _print_steps(reply: p.ExportsReply) -> None:
    if not reply.steps:
        print(term_safe(f"job {reply.job} ({reply.state}) has no saved step with export files yet"))
        return
    # The job id, its paths and its files' names come from the job's directory, which the trainer user writes.
    print(term_safe(f"job {reply.job} ({reply.state}): saved steps, newest first (lorad export {reply.job} --step N)"))
    for s in reply.steps:
        print(term_safe(f"  step {s.step}  {s.path}/export/"))
        for f in s.files:
            print(term_safe(f"      {f.name}  {_size(f.size)}"))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
