"""The dashboard's HTML: plain functions from data to markup, no template engine, no third-party CSS or JS.

Every value from a job file, a log or the store goes through `e()` (html.escape).
The one script (LIVE_JS, ours) refreshes the page's `#live` part every poll_s
seconds while the tab is visible; everything else works without it. Enlarging
a sample image is CSS only (`:target`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from daemon.system.eta import fmt_eta

FINAL = {"succeeded", "failed", "cancelled"}

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:18px;align-items:center}
header a{color:#cfd8ff;text-decoration:none}header b{margin-right:12px}
main{padding:12px 16px;max-width:1400px}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{padding:4px 8px;border-bottom:1px solid #e3e6ea;text-align:left;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.note{white-space:normal;color:#8a3b12;max-width:420px}
table.summary{width:auto;min-width:420px}td.path{white-space:normal;word-break:break-all}
.bar{width:140px;height:10px;background:#e3e6ea;border-radius:5px;overflow:hidden;display:inline-block}
.bar i{display:block;height:100%;background:#3b6fe0}
.st{padding:1px 7px;border-radius:9px;font-size:12px;background:#e3e6ea}
.st-running{background:#d6f5d6}.st-failed{background:#ffd9d4}.st-succeeded{background:#d4e7ff}
.st-paused,.st-interrupted{background:#fff1c2}.st-cancelled{background:#eee;color:#777}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(480px,1fr));gap:10px}
img.thumb,video.thumb{height:64px;margin-right:4px}
svg.chart{width:100%;background:#fff;border:1px solid #e3e6ea}
svg .frame{fill:none;stroke:#c9ced6}svg .grid{stroke:#eef0f3}svg .tick{font-size:10px;fill:#667}
svg .ct{font-size:12px;font-weight:600;fill:#333}svg .empty{fill:#999}
svg .line{fill:none;stroke-width:1.5}.s0{stroke:#3b6fe0;fill:#3b6fe0}.s1{stroke:#e0673b;fill:#e0673b}
.s2{stroke:#2a9d5b;fill:#2a9d5b}svg .legend{font-size:11px;stroke:none}
.grid-samples td{vertical-align:top}.grid-samples img,.grid-samples video{width:128px;height:128px;object-fit:cover}
.lightbox{display:none;position:fixed;inset:0;background:rgba(0,0,0,.85);align-items:center;justify-content:center}
.lightbox:target{display:flex}.lightbox img,.lightbox video{max-width:92vw;max-height:92vh}
.actions form{display:inline-block;margin-right:8px}
.said{background:#fff7d6;padding:6px 10px;border:1px solid #ecd98b;margin-bottom:8px}
.err{color:#b3261e}.bad{background:#ffe9e6}
pre.yaml{background:#fff;border:1px solid #e3e6ea;padding:0;margin:0}
pre.yaml span{display:block;padding:0 8px;white-space:pre-wrap;word-break:break-all}pre.yaml .lineno{color:#99a;display:inline-block;width:3em}
pre.yaml .why{display:inline;color:#b3261e;font-weight:600;margin-left:2em}
textarea{width:100%;height:320px;font:12px monospace}
section{margin:14px 0}h2{font-size:16px;margin:8px 0}
"""

# Ours: refresh the #live part in place; wait while the tab is hidden or a field in it is being edited; keep
# going after a failed fetch.
LIVE_JS = """
(function(){var el=document.getElementById('live');if(!el)return;var ms=+el.dataset.poll||2000;
function tick(){var a=document.activeElement;
if(document.hidden||(a&&a.tagName==='INPUT'&&el.contains(a))){setTimeout(tick,ms);return}
var u=new URL(location.href);u.searchParams.set('live','1');u.searchParams.delete('said');
fetch(u,{credentials:'same-origin'}).then(function(r){return r.ok?r.text():null})
.then(function(t){if(t!==null){el.innerHTML=t;el.dataset.refreshed=String(Date.now())}})
.catch(function(){}).then(function(){setTimeout(tick,ms)})}
setTimeout(tick,ms)})();
"""


