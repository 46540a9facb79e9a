"""The client verbs: one function per socket verb, each one typed request (daemon/protocol.py) and its reply
printed for a person (daemon/client/render.py) or, with --json, as JSON.

These run on machines that only talk to a daemon (`pip install lorad`, no training stack): nothing here may
import torch, directly or through the engine, except lazily where a verb needs the engine's job validator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.client import render

FINAL = {"succeeded", "failed", "cancelled"}


def call(args: argparse.Namespace, req: p.BaseModel) -> dict[str, Any]:
    from daemon.client.connection import Client, find_socket

    return Client(find_socket(args.home, args.socket)).call(req)


def fail(as_json: bool, code: str, message: str, status: int) -> int:
    """An error: one line on stderr and, with --json, also {"ok": false, "error", "message", "exit"} on stdout."""
    if as_json:
        print(json.dumps({"ok": False, "error": code, "message": message, "exit": status}))
    print(f"lorad: {render.term_safe(message)}", file=sys.stderr)
    return status


def out(args: argparse.Namespace, data: dict[str, Any], human) -> int:
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        human(data)
    return 0


def cmd_ping(args: argparse.Namespace) -> int:
    data = call(args, p.Ping())

    def human(data: dict[str, Any]) -> None:
        d = p.PingReply.model_validate(data)
        who = f"lorad {d.version}" if d.version else "lorad"  # an older daemon does not say
        print(f"{who} is up: pid {d.pid}, home {d.home}, {d.running} running, up {d.uptime_s} s"
              + (", draining" if d.draining else ""))

    return out(args, data, human)


def cmd_submit(args: argparse.Namespace) -> int:
    from engine.config.job import dump_job, load_job
    from engine.errors import JobInvalid

    if args.job is None:
        if not args.from_mirror:
            return fail(args.json, "usage", "lorad submit: give a job file, or --from MIRROR_URL/JOB", 64)
        data = call(args, p.Submit(name="from-mirror.yaml", from_mirror=args.from_mirror))
        reply = p.SubmitReply.model_validate(data)
        return out(args, data, lambda d: print(render.term_safe(f"{reply.job} (from the mirror: {reply.restored})")))
    try:
        # The schema locally first (a typo is shown without a daemon), with relative paths resolved against the
        # file's directory. What the paths hold is for the daemon to check, in the same order and with the
        # same words as for an inbox file: its allowed roots before anything reads them.
        # Another trainer's config is imported here first (engine/importers/): its paths are this machine's.
        header, cfg = local_import(Path(args.job))
        if cfg is None:
            cfg = load_job(args.job, check_paths=False)
    except JobInvalid as e:
        return fail(args.json, "invalid_job", f"invalid job: {e}", 65)
    data = call(args, p.Submit(name=Path(args.job).name, text=header + dump_job(cfg),
                               from_mirror=args.from_mirror or None))
    reply = p.SubmitReply.model_validate(data)
    if reply.same_name and not args.json:
        others = render.term_safe(", ".join(f"{j.id} ({j.state})" for j in reply.same_name))
        print(f"lorad: note: {cfg.name!r} is also the name of {others}; refer to these jobs by id",
              file=sys.stderr)
    return out(args, data, lambda d: print(render.term_safe(
        reply.job + (f" (from the mirror: {reply.restored})" if reply.restored else ""))))


def local_import(path: Path, check_paths: bool = False):
    """(the import header to keep, the job) of another trainer's config or of a job `lorad import` wrote; ("",
    None) for a plain lorad job, which load_job reads."""
    from engine.config.job import parse_job
    from engine.config.reading import MAX_JOB_FILE_BYTES, decode_job_bytes, read_yaml
    from engine.errors import JobInvalid
    from engine.importers import detect, header_text, import_text, is_foreign_name

    try:
        data = path.read_bytes()[: MAX_JOB_FILE_BYTES + 1]
    except OSError:
        return "", None  # load_job says why, in its words
    if len(data) > MAX_JOB_FILE_BYTES:
        return "", None
    text = decode_job_bytes(data, path.name)
    if detect(text, path.name) is not None or is_foreign_name(path.name):  # an unknown .toml: refused naming formats
        text = import_text(text, path.name, path.parent.resolve()).text
    header = header_text(text)
    if not header:
        return "", None
    try:
        raw = read_yaml(text, max_aliases=100)
    except ValueError as e:
        raise JobInvalid(f"{path.name}: {e}") from None
    return header, parse_job(raw, path.parent.resolve(), source=path.name, check_paths=check_paths)


def cmd_status(args: argparse.Namespace) -> int:
    data = call(args, p.Status(job=args.job))
    return out(args, data, render.print_detail if args.job else render.print_table)


def cmd_logs(args: argparse.Namespace) -> int:
    req = p.Logs(job=args.job, tail=args.lines)
    while True:
        reply = p.LogsReply.model_validate(call(args, req))
        for ev in reply.lines:
            print(json.dumps(ev) if args.json else render.log_line(ev), flush=True)
        if not args.follow:
            return 0
        if reply.state in FINAL and not reply.lines:
            return 0
        time.sleep(0.5)
        req = p.Logs(job=args.job, offset=reply.offset)


def _action(req_cls):
    def cmd(args: argparse.Namespace) -> int:
        data = call(args, req_cls(job=args.job))
        reply = p.JobActionReply.model_validate(data)
        return out(args, data, lambda d: print(render.term_safe(f"{reply.job}: {reply.message}")))

    return cmd


cmd_pause = _action(p.Pause)
cmd_resume = _action(p.Resume)
cmd_cancel = _action(p.Cancel)
cmd_retry = _action(p.Retry)


def cmd_priority(args: argparse.Namespace) -> int:
    data = call(args, p.SetPriority(job=args.job, priority=args.priority))
    reply = p.PriorityReply.model_validate(data)
    return out(args, data, lambda d: print(render.term_safe(f"{reply.job}: {reply.message}")))


def cmd_power(args: argparse.Namespace) -> int:
    from daemon.power import view

    data = call(args, p.Power(limit_w=args.limit, gpu=args.gpu, clear=args.clear))
    if args.watch and not args.json:
        return view.watch(lambda: render.term_safe_all(call(args, p.Power())), args.interval)
    limit = p.PowerReply.model_validate(data).set
    refused = bool(limit) and not limit.get("ok")
    if refused:
        print(f"lorad: power limit not set: {render.term_safe(limit.get('error'))}", file=sys.stderr)
    out(args, data, lambda d: view.show(render.term_safe_all(d), render.console()))
    return 1 if refused else 0


def cmd_drain(args: argparse.Namespace) -> int:
    data = call(args, p.Drain(on=not args.off))
    return out(args, data, lambda d: print(p.DrainReply.model_validate(d).message))


def cmd_web_url(args: argparse.Namespace) -> int:
    data = call(args, p.WebUrl())
    return out(args, data, lambda d: print(p.WebUrlReply.model_validate(d).url))


def cmd_gpu(args: argparse.Namespace) -> int:
    data = call(args, p.Gpu(clear=getattr(args, "gpu", None)))

    def human(d: dict[str, Any]) -> None:
        reply = p.GpuReply.model_validate(d)
        if reply.message:
            print(reply.message)
        for g in reply.gpus:
            print(render.gpu_line(g))
        if not reply.gpus:
            print("no GPU health readings (power.telemetry.backend off, gpu_health disabled, or no GPU)")

    return out(args, data, human)
