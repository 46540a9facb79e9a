"""The `lorad` command line. One function per verb; `main()` dispatches.

`run` trains in the foreground; `serve` is the daemon; every other verb is one
typed request over the daemon's socket (daemon/protocol.py), printed as a
table or, with --json, as the reply's JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.lock import AlreadyRunning, TrainerLock
from daemon.paths import default_home, job_dir
from engine.events import read_events

EXIT_USAGE = 2  # argparse's own: a mistake in the arguments
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the daemon is not running
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a reader that stopped early
FINAL = {"succeeded", "failed", "cancelled"}


# ================================================================ verbs without the daemon
def _local_job(args: argparse.Namespace):
    """(job config, its workdir under --home) for the verbs that work without a daemon; None after saying why."""
    from engine.config import JobInvalid, load_job

    try:
        cfg = load_job(args.job)
    except JobInvalid as e:
        print(f"lorad: invalid job: {e}", file=sys.stderr)
        return None
    return cfg, job_dir(Path(args.home) if args.home else default_home(), cfg.name)


def cmd_run(args: argparse.Namespace) -> int:
    """Train a job in the foreground (no daemon). Running it again resumes."""
    from engine.config import dump_job
    from engine.fsio import RealFs, ensure_dir_durable, write_file_durable
    from engine.run import train
    from engine.stop import EXIT_INVALID, StopFlag

    if (job := _local_job(args)) is None:
        return EXIT_INVALID
    cfg, workdir = job
    fs = RealFs()
    ensure_dir_durable(fs, workdir)
    # The daemon's trainers hold the same lock: one trainer per job, whoever started it.
    lock = TrainerLock(workdir, cfg.name)
    try:
        lock.acquire()
    except AlreadyRunning as e:
        print(f"lorad: {e}", file=sys.stderr)
        return 1
    try:
        write_file_durable(fs, workdir / "job.yaml", dump_job(cfg).encode())
        stop = StopFlag()
        stop.install()
        print(f"lorad: job {cfg.name} in {workdir}", file=sys.stderr)
        events = workdir / "events.jsonl"  # every run's events: this run's are the ones after `seen` bytes
        seen = events.stat().st_size if events.exists() else 0
        code = train(cfg, workdir, progress="none" if args.quiet else "bar", fs=fs, stop=stop)
        for line in _run_summary(read_events(workdir, seen), code):
            print(f"lorad: {line}", file=sys.stderr)
        return code
    finally:
        lock.release()


def _run_summary(events: list[dict[str, Any]], code: int) -> list[str]:
    """What `lorad run` says after training, from this run's events: where it stopped or put the adapter.

    (Where it resumed is said by the engine itself, when it resumes.)
    """
    from engine.checkpoint import step_dir_name
    from engine.stop import EXIT_OK, EXIT_STOPPED

    last = {e.get("event"): e for e in events}
    stopped, done = last.get("stopped"), last.get("done")
    lines = []
    if code == EXIT_STOPPED and stopped is not None:
        ckpt = stopped.get("checkpoint")
        if ckpt:
            lines.append(f"stopped at step {stopped.get('step')}; checkpoint {step_dir_name(ckpt)} is committed — "
                         "run the same command to resume")
        else:
            lines.append(f"stopped at step {stopped.get('step')}, before the first checkpoint — "
                         "run the same command to start again")
    if code == EXIT_OK and done is not None:
        already = " (it had already finished: nothing trained)" if done.get("already") else ""
        lines.append(f"done — adapter in {done.get('output')}{already}")
    return lines


def cmd_cache(args: argparse.Namespace) -> int:
    """Encode a Flux job's latents and text embeddings now (training does it too, reusing what is cached)."""
    from engine.cache import cache_job
    from engine.stop import EXIT_INVALID

    if (job := _local_job(args)) is None:
        return EXIT_INVALID
    cfg, workdir = job
    print(f"lorad: cache of job {cfg.name} in {workdir / 'cache'}", file=sys.stderr)
    return cache_job(cfg, workdir, progress="none" if args.quiet else "bar")


def cmd_serve(args: argparse.Namespace) -> int:
    from daemon.service import serve

    return serve(Path(args.home) if args.home else default_home(), args.config)