def e(v: Any) -> str:
    return escape("" if v is None else str(v))


def num(v: Any, f: str = "{:.4g}") -> str:
    return "-" if v is None else f.format(v)


def when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def state_badge(state: str) -> str:
    return f'<span class="st st-{e(state)}">{e(state)}</span>'


def progress(step: int, total: int) -> str:
    pct = 0.0 if not total else max(0.0, min(100.0, 100.0 * step / total))
    return f'<span class="bar" title="{pct:.0f}%"><i style="width:{pct:.1f}%"></i></span>'


def layout(title: str, body: str, poll_s: float | None = None, said: str | None = None) -> str:
    notice = f'<div class="said">{e(said)}</div>' if said else ""
    script = f"<script>{LIVE_JS}</script>" if poll_s else ""
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content='width=device-width,initial-scale=1'>"
            f"<title>{e(title)} · lorad</title><style>{CSS}</style></head><body>"
            "<header><b>lorad</b><a href='/jobs'>Jobs</a><a href='/submit'>Submit</a><a href='/power'>Power</a>"
            "<a href='/metrics'>Metrics</a></header>"
            f"<main>{notice}{body}</main>{script}</body></html>")


def live(inner: str, poll_s: float) -> str:
    return f'<div id="live" data-poll="{int(poll_s * 1000)}">{inner}</div>'


# ---------------------------------------------------------------- jobs
def note_of(j: dict[str, Any]) -> str:
    if j.get("requested"):
        return f"{j['requested']} requested"
    if j["state"] in ("succeeded", "cancelled"):
        return ""
    if j.get("gpu_note") and j["state"] in ("queued", "running"):  # gpu_memory_policy: what was decided
        return j["gpu_note"]
    return j.get("last_error") or ""


