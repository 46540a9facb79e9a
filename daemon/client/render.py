"""How the CLI shows the daemon's replies to a person: the queue table, one job in detail, stuck and rejected
inbox files, log lines. Plain functions of the reply's data, read through its reply model (daemon/protocol.py);
its JSON form is printed as is with --json.

Every string in a reply may come from a job file, a trainer's events, a mirror key or a remote: each goes
through `term_safe` before it reaches the terminal (an ESC sequence could retitle the window, hide lines or
forge output), as the dashboard escapes it for HTML.

Only rich and the standard library: the client verbs import this on machines without the training stack.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.supervisor.disk_wait import waiting_note
from daemon.supervisor.exit_policy import HELD_FOR_REVIEW as HELD  # a held job's stage
from daemon.system.eta import fmt_eta

COLUMNS = ("ID", "NAME", "STATE", "PRIO", "STEP", "LOSS", "VAL", "S/STEP", "ETA", "NOTE")


def _escaped(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def term_safe(text: Any) -> str:
    """`text` as plain characters: every control character (ESC, BEL, CR, newlines, C1, DEL) and every invisible
    format character (bidi overrides, zero widths) written out as its escape (\\x1b), never sent raw."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else _escaped(c) for c in s)


def term_safe_all(data: Any) -> Any:
    """A reply's data with every string in it (keys too) through term_safe; numbers and the rest as they are: for
    views that print a reply's fields as they find them (`lorad power`'s GPU names, job ids, UPS errors)."""
    if isinstance(data, str):
        return term_safe(data)
    if isinstance(data, dict):
        return {term_safe_all(k): term_safe_all(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [term_safe_all(v) for v in data]
    return data


def num(v: Any, fmt: str = "{}") -> str:
    """A value as the tables show it: `-` when there is none."""
    return "-" if v is None else fmt.format(v)


def when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def shorten(text: str, width: int) -> str:
    """One line of at most `width` characters, cut at a word boundary with an ellipsis."""
    text = term_safe(" ".join(str(text).split()))
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    if text[width - 1] != " " and cut.rfind(" ") >= width // 2:  # the cut is inside a word: drop that word
        cut = cut[: cut.rfind(" ")]
    return cut.rstrip(" ,;:.-(") + "…"


def console(**kw: Any):
    """A rich Console whose closed stdout raises BrokenPipeError for main() (rich's own answer is exit 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Console(**kw)


def _queue(data: dict[str, Any] | p.QueueReply) -> p.QueueReply:
    return data if isinstance(data, p.QueueReply) else p.QueueReply.model_validate(data)


def print_table(data: dict[str, Any] | p.QueueReply) -> None:
    """The queue, one line per job in the daemon's order (running, then the queue in the order it will run, ...):
    NOTE (why it failed, what was asked) is cut to the room left, at a word."""
    from rich.table import Table
    from rich.text import Text

    q = _queue(data)
    rows = []
    for j in q.jobs:
        note = j.requested and f"{j.requested} requested" or (j.last_error or "")
        if j.state == "waiting":
            note = f"waiting: {waiting_note(j.wait_bytes)}"
        if j.state == "paused" and j.stage == HELD:  # after its caption stage (data.captioner.hold_for_review)
            note = f"{j.stage}: edit, then lorad resume {j.id}"
        if j.gpu_note and j.state in ("queued", "running"):  # gpu_memory_policy: what was decided
            note = f"{note}; {j.gpu_note}" if note else j.gpu_note
        if j.state in ("succeeded", "cancelled"):
            note = ""
        if j.mirror is not None and (m := mirror_note(j.state, j.mirror)):
            note = f"{note}; {m}" if note else m
        rows.append([j.id, j.name, "done, mirror behind" if j.state == "succeeded" and j.mirror is not None
                     and j.mirror.mirror is not None and not j.mirror.caught_up else j.state, str(j.priority),
                     j.stage if j.stage and j.state == "running" else f"{j.step}/{j.total}",  # the caption stage's
                     f"{j.loss:.4f}" if j.loss is not None else "-",
                     f"{j.val_loss:.4f}" if j.val_loss is not None else "-",
                     f"{j.s_per_step:.3f}" if j.s_per_step else "-",
                     fmt_eta(j.eta_s) if j.state == "running" else "-", note])
    rows = [[term_safe(v) for v in r[:-1]] + [r[-1]] for r in rows]  # the note is escaped by shorten
    columns, val = COLUMNS, COLUMNS.index("VAL")
    if all(r[val] == "-" for r in rows):  # no job validates (data.validation): no VAL column taking the note's room
        columns = tuple(c for c in COLUMNS if c != "VAL")
        rows = [r[:val] + r[val + 1:] for r in rows]
    width = shutil.get_terminal_size((120, 20)).columns
    fixed = sum(max([len(col), *(len(r[i]) for r in rows)]) + 2 for i, col in enumerate(columns[:-1]))
    room = max(width - fixed, 16)
    t = Table(box=None, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="right" if col in ("PRIO", "STEP", "LOSS", "VAL", "S/STEP", "ETA") else "left",
                     no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*(Text(v) for v in r[:-1]), Text(shorten(r[-1], room)))  # Text: an error's [..] is not markup
    c = console(width=max(width, fixed + room))
    if not q.jobs:
        c.print("no jobs (drop a job file into the inbox, or: lorad submit FILE)")
    else:
        with c.capture() as cap:
            c.print(t)
        # rich pads every cell to its column's width; a line ends at its last character (styles kept).
        print(re.sub(r" +((?:\x1b\[[0-9;]*m)*)$", r"\1", cap.get(), flags=re.M), end="")
    if q.draining:
        c.print("[bold]draining[/]: no job starts until `lorad drain --off`")
    for n in q.notes:
        c.print(f"note: {term_safe(n)}", markup=False, highlight=False)
    print_gpus(q)
    print_stuck(q, width)
    print_rejections(q, width)


def gpu_line(g: dict[str, Any]) -> str:
    """One GPU's health: state (and why), slowdown, and the VRAM other programs hold."""
    head = f"GPU {g['gpu']}: {g['state']}"
    if g["state"] != "ok":
        head += f" ({g.get('reason')})" + ("; `lorad gpu clear " + str(g["gpu"]) + "` to take it back"
                                           if g["state"] == "held" else "; taken back when it reads healthy")
    if g.get("slowdown"):
        head += f"; {' and '.join(g['slowdown'])} slowdown"
    if g.get("foreign_gb"):
        head += (f"; other programs hold {g['foreign_gb']:.1f} of {g['memory_total_gb']:.1f} GiB "
                 f"({g.get('foreign_processes', 0)} process(es))")
    return head


def print_gpus(data: dict[str, Any] | p.QueueReply) -> None:
    """`lorad status`: GPUs that are out, slowing down or shared with other programs (healthy idle ones: silent)."""
    for g in _queue(data).gpus:
        if g.get("state") != "ok" or g.get("slowdown") or g.get("foreign_gb"):
            print(term_safe(gpu_line(g)))


def print_stuck(data: dict[str, Any] | p.QueueReply, width: int) -> None:
    """`lorad status`: inbox files the daemon could neither accept nor reject yet (disk full, ...), and why."""
    q = _queue(data)
    stuck = q.inbox_stuck
    if not stuck:
        return
    every = q.inbox_retry_s
    print(f"inbox stuck: {len(stuck)} file(s) not taken yet, kept safe and retried"
          + (f" every {every:g} s:" if every else ":"))
    name_w = max(len(term_safe(s["file"])) for s in stuck)
    for s in stuck:
        head = f"  {term_safe(s['file']):<{name_w}}  since {when(s['since'])}  "
        print(head + shorten(s["error"], max(width - len(head), 30)))
    print(f"  (waiting in {term_safe(Path(stuck[0]['path']).parent)}/; free the space or fix the cause and it "
          "goes through)")


def print_rejections(data: dict[str, Any] | p.QueueReply, width: int) -> None:
    """`lorad status`: the newest inbox files the daemon rejected, one line each: file, when, why."""
    q = _queue(data)
    rej = q.rejected
    if not rej:
        return
    hours = round(q.rejected_within_s / 3600)
    print(f"rejected inbox files (last {hours} h, newest first):")
    name_w = max(len(term_safe(r["file"])) for r in rej)
    for r in rej:
        head = f"  {term_safe(r['file']):<{name_w}}  {when(r['at'])}  "
        print(head + shorten(r["reason"], max(width - len(head), 30)))
    more = q.rejected_total - len(rej)
    print(f"  ({f'… and {more} more; ' if more > 0 else ''}"
          f"each reason in full: {term_safe(q.rejected_dir)}/NAME.error.txt)")


def print_detail(data: dict[str, Any] | p.JobStatusReply) -> None:
    d = data if isinstance(data, p.JobStatusReply) else p.JobStatusReply.model_validate(data)
    j = d.job
    rows = [("id", j.id), ("name", j.name), ("state", j.state), ("priority", j.priority),
            ("step", f"{j.step}/{j.total}" + (f" ({j.stage} images)" if j.stage and j.state == "running" else "")),
            ("loss", num(j.loss, "{:.4f}")),
            ("validation loss", f"{j.val_loss:.4f} (step {j.val_step})" if j.val_loss is not None else "-"),
            ("s/step", num(j.s_per_step, "{:.3f}")),
            ("ETA", fmt_eta(j.eta_s) if j.state == "running" else "-"),
            ("last checkpoint", j.last_checkpoint or "-"), ("output", j.output or "-"),
            ("workdir", j.workdir), ("submitted", when(j.submitted_at)), ("source", num(j.source)),
            ("crashes in a row", j.retries)]
    if j.imported_from:
        rows.append(("imported", f"imported from {j.imported_from}; {len(j.not_carried_over)} settings not carried "
                                 "over (lorad logs ID: the imported event)"))
    if j.not_before and j.not_before > time.time() and j.state == "queued":
        rows.append(("next try", when(j.not_before)))
    if j.state == "waiting":
        rows.append(("waiting", f"{waiting_note(j.wait_bytes)}; retried when the space is free"))
    if j.state == "paused" and j.stage == HELD:
        rows.append(("held", f"{j.stage}: edit them on the dashboard or with `lorad caption {j.id} IMAGE TEXT` "
                             f"(`lorad captions {j.id} --to DIR` writes them out), then `lorad resume {j.id}`"))
    if j.state == "waiting_for_gpu":
        rows.append(("waiting for GPU", f"{j.last_error or 'its GPU is out'}; queued again once a GPU is healthy"))
    if j.gpu_note:
        rows.append(("GPU memory", j.gpu_note))
    if j.requested:
        rows.append(("requested", j.requested))
    if j.last_error:
        rows.append(("last error", j.last_error))
    if j.memory_plan:
        rows.append(("memory plan", j.memory_plan))
    for ev in (e for e in j.events if e.get("kind") == "oom_replan"):
        oom = ev.get("data") or {}
        rows.append(("out-of-memory", f"step {oom.get('step')} ({oom.get('phase')}): {oom.get('before')} → "
                                      f"{oom.get('lever')}"))
    for ev in j.events:  # a block type that fell back to eager this job (engine/frozen_base/compiling.py)
        if ev.get("kind") == "compile_fallback":
            data = ev.get("data") or {}
            rows.append(("compile", f"eager: {data.get('block')} ({data.get('reason')})"))
    if j.mirror is not None:
        rows.append(("mirror", mirror_note(j.state, j.mirror, detail=True) or ("caught up" if j.mirror.mirror else "-")))
        if j.mirror.hub_repo:
            rows.append(("hub", f"{j.mirror.hub_repo}: " + ("pushed" if j.mirror.hub_pushed else "not yet")))
    if j.samples:
        rows.append((f"samples (step {j.samples_step})", j.samples[0]))
        rows += [("", path) for path in j.samples[1:]]
    if d.power:
        from daemon.power.view import job_lines

        rows += [("energy", line) for line in job_lines(d.power)]
    for k, v in rows:
        print(f"{term_safe(k):>17}: {term_safe(v)}")
    print("attempts:")
    for a in j.attempts:
        end = when(a.ended_at) if a.ended_at else "running"
        print(f"  #{a.n:<3} {when(a.started_at)} → {end}  pid {num(a.pid)}  exit {num(a.exit_code)}  "
              f"steps {a.start_step}→{a.end_step if a.end_step is not None else '…'}"
              + (f"  error: {term_safe(a.error)}" if a.error else ""))


def mirror_note(state: str, m: p.MirrorLag, detail: bool = False) -> str:
    """'done, mirror behind by 4 steps (31 s): ...error' and the like; '' when it is caught up and well."""
    parts = []
    if m.fetching is not None:  # lorad submit --from: the download, before the job is queued
        parts.append(f"fetching from {m.mirror}/{m.key}: {m.fetching}")
    elif m.mirror is None:  # only a hub push
        pass
    elif m.behind_steps:
        lead = "done, mirror" if state == "succeeded" else "mirror"
        parts.append(f"{lead} behind by {m.behind_steps} steps ({m.behind_s or 0:.0f} s)")
    elif state == "succeeded" and not m.output_mirrored:
        parts.append("done, mirror behind by the output")
    if m.last_error:
        parts.append(f"mirror error: {m.last_error}")
    if m.hub_error:
        parts.append(f"hub push to {m.hub_repo} failed, retried: {m.hub_error}")
    if detail and m.mirror is not None and m.fetching is None:
        where = f"{m.mirror}/{m.key}" if m.key else (m.mirror or "-")
        last = f"last upload {when(m.last_upload_at)}" if m.last_upload_at else "nothing uploaded yet"
        parts.insert(0, f"{where}, remote step {num(m.remote_step)}, {last}")
    return "; ".join(parts)


def compact(v: Any) -> Any:
    """A float as a person reads it (4 significant digits: lr=0.003, not 0.0029999119841746698); the
    events file keeps the full value."""
    return f"{v:.4g}" if isinstance(v, float) else v


def log_line(ev: dict[str, Any]) -> str:
    skip = {"ts", "level", "event", "job"}
    rest = " ".join(f"{k}={compact(v)}" for k, v in ev.items() if k not in skip)
    return term_safe(f"{str(ev.get('ts', ''))[:19]} {ev.get('level', ''):7} {ev.get('event', '')} {rest}".rstrip())