def cmd_install_service(args: argparse.Namespace) -> int:
    """Install systemd/lorad.service with ExecStart pointing at this lorad, create the group, enable it."""
    src = Path(__file__).resolve().parents[1] / "systemd" / "lorad.service"
    if not src.is_file():
        print(f"lorad: {src} not found (install-service needs the source checkout; see README 'The service')",
              file=sys.stderr)
        return 1
    exe = shutil.which("lorad") or str(Path(sys.executable).with_name("lorad"))
    unit = src.read_text().replace("/usr/local/bin/lorad", exe)
    dest = Path(args.dest)
    if args.dry_run:
        print(unit, end="")
        return 0
    if os.geteuid() != 0:
        print("lorad: install-service needs root (sudo lorad install-service)", file=sys.stderr)
        return 1
    dest.write_text(unit)
    print(f"wrote {dest}")
    conf = Path("/etc/lorad/daemon.yaml")
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("# lorad daemon config; every key and its default: configs/daemon.yaml in the source tree\n"
                        "socket_group: lorad\nallowed_roots: [\"{home}\", /srv, /data]\n")
        print(f"wrote {conf} (socket_group: lorad; add your data directories to allowed_roots)")
    steps = [["getent", "group", "lorad"]]
    if subprocess.run(steps[0], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", "--system", "lorad"], check=True)
        print("created group lorad (add users with: usermod -aG lorad USER)")
    if not args.no_enable:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", "--now", "lorad"], check=True)
        print("enabled and started lorad.service (journalctl -u lorad -f)")
    return 0


# ================================================================ verbs through the socket
def _call(args: argparse.Namespace, req: p.BaseModel) -> dict[str, Any]:
    from daemon.client import Client, find_socket

    return Client(find_socket(args.home, args.socket)).call(req)


def _fail(as_json: bool, code: str, message: str, status: int) -> int:
    """An error: one line on stderr and, with --json, also {"ok": false, "error", "message", "exit"} on stdout."""
    if as_json:
        print(json.dumps({"ok": False, "error": code, "message": message, "exit": status}))
    print(f"lorad: {message}", file=sys.stderr)
    return status


def _out(args: argparse.Namespace, data: dict[str, Any], human) -> int:
    if args.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        human(data)
    return 0


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _num(v: Any, fmt: str = "{}") -> str:
    """A value as the tables show it: `-` when there is none."""
    return "-" if v is None else fmt.format(v)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cmd_ping(args: argparse.Namespace) -> int:
    data = _call(args, p.Ping())
    return _out(args, data, lambda d: print(f"lorad is up: pid {d['pid']}, home {d['home']}, "
                                            f"{d['running']} running, up {d['uptime_s']} s"
                                            + (", draining" if d["draining"] else "")))


def cmd_submit(args: argparse.Namespace) -> int:
    from engine.config import JobInvalid, dump_job, load_job

    try:
        cfg = load_job(args.job)  # locally first: the mistake is shown here, not in rejected/
    except JobInvalid as e:
        return _fail(args.json, "invalid_job", f"invalid job: {e}", 65)
    data = _call(args, p.Submit(name=Path(args.job).name, text=dump_job(cfg)))
    if data.get("same_name") and not args.json:
        others = ", ".join(f"{j['id']} ({j['state']})" for j in data["same_name"])
        print(f"lorad: note: {cfg.name!r} is also the name of {others}; refer to these jobs by id",
              file=sys.stderr)
    return _out(args, data, lambda d: print(d["job"]))


def _console(**kw: Any):
    """A rich Console whose closed stdout raises BrokenPipeError for main() (rich's own answer is exit 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Console(**kw)


COLUMNS = ("ID", "NAME", "STATE", "STEP", "LOSS", "S/STEP", "ETA", "NOTE")


def _print_table(data: dict[str, Any]) -> None:
    """The queue, one line per job: NOTE (why it failed, what was asked) is cut to the room left, at a word."""
    from rich.table import Table
    from rich.text import Text

    rows = []
    for j in data["jobs"]:
        note = j["requested"] and f"{j['requested']} requested" or (j["last_error"] or "")
        if j["state"] in ("succeeded", "cancelled"):
            note = ""
        rows.append([j["id"], j["name"], j["state"], f"{j['step']}/{j['total']}",
                     f"{j['loss']:.4f}" if j["loss"] is not None else "-",
                     f"{j['s_per_step']:.3f}" if j["s_per_step"] else "-",
                     _fmt_eta(j["eta_s"]) if j["state"] == "running" else "-", note])
    width = shutil.get_terminal_size((120, 20)).columns
    fixed = sum(max([len(col), *(len(r[i]) for r in rows)]) + 2 for i, col in enumerate(COLUMNS[:-1]))
    room = max(width - fixed, 16)
    t = Table(box=None, pad_edge=False)
    for col in COLUMNS:
        t.add_column(col, justify="right" if col in ("STEP", "LOSS", "S/STEP", "ETA") else "left",
                     no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*(Text(v) for v in r[:-1]), Text(_shorten(r[-1], room)))  # Text: an error's [..] is not markup
    c = _console(width=max(width, fixed + room))
    if not data["jobs"]:
        c.print("no jobs (drop a job file into the inbox, or: lorad submit FILE)")
    else:
        with c.capture() as cap:
            c.print(t)
        # rich pads every cell to its column's width; a line ends at its last character (styles kept).
        print(re.sub(r" +((?:\x1b\[[0-9;]*m)*)$", r"\1", cap.get(), flags=re.M), end="")
    if data.get("draining"):
        c.print("[bold]draining[/]: no job starts until `lorad drain --off`")
    for n in data.get("notes", []):
        c.print(f"note: {n}", markup=False, highlight=False)
    _print_stuck(data, width)
    _print_rejections(data, width)


def _print_stuck(data: dict[str, Any], width: int) -> None:
    """`lorad status`: inbox files the daemon could neither accept nor reject yet (disk full, ...), and why."""
    stuck = data.get("inbox_stuck") or []
    if not stuck:
        return
    every = data.get("inbox_retry_s")
    print(f"inbox stuck: {len(stuck)} file(s) not taken yet, kept safe and retried"
          + (f" every {every:g} s:" if every else ":"))
    name_w = max(len(s["file"]) for s in stuck)
    for s in stuck:
        head = f"  {s['file']:<{name_w}}  since {_when(s['since'])}  "
        print(head + _shorten(s["error"], max(width - len(head), 30)))
    print(f"  (waiting in {Path(stuck[0]['path']).parent}/; free the space or fix the cause and it goes through)")


def _shorten(text: str, width: int) -> str:
    """One line of at most `width` characters, cut at a word boundary with an ellipsis."""
    text = " ".join(str(text).split())
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    if text[width - 1] != " " and cut.rfind(" ") >= width // 2:  # the cut is inside a word: drop that word
        cut = cut[: cut.rfind(" ")]
    return cut.rstrip(" ,;:.-(") + "…"


def _print_rejections(data: dict[str, Any], width: int) -> None:
    """`lorad status`: the newest inbox files the daemon rejected, one line each: file, when, why."""
    rej = data.get("rejected") or []
    if not rej:
        return
    hours = round(data.get("rejected_within_s", 86400) / 3600)
    print(f"rejected inbox files (last {hours} h, newest first):")
    name_w = max(len(r["file"]) for r in rej)
    for r in rej:
        head = f"  {r['file']:<{name_w}}  {_when(r['at'])}  "
        print(head + _shorten(r["reason"], max(width - len(head), 30)))
    more = data.get("rejected_total", len(rej)) - len(rej)
    print(f"  ({f'… and {more} more; ' if more > 0 else ''}"
          f"each reason in full: {data.get('rejected_dir', 'rejected')}/NAME.error.txt)")


def _print_detail(data: dict[str, Any]) -> None:
    j = data["job"]
    rows = [("id", j["id"]), ("name", j["name"]), ("state", j["state"]), ("priority", j["priority"]),
            ("step", f"{j['step']}/{j['total']}"), ("loss", _num(j["loss"], "{:.4f}")),
            ("s/step", _num(j["s_per_step"], "{:.3f}")),
            ("ETA", _fmt_eta(j["eta_s"]) if j["state"] == "running" else "-"),
            ("last checkpoint", j["last_checkpoint"] or "-"), ("output", j["output"] or "-"),
            ("workdir", j["workdir"]), ("submitted", _when(j["submitted_at"])), ("source", _num(j["source"])),
            ("crashes in a row", j["retries"])]
    if j["not_before"] and j["not_before"] > time.time() and j["state"] == "queued":
        rows.append(("next try", _when(j["not_before"])))
    if j["requested"]:
        rows.append(("requested", j["requested"]))
    if j["last_error"]:
        rows.append(("last error", j["last_error"]))
    if j.get("samples"):
        rows.append((f"samples (step {j['samples_step']})", j["samples"][0]))
        rows += [("", path) for path in j["samples"][1:]]
    if data.get("power"):
        from daemon.power.view import job_lines

        rows += [("energy", line) for line in job_lines(data["power"])]
    for k, v in rows:
        print(f"{k:>17}: {v}")
    print("attempts:")
    for a in j["attempts"]:
        end = _when(a["ended_at"]) if a["ended_at"] else "running"
        print(f"  #{a['n']:<3} {_when(a['started_at'])} → {end}  pid {_num(a['pid'])}  exit {_num(a['exit_code'])}  "
              f"steps {a['start_step']}→{a['end_step'] if a['end_step'] is not None else '…'}"
              + (f"  error: {a['error']}" if a["error"] else ""))


def cmd_status(args: argparse.Namespace) -> int:
    data = _call(args, p.Status(job=args.job))
    return _out(args, data, _print_detail if args.job else _print_table)


def _log_line(ev: dict[str, Any]) -> str:
    skip = {"ts", "level", "event", "job"}
    rest = " ".join(f"{k}={v}" for k, v in ev.items() if k not in skip)
    return f"{ev.get('ts', '')[:19]} {ev.get('level', ''):7} {ev.get('event', '')} {rest}".rstrip()


def cmd_logs(args: argparse.Namespace) -> int:
    data = _call(args, p.Logs(job=args.job, tail=args.lines))
    while True:
        for ev in data["lines"]:
            print(json.dumps(ev) if args.json else _log_line(ev), flush=True)
        if not args.follow:
            return 0
        if data["state"] in FINAL and not data["lines"]:
            return 0
        time.sleep(0.5)
        data = _call(args, p.Logs(job=args.job, offset=data["offset"]))


def _action(req_cls):
    def cmd(args: argparse.Namespace) -> int:
        data = _call(args, req_cls(job=args.job))
        return _out(args, data, lambda d: print(f"{d['job']}: {d['message']}"))

    return cmd


cmd_pause = _action(p.Pause)
cmd_resume = _action(p.Resume)
cmd_cancel = _action(p.Cancel)


def cmd_priority(args: argparse.Namespace) -> int:
    data = _call(args, p.SetPriority(job=args.job, priority=args.priority))
    return _out(args, data, lambda d: print(f"{d['job']}: {d['message']}"))


def cmd_power(args: argparse.Namespace) -> int:
    from daemon.power import view

    data = _call(args, p.Power(limit_w=args.limit, gpu=args.gpu, clear=args.clear))
    if args.watch and not args.json:
        return view.watch(lambda: _call(args, p.Power()), args.interval)
    refused = bool(data.get("set")) and not data["set"].get("ok")
    if refused:
        print(f"lorad: power limit not set: {data['set'].get('error')}", file=sys.stderr)
    _out(args, data, lambda d: view.show(d, _console()))
    return 1 if refused else 0


def cmd_drain(args: argparse.Namespace) -> int:
    data = _call(args, p.Drain(on=not args.off))
    return _out(args, data, lambda d: print(d["message"]))


def cmd_web_url(args: argparse.Namespace) -> int:
    data = _call(args, p.WebUrl())
    return _out(args, data, lambda d: print(d["url"]))


# ================================================================ parser
class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line on stderr and exit 2 (argparse's own code), never a traceback."""

    def error(self, message: str):
        if message.startswith("argument ") and ": " in message:
            line = message[len("argument "):]  # "priority: must be an integer between -1000 and 1000, got 5000"
        else:
            line = f"{message} (see: {self.prog} --help)"
        raise UsageError(line)


class UsageError(Exception):
    pass


def _limits(model: type[p.BaseModel], field: str) -> tuple[Any, Any]:
    """(lowest, highest) a protocol field accepts: the CLI checks the same bounds the daemon enforces."""
    lo = hi = None
    for m in model.model_fields[field].metadata:
        for attr in ("ge", "min_length"):
            lo = getattr(m, attr, None) if getattr(m, attr, None) is not None else lo
        for attr in ("le", "max_length"):
            hi = getattr(m, attr, None) if getattr(m, attr, None) is not None else hi
    return lo, hi


def _int_in(model: type[p.BaseModel], field: str):
    lo, hi = _limits(model, field)

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer between {lo} and {hi}, got {text!r}")
        return v

    return parse


def _watts(text: str) -> float:
    lo, hi = _limits(p.Power, "limit_w")
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and lo <= v <= hi):
        raise argparse.ArgumentTypeError(f"must be a number of watts between {lo} and {hi}, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return v


def _job_ref(text: str) -> str:
    lo, hi = _limits(p.Logs, "job")
    if not lo <= len(text) <= hi:
        raise argparse.ArgumentTypeError(f"a job id or name is {lo} to {hi} characters")
    return text


def _job_file(text: str) -> str:
    lo, hi = _limits(p.Submit, "name")
    if not lo <= len(Path(text).name) <= hi:
        raise argparse.ArgumentTypeError(f"the file name must be {lo} to {hi} characters")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="lorad", description="Resilient LoRA training service.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    common = _Parser(add_help=False)
    common.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad, /var/lib/lorad under systemd)")
    common.add_argument("--socket", help="the daemon's socket (default: HOME/lorad.sock or /run/lorad/lorad.sock)")
    common.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")

    p_ = sub.add_parser("run", help="train a job in the foreground; run again to resume")
    p_.add_argument("job", help="job YAML file")
    p_.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad)")
    p_.add_argument("--quiet", action="store_true", help="no progress bar")
    p_.set_defaults(fn=cmd_run)

    p_ = sub.add_parser("cache", help="encode a flux job's latents and text embeddings into its cache (idempotent)")
    p_.add_argument("job", help="job YAML file")
    p_.add_argument("--home", help="lorad home directory (default: ~/.local/share/lorad)")
    p_.add_argument("--quiet", action="store_true", help="no progress bar")
    p_.set_defaults(fn=cmd_cache)

    p_ = sub.add_parser("serve", help="run the daemon (inbox, queue, supervised trainers, socket API)")
    p_.add_argument("--home", help="lorad home directory")
    p_.add_argument("--config", help="daemon config YAML (see configs/daemon.yaml)")
    p_.set_defaults(fn=cmd_serve)

    p_ = sub.add_parser("install-service", help="install and enable the systemd unit (root)")
    p_.add_argument("--dest", default="/etc/systemd/system/lorad.service")
    p_.add_argument("--no-enable", action="store_true", help="write the unit, do not enable or start it")
    p_.add_argument("--dry-run", action="store_true", help="print the unit that would be installed")
    p_.set_defaults(fn=cmd_install_service)

    p_ = sub.add_parser("ping", parents=[common], help="is the daemon up?")
    p_.set_defaults(fn=cmd_ping)
    p_ = sub.add_parser("submit", parents=[common], help="validate a job file and queue it; prints the job id")
    p_.add_argument("job", type=_job_file, help="job YAML file")
    p_.set_defaults(fn=cmd_submit)
    p_ = sub.add_parser("status", parents=[common], help="the queue, or one job in detail")
    p_.add_argument("job", nargs="?", type=_job_ref, help="job id (or name)")
    p_.set_defaults(fn=cmd_status)
    p_ = sub.add_parser("logs", parents=[common], help="a job's events")
    p_.add_argument("job", type=_job_ref)
    p_.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p_.add_argument("-n", "--lines", type=_int_in(p.Logs, "tail"), default=50, help="how many of the last events")
    p_.set_defaults(fn=cmd_logs)
    for verb, fn, what in (("pause", cmd_pause, "checkpoint and stop a job (or keep a queued one from starting)"),
                           ("resume", cmd_resume, "queue a paused job again"),
                           ("cancel", cmd_cancel, "stop a job for good (its checkpoints stay)")):
        p_ = sub.add_parser(verb, parents=[common], help=what)
        p_.add_argument("job", type=_job_ref)
        p_.set_defaults(fn=fn)
    p_ = sub.add_parser("priority", parents=[common], help="set a job's priority (higher runs first)")
    p_.add_argument("job", type=_job_ref)
    p_.add_argument("priority", type=_int_in(p.SetPriority, "priority"), help="-1000 to 1000")
    p_.set_defaults(fn=cmd_priority)
    p_ = sub.add_parser("drain", parents=[common], help="checkpoint and stop running jobs; start no new ones")
    p_.add_argument("--off", action="store_true", help="take jobs again")
    p_.set_defaults(fn=cmd_drain)
    p_ = sub.add_parser("power", parents=[common], help="GPU power telemetry, caps and the tuned limit")
    p_.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval seconds")
    p_.add_argument("--interval", type=_seconds, default=1.0)
    p_.add_argument("--limit", type=_watts, metavar="W", help="set a manual power limit in watts (needs root)")
    p_.add_argument("--gpu", type=_int_in(p.Power, "gpu"), metavar="N", help="the GPU for --limit (default: every GPU)")
    p_.add_argument("--clear", action="store_true", help="drop the manual limit")
    p_.set_defaults(fn=cmd_power)
    p_ = sub.add_parser("web-url", parents=[common], help="the dashboard's address, with its token (open it once)")
    p_.set_defaults(fn=cmd_web_url)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # Whoever read our output stopped (`lorad logs | head`): end quietly, as a tool killed by SIGPIPE would.
        # stdout now points at /dev/null so that the interpreter's last flush cannot complain either.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail("--json" in argv, "usage", str(e), EXIT_USAGE)
    from daemon.client import DaemonDown, RequestFailed

    as_json = getattr(args, "json", False)
    try:
        return args.fn(args)
    except DaemonDown as e:
        return _fail(as_json, "unavailable", str(e).removeprefix("lorad: "), EXIT_UNAVAILABLE)
    except RequestFailed as e:
        return _fail(as_json, e.code, e.message, 1)


if __name__ == "__main__":
    sys.exit(main())