def jobs_table(jobs: Sequence[dict[str, Any]]) -> str:
    if not jobs:
        return "<p>No jobs yet. Drop a job file into the inbox, run <code>lorad submit</code>, or use " \
               "<a href='/submit'>Submit</a>.</p>"
    rows = []
    for j in jobs:
        running = j["state"] == "running"
        rows.append(
            f"<tr data-job='{e(j['id'])}'><td><a href='/jobs/{quote(j['id'])}'>{e(j['id'])}</a></td>"
            f"<td>{e(j['name'])}</td><td>{state_badge(j['state'])}</td>"
            f"<td>{progress(j['step'], j['total'])}</td><td class=num>{j['step']}/{j['total']}</td>"
            f"<td class=num>{num(j['loss'])}</td><td class=num>{num(j['s_per_step'], '{:.3f}')}</td>"
            f"<td class=num>{fmt_eta(j['eta_s']) if running else '-'}</td>"
            f"<td class=num>{num(j.get('avg_w'), '{:.0f}')}</td><td class=num>{num(j.get('j_per_step'), '{:.1f}')}</td>"
            f"<td class=note>{e(note_of(j))}</td></tr>")
    return ("<table id='jobs'><thead><tr><th>ID</th><th>Name</th><th>State</th><th>Progress</th>"
            "<th class=num>Step</th><th class=num>Loss</th><th class=num>s/step</th><th class=num>ETA</th>"
            "<th class=num>W</th><th class=num>J/step</th><th>Note</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def gpu_health_table(gpus: Sequence[dict[str, Any]]) -> str:
    """Each GPU's health (daemon/gpu_health/): state and why, slowdown (thermal, hardware), VRAM others hold."""
    if not gpus:
        return ""
    rows = []
    for g in gpus:
        why = g.get("reason") or "" if g.get("state") != "ok" else ""
        if g.get("state") == "held":
            why += f" (lorad gpu clear {g['gpu']})"
        rows.append(f"<tr data-gpu='{e(g['gpu'])}'><td>{e(g['gpu'])}</td><td>{state_badge(g.get('state') or '')}</td>"
                    f"<td>{e(why)}</td><td class=num>{e(g.get('faults'))}</td>"
                    f"<td>{e(' and '.join(g.get('slowdown') or []) or '-')}</td>"
                    f"<td class=num>{num(g.get('foreign_gb'), '{:.1f}')}</td>"
                    f"<td class=num>{num(g.get('free_gb'), '{:.1f}')}</td></tr>")
    return ("<table id='gpu-health'><thead><tr><th>GPU</th><th>Health</th><th>Why</th><th class=num>Faults</th>"
            "<th>Slowdown</th><th class=num>Others' VRAM GiB</th><th class=num>Free GiB</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


# ---------------------------------------------------------------- one job
def job_summary(j: dict[str, Any]) -> str:
    cells = [("State", state_badge(j["state"])), ("Progress", f"{progress(j['step'], j['total'])} "
                                                              f"{j['step']}/{j['total']}"),
             ("Loss", num(j["loss"])), ("s/step", num(j["s_per_step"], "{:.3f}")),
             ("ETA", fmt_eta(j["eta_s"]) if j["state"] == "running" else "-"),
             ("W (avg)", num(j.get("avg_w"), "{:.0f}")), ("J/step", num(j.get("j_per_step"), "{:.1f}")),
             ("kWh", num(j.get("kwh"), "{:.4f}")), ("Priority", e(j["priority"])),
             ("Last checkpoint", f"step {j['checkpoint_step']}" if j.get("checkpoint_step") is not None else "-")]
    note = note_of(j)
    if note:
        cells.append(("Note", f"<span class=err>{e(note)}</span>"))
    return "<table class='summary'>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells) + "</table>"


def mirror_lag(m: dict[str, Any] | None) -> str:
    """The job's mirror: where, how far behind (steps, seconds), the last upload and the last error."""
    if not m:
        return ""
    behind = "caught up" if not m.get("behind_steps") else f"{m['behind_steps']} steps, {num(m.get('behind_s'), '{:.0f}')} s"
    cells = [("Mirror", e(f"{m.get('mirror')}/{m.get('key') or ''}")), ("Behind", e(behind)),
             ("Remote step", num(m.get("remote_step"))), ("Last upload", when(m.get("last_upload_at")))]
    if m.get("fetching"):
        cells.insert(1, ("Fetching", e(m["fetching"])))
    if m.get("last_error"):
        cells.append(("Mirror error", f"<span class=err>{e(m['last_error'])}</span>"))
    return "<table class='summary' id='mirror'>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in cells) \
        + "</table>"


def actions(j: dict[str, Any], csrf: str) -> str:
    if j["state"] in FINAL:
        return ""
    base = f"/jobs/{quote(j['id'])}"
    hidden = f"<input type=hidden name=csrf value='{e(csrf)}'>"
    buttons = []
    # Pause and cancel carry the state this page showed: refused if the job has moved on since (handlers._seen).
    seen = f"<input type=hidden name=expect value='{e(j['state'])}'>"
    if j["state"] in ("queued", "running", "waiting"):
        buttons.append(f"<form method=post action='{base}/pause'>{hidden}{seen}<button id=pause>Pause</button></form>")
    if j["state"] == "paused":
        buttons.append(f"<form method=post action='{base}/resume'>{hidden}<button id=resume>Resume</button></form>")
    buttons.append(f"<form method=post action='{base}/cancel'>{hidden}{seen}<button id=cancel>Cancel</button></form>")
    buttons.append(f"<form method=post action='{base}/priority'>{hidden}<input name=priority type=number "
                   f"min=-1000 max=1000 value='{e(j['priority'])}' style='width:6em'>"
                   "<button id=set-priority>Set priority</button></form>")
    return "<section class=actions><h2>Actions</h2>" + "".join(buttons) + "</section>"


def history_note(read: int, size: int) -> str:
    """Said while a long events.jsonl is still being read on a thread (the live part refreshes as it goes)."""
    if read >= size:
        return ""
    return (f"<p class=said id=history-reading>Reading this job's history: {read / size:.0%} of "
            f"{size / 1e6:.0f} MB so far; the charts fill in as it goes.</p>")


def sample_tag(src: str, alt: str, extra: str = "") -> str:
    """An image sample as <img>; a video family's clip (.mp4) as a muted, looping <video> that plays in place."""
    if src.endswith(".mp4"):  # preload=metadata is <video>'s lazy loading (it has no loading attribute)
        extra = extra.replace("loading=lazy", "").strip()
        return f"<video {extra} src='{src}' title='{alt}' muted loop autoplay playsinline preload=metadata></video>"
    return f"<img {extra} src='{src}' alt='{alt}'>"


def samples_grid(job_id: str, samples: dict[int, dict[str, Any]], most_steps: int = 8) -> str:
    """Prompts down, steps across (the newest `most_steps`); a click shows the image full size."""
    if not samples:
        return ""
    steps = sorted(samples)[-most_steps:]
    n_rows = max(len(samples[s]["paths"]) for s in steps)
    prompts: list[str] = []
    for s in steps:
        for i, p in enumerate(samples[s]["prompts"]):
            if i >= len(prompts):
                prompts.append(p)
    # An edit job's control images, shown left of the samples (the newest step's, as rendered from).
    controls = {i: (s, c) for s in steps for i, c in enumerate(samples[s].get("controls", [])) if c}
    head = ("<tr><th>prompt</th>" + ("<th>control</th>" if controls else "")
            + "".join(f"<th>step {s}</th>" for s in steps) + "</tr>")
    rows, boxes = [], []
    for i in range(n_rows):
        cells = []
        if controls:
            s_c, files = controls.get(i, (None, []))
            cells.append("<td>" + "".join(
                f"<img loading=lazy src='/jobs/{quote(job_id)}/samples/{s_c}/{quote(f.rsplit('/', 1)[-1])}' "
                f"alt='control {j} of #{i}'>" for j, f in enumerate(files)) + "</td>")
        for s in steps:
            paths = samples[s]["paths"]
            if i >= len(paths):
                cells.append("<td></td>")
                continue
            name = paths[i].rsplit("/", 1)[-1]
            src = f"/jobs/{quote(job_id)}/samples/{s}/{quote(name)}"
            anchor = f"img-{s}-{i}"
            cells.append(f"<td><a href='#{anchor}'>{sample_tag(src, f'step {s} #{i}', 'loading=lazy')}</a></td>")
            boxes.append(f"<a class=lightbox id='{anchor}' href='#_'>{sample_tag(src, f'step {s} #{i}')}</a>")
        label = prompts[i] if i < len(prompts) else f"#{i}"
        rows.append(f"<tr><td style='white-space:normal;max-width:260px'>{e(label)}</td>{''.join(cells)}</tr>")
    return ("<section><h2>Samples</h2><table class=grid-samples>" + head + "".join(rows) + "</table>"
            + "".join(boxes) + "</section>")


def saved_steps(job_id: str, saved: Sequence[Any], samples: dict[int, dict[str, Any]]) -> str:
    """Each committed checkpoint still on disk (newest first): that step's samples beside its export files, each a
    download (`lorad export ID --step N` copies the same files)."""
    if not saved:
        return ""
    rows = []
    for c in saved:
        names = [str(x).rsplit("/", 1)[-1] for x in samples.get(c.step, {}).get("paths", [])]
        imgs = "".join(sample_tag(f"/jobs/{quote(job_id)}/samples/{c.step}/{quote(n)}", f"step {c.step} sample",
                                  "loading=lazy class=thumb") for n in names)
        links = "<br>".join(f"<a download href='/jobs/{quote(job_id)}/exports/{c.step}/{quote(f.name)}'>{e(f.name)}</a>"
                            f" <small>{num(f.size / 1024, '{:.0f}')} KiB</small>" for f in c.exports)
        rows.append(f"<tr><td class=num>{c.step}</td><td>{imgs}</td><td>{links}</td></tr>")
    return ("<section><h2>Saved steps</h2><table id=saved-steps><tr><th class=num>Step</th><th>Samples</th>"
            "<th>LoRA files</th></tr>" + "".join(rows) + "</table></section>")


def checkpoints_table(cks: Iterable[dict[str, Any]]) -> str:
    rows = "".join(f"<tr><td class=num>{c['step']}</td><td>{when(c.get('ts'))}</td>"
                   f"<td class=num>{num(c.get('seconds'), '{:.2f}')}</td><td class=path>{e(c.get('path'))}</td></tr>"
                   for c in sorted(cks, key=lambda c: c["step"], reverse=True)[:20])
    if not rows:
        return "<section><h2>Checkpoints</h2><p>none committed yet</p></section>"
    return ("<section><h2>Checkpoints</h2><table id=checkpoints><tr><th class=num>Step</th><th>Committed</th>"
            "<th class=num>Write s</th><th>Path</th></tr>" + rows + "</table></section>")


def attempts_table(attempts: Sequence[dict[str, Any]]) -> str:
    def why(a: dict[str, Any]) -> str:
        if a["ended_at"] is None:
            return "running"
        return a["error"] or ("finished" if a["exit_code"] == 0 else
                              "stopped cleanly (checkpointed)" if a["exit_code"] == 75 else f"exit {a['exit_code']}")

    rows = "".join(f"<tr><td class=num>{a['n']}</td><td>{when(a['started_at'])}</td><td>{when(a['ended_at'])}</td>"
                   f"<td class=num>{a['start_step']}→{'' if a['end_step'] is None else a['end_step']}</td>"
                   f"<td class=num>{e(a['exit_code'])}</td><td class=note>{e(why(a))}</td></tr>" for a in attempts)
    return ("<section><h2>Attempts</h2><table id=attempts><tr><th class=num>#</th><th>Started</th><th>Ended</th>"
            "<th class=num>Steps</th><th class=num>Exit</th><th>Why it ended</th></tr>" + rows + "</table></section>")


def events_list(title: str, evs: Sequence[dict[str, Any]], element_id: str) -> str:
    lines = []
    for ev in evs:
        rest = {k: v for k, v in ev.items() if k not in ("ts", "event", "level", "job")}
        lines.append(f"<span>{e(ev.get('ts', ''))} {e(ev.get('event', ev.get('kind', '')))} "
                     f"{e(' '.join(f'{k}={v}' for k, v in rest.items()))}</span>")
    return (f"<section><h2>{e(title)}</h2><pre class=yaml id='{e(element_id)}'>" + "".join(lines)
            + "</pre></section>")


# ---------------------------------------------------------------- submit
def submit_form(csrf: str, text: str = "", problems: Sequence[tuple[int | None, str]] = (),
                accepted: str | None = None) -> str:
    out = ["<h2>Submit a job</h2>"]
    if accepted:
        out.append(f"<div class=said id=accepted>accepted as <a href='/jobs/{quote(accepted)}'>{e(accepted)}</a></div>")
    if problems:
        out.append("<div class=err id=problems><b>Not accepted:</b><ul>"
                   + "".join(f"<li>{'line ' + str(ln + 1) + ': ' if ln is not None else ''}{e(msg)}</li>"
                             for ln, msg in problems) + "</ul></div>")
        by_line: dict[int, list[str]] = {}
        for ln, msg in problems:
            if ln is not None:
                by_line.setdefault(ln, []).append(msg)
        shown = []
        for i, line in enumerate(text.splitlines()):
            why = by_line.get(i)
            mark = f"<span class=why>← {e('; '.join(why))}</span>" if why else ""
            shown.append(f"<span{' class=bad' if why else ''}><i class=lineno>{i + 1}</i>{e(line)}{mark}</span>")
        out.append("<pre class=yaml id=annotated>" + "".join(shown) + "</pre>")
    out.append("<form method=post action='/submit' enctype='multipart/form-data'>"
               f"<input type=hidden name=csrf value='{e(csrf)}'>"
               "<p>Paste a job YAML (relative paths are relative to the daemon's home) or upload a file:</p>"
               f"<textarea name=text>{e(text)}</textarea><p><input type=file name=file accept='.yaml,.yml'> "
               "<button id=submit>Submit</button></p></form>")
    return "".join(out)


# ---------------------------------------------------------------- power
def power_tables(report: dict[str, Any], schedule: dict[str, Any]) -> str:
    out = []
    if report.get("simulated"):
        out.append("<p class=said>SIMULATED telemetry (power.telemetry.backend: simulated)</p>")
    for note in report.get("notes") or []:
        out.append(f"<p class=err>{e(note)}</p>")
    gpus = report.get("gpus") or []
    if gpus:
        rows = []
        for g in gpus:
            s = g.get("sample") or {}
            rows.append(f"<tr><td>{g['index']}</td><td>{e(g.get('name'))}</td><td class=num>{num(s.get('power_w'), '{:.0f}')}</td>"
                        f"<td class=num>{num(g.get('limit_w'), '{:.0f}')}</td><td class=num>{num(g.get('wanted_w'), '{:.0f}')}</td>"
                        f"<td>{e(g.get('cap_reason'))}</td><td class=num>{num(s.get('sm_mhz'), '{:.0f}')}</td>"
                        f"<td class=num>{num(s.get('temp_c'), '{:.0f}')}</td>"
                        f"<td>{e(', '.join(s.get('throttle') or []) if isinstance(s.get('throttle'), list) else s.get('throttle'))}</td>"
                        f"<td class=err>{e(g.get('refused'))}</td></tr>")
        out.append("<table id=gpus><tr><th>GPU</th><th>Name</th><th class=num>W</th><th class=num>Limit W</th>"
                   "<th class=num>Cap W</th><th>Cap because</th><th class=num>SM MHz</th><th class=num>°C</th>"
                   "<th>Throttle</th><th>Refused</th></tr>" + "".join(rows) + "</table>")
    else:
        out.append("<p>No GPU telemetry.</p>")
    ups = report.get("ups")
    out.append("<section><h2>UPS</h2>" + (
        f"<p id=ups>state <b>{e(ups.get('state'))}</b>, status {e(ups.get('status'))}, "
        f"{'connected' if ups.get('connected') else 'not connected'}"
        f"{' — ' + e(ups.get('error')) if ups.get('error') else ''}</p>" if ups else "<p id=ups>no UPS configured</p>")
        + "</section>")
    def windows(title: str, rows: list[dict[str, Any]], element_id: str, empty: str) -> str:
        if not rows:
            return f"<p id={element_id}>{e(empty)}</p>"
        return (f"<table id={element_id}><tr><th>{e(title)}</th><th>Start</th><th>End</th><th class=num>Cap W</th></tr>"
                + "".join(f"<tr><td>{e(w.get('days'))}</td><td>{e(w.get('start'))}</td><td>{e(w.get('end'))}</td>"
                          f"<td class=num>{num(w.get('limit_w'), '{:.0f}')}</td></tr>" for w in rows) + "</table>")

    out.append("<section><h2>Schedule</h2>"
               + windows("Run window (days)", schedule.get("run_windows") or [], "run-windows",
                         "no run windows: jobs may run at any time")
               + windows("Cap window (days)", schedule.get("caps") or [], "cap-windows", "no cap windows")
               + f"<p>time zone {e(schedule.get('timezone'))}; outages file "
               f"{e(schedule.get('outages_file') or '-')}</p></section>")
    return "".join(out)
