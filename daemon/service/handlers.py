"""One handler per socket verb. Each takes the daemon context and its typed request and returns its typed reply
(daemon/protocol.py: REPLY_TYPES).

Handlers run on connection threads: they read and write the store (which
serialises access) and wake the service loop; they never touch processes —
the supervisor's `requests` step turns a recorded pause/cancel into a SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.intake.rejections import recent_rejections
from daemon.mirror.remote import MirrorError
from daemon.store import states
from daemon.store.db import Store
from daemon.store.errors import AmbiguousJob, UnknownJob
from daemon.supervisor import caption_edits
from daemon.supervisor.disk_progress import saved_exports
from daemon.supervisor.scheduling import status_order
from daemon.system.safe_files import NotRegularFile, open_file, opened_dir, opened_dir_at
from engine.config.reading import YamlProblem, read_yaml
from engine.errors import JobInvalid
from engine.version import lorad_version

LOG_CHUNK_BYTES = 256 * 1024
REJECTIONS_SHOWN = 5  # `lorad status`: the newest inbox rejections ...
REJECTIONS_WITHIN_S = 24 * 3600  # ... of the last day


@dataclass
class Context:
    home: Path
    store: Store
    intake: Any
    supervisor: Any
    started_at: float
    socket_path: Path
    web_url: str | None = None  # the dashboard's address once it listens (None: disabled or unavailable)

    def wake(self) -> None:
        if self.supervisor is not None:
            self.supervisor.wake.set()


def _job(ctx: Context, ref: str) -> dict[str, Any]:
    try:
        return ctx.store.find(ref)
    except UnknownJob:
        raise p.ProtocolError("not_found", f"no job {ref!r}") from None
    except AmbiguousJob as e:
        raise p.ProtocolError("ambiguous", f"{ref!r} matches {len(e.matches)} jobs: {id_list(e.matches)}; use the id") \
            from None


def id_list(jobs: list[dict[str, Any]], most: int = 6) -> str:
    """'a-1f2e (running), a-9c0d (queued)', with '… and N more' past `most`."""
    shown = ", ".join(f"{j['id']} ({j['state']})" for j in jobs[:most])
    return shown + (f", … and {len(jobs) - most} more" if len(jobs) > most else "")


def ping(ctx: Context, req: p.Ping) -> p.PingReply:
    sup = ctx.supervisor
    return p.PingReply(version=lorad_version(), pid=os.getpid(), home=str(ctx.home), socket=str(ctx.socket_path),
                       uptime_s=round(time.time() - ctx.started_at, 1), protocol=p.VERSION,
                       draining=ctx.store.get_meta("drain") == "1",
                       running=len(sup.children) if sup is not None else 0,
                       notes=list(sup.notes) if sup is not None else [])


def submit(ctx: Context, req: p.Submit) -> p.SubmitReply:
    mirrors = getattr(ctx.supervisor, "mirrors", None)
    restored = None
    try:
        if req.from_mirror is not None:  # a job brought over from a mirror (daemon/mirror/restore.py)
            if mirrors is None:
                raise JobInvalid("--from: this daemon has no mirrors")
            out, restored = mirrors.restore(
                req.from_mirror, lambda text, source, state: ctx.intake.submit_text(req.name, text, source, state=state),
                lambda text: ctx.intake.validate(text, req.name)[1], req.text or None)
        else:
            if mirrors is not None:
                mirrors.check_job(_doc(req.text))  # a mirror that cannot work is refused now, when it can be told
            out = ctx.intake.submit_text(req.name, req.text)
    except JobInvalid as e:
        raise p.ProtocolError("invalid_job", str(e)) from None
    ctx.wake()
    return p.SubmitReply(job=out.job_id, same_name=[p.SameName(id=j["id"], state=j["state"]) for j in out.same_name],
                         restored=restored)


def _doc(text: str) -> dict[str, Any]:
    try:
        doc = read_yaml(text)
    except YamlProblem:
        return {}  # the intake says what is wrong with it
    return doc if isinstance(doc, dict) else {}


SAMPLE_STEP = re.compile(r"^step-(\d{1,12})$")


def latest_samples(workdir: Path) -> tuple[int | None, list[str]]:
    """The newest samples/step-N/ the trainer rendered, and its PNGs (read from disk: it outlives restarts).

    The trainer user writes jobs/ID/: the listing goes through directory descriptors that never follow a symlink
    (a `samples` or step-N that is a link lists nothing), and a name that is not step-N is left out.
    """
    try:
        with opened_dir(workdir / "samples") as root:
            steps = sorted(((int(m.group(1)), e.name) for e in os.scandir(root)
                            if (m := SAMPLE_STEP.match(e.name)) and e.is_dir(follow_symlinks=False)), reverse=True)
            for step, name in steps:
                try:
                    with opened_dir_at(root, name) as d:
                        pngs = sorted(e.name for e in os.scandir(d)
                                      if e.name.endswith(".png") and e.is_file(follow_symlinks=False))
                except OSError:
                    continue
                if pngs:
                    return step, [str(workdir / "samples" / name / f) for f in pngs]
    except OSError:
        pass
    return None, []


def status(ctx: Context, req: p.Status) -> p.QueueReply | p.JobStatusReply:
    if req.job is None:
        return queue(ctx)
    job = _job(ctx, req.job)
    src = job["source"] or ""
    if src[:1].isdigit() and "-" in src:
        job["source"] = "inbox:" + src.split("-", 1)[1]  # incoming/ names carry a claim-time prefix
    samples_step, samples = latest_samples(Path(job["workdir"]))
    imported = (ctx.store.first_event(job["id"], "imported") or {}).get("data") or {}
    detail = p.JobDetail.model_validate({**job, "imported_from": imported.get("from_tool"),
                                         "not_carried_over": imported.get("not_carried_over") or [],
                                         "mirror": _mirror_lag(ctx, job["id"]), "gpu_note": _gpu_note(ctx, job["id"]),
                                         "attempts": ctx.store.attempts(job["id"]),
                                         "events": ctx.store.events(job["id"], limit=20),
                                         "samples_step": samples_step, "samples": samples})
    from daemon.power import api as power_api  # W, J/step, kWh, steps/kWh (None when nothing was measured)

    policy = getattr(ctx.supervisor, "policy", None)
    return p.JobStatusReply(job=detail, power=power_api.job_power(policy, ctx.home / "state.db", job["id"]))


def _gpu_note(ctx: Context, job_id: str) -> str | None:
    return getattr(ctx.supervisor, "gpu_notes", {}).get(job_id)


def _mirror_lag(ctx: Context, job_id: str) -> dict[str, Any] | None:
    mirrors = getattr(ctx.supervisor, "mirrors", None)
    return mirrors.status(job_id) if mirrors is not None else None


def queue(ctx: Context) -> p.QueueReply:
    """`lorad status` without a job."""
    rejected, n_rejected = recent_rejections(ctx.home / "rejected", time.time(), REJECTIONS_WITHIN_S,
                                             REJECTIONS_SHOWN)
    return p.QueueReply(
        jobs=[p.JobRow.model_validate({**j, "mirror": _mirror_lag(ctx, j["id"]), "gpu_note": _gpu_note(ctx, j["id"])})
              for j in status_order(ctx.store.jobs(), time.time())],
        gpus=gpu_health(ctx),
        draining=ctx.store.get_meta("drain") == "1",
        notes=list(ctx.supervisor.notes) if ctx.supervisor is not None else [],
        rejected=rejected, rejected_within_s=REJECTIONS_WITHIN_S, rejected_total=n_rejected,
        rejected_dir=str(ctx.home / "rejected"),
        # Inbox files neither accepted nor rejected yet (disk full, ...): kept, retried every inbox_retry_s.
        inbox_stuck=ctx.intake.stuck if ctx.intake is not None else [],
        inbox_retry_s=ctx.intake.cfg.inbox_rescan_s if ctx.intake is not None else None)


def logs(ctx: Context, req: p.Logs) -> p.LogsReply:
    job = _job(ctx, req.job)
    # By descriptor, never through a symlink: the trainer user may replace events.jsonl (safe_files.py).
    try:
        fd = open_file(Path(job["workdir"]) / "events.jsonl")
    except FileNotFoundError:
        return p.LogsReply(job=job["id"], lines=[], offset=0, state=job["state"])
    except NotRegularFile as e:
        raise p.ProtocolError("unreadable", f"job {job['id']}: {e}; not read") from None
    try:
        size = os.fstat(fd).st_size
        if req.offset < 0:
            start = max(0, size - LOG_CHUNK_BYTES)
            lines = os.pread(fd, size - start, start).split(b"\n")
            if start > 0:
                lines = lines[1:]  # a partial first line
            complete = lines[:-1]
            chosen = complete[-req.tail:] if req.tail else []
            end = size - len(lines[-1])
        else:
            start = min(req.offset, size)
            data = os.pread(fd, LOG_CHUNK_BYTES, start)
            cut = data.rfind(b"\n") + 1  # only whole lines; the rest comes next time
            chosen = data[:cut].split(b"\n")[:-1]
            end = start + cut
    finally:
        os.close(fd)
    out = []
    for ln in chosen:
        try:
            out.append(json.loads(ln))
        except ValueError:
            out.append({"event": "unparsed", "text": ln.decode(errors="replace")})
    return p.LogsReply(job=job["id"], lines=out, offset=end, state=job["state"])


def _seen(job: dict[str, Any], expect: str | None) -> str:
    """The state the request was meant for: the one the asker saw (`expect`), else the one read just now."""
    if expect is not None and expect != job["state"]:
        raise p.ProtocolError("conflict", f"job {job['id']} is {job['state']} now, not {expect}; nothing was changed")
    return job["state"]


def _ask_trainer(ctx: Context, job: dict[str, Any], what: str) -> None:
    """Ask a running job's trainer to stop, only while that job is still running (store.request)."""
    if not ctx.store.request(job["id"], what, states.RUNNING):
        now = ctx.store.get(job["id"])["state"]
        raise p.ProtocolError("conflict", f"job {job['id']} stopped running meanwhile (it is {now} now); nothing was "
                                       f"changed: look at `lorad status {job['id']}` and ask again if needed")
    ctx.wake()


def pause(ctx: Context, req: p.Pause) -> p.JobActionReply:
    job = _job(ctx, req.job)
    st = _seen(job, req.expect)
    if st in (states.QUEUED, states.WAITING, states.WAITING_FOR_GPU):
        ctx.store.transition(job["id"], st, states.PAUSED, "lorad pause", wait_bytes=None)  # refused if it moved on
        return p.JobActionReply(job=job["id"], state=states.PAUSED, message="paused")
    if st == states.RUNNING:
        _ask_trainer(ctx, job, "pause")
        return p.JobActionReply(job=job["id"], state=st, message="pausing: the trainer checkpoints and stops")
    if st == states.PAUSED:
        return p.JobActionReply(job=job["id"], state=st, message="already paused")
    raise p.ProtocolError("refused", f"job {job['id']} is {st}; only queued or running jobs can be paused")


def resume(ctx: Context, req: p.Resume) -> p.JobActionReply:
    job = _job(ctx, req.job)
    if caption_edits.held(job):  # held after its caption stage: released first, then queued to train
        caption_edits.release(job)
        ctx.store.transition(job["id"], states.PAUSED, states.QUEUED, "lorad resume: captions reviewed", not_before=0,
                             retries=0, stage=None)
        ctx.wake()
        return p.JobActionReply(job=job["id"], state=states.QUEUED, message="queued; it trains on its captions as "
                                                                            "they are now, edits included")
    if job["state"] == states.PAUSED:
        ctx.store.transition(job["id"], states.PAUSED, states.QUEUED, "lorad resume", not_before=0, retries=0)
        ctx.wake()
        return p.JobActionReply(job=job["id"], state=states.QUEUED, message="queued; it resumes from its last checkpoint")
    if job["state"] == states.RUNNING and job["requested"] == "pause":
        raise p.ProtocolError("refused", f"job {job['id']} is still pausing; resume it once it is paused")
    raise p.ProtocolError("refused", f"job {job['id']} is {job['state']}, not paused")


def cancel(ctx: Context, req: p.Cancel) -> p.JobActionReply:
    job = _job(ctx, req.job)
    st = _seen(job, req.expect)
    if st in (states.QUEUED, states.PAUSED, states.INTERRUPTED, states.WAITING, states.FETCHING,
              states.WAITING_FOR_GPU):
        ctx.store.transition(job["id"], st, states.CANCELLED, "lorad cancel")  # refused if it moved on
        return p.JobActionReply(job=job["id"], state=states.CANCELLED, message="cancelled")
    if st == states.RUNNING:
        _ask_trainer(ctx, job, "cancel")
        return p.JobActionReply(job=job["id"], state=st, message="cancelling: the trainer checkpoints and stops")
    raise p.ProtocolError("refused", f"job {job['id']} is already {st}")


def retry(ctx: Context, req: p.Retry) -> p.JobActionReply:
    """A failed job back in the queue with a fresh retry budget (or a job waiting for disk space, now); its trainer
    resumes from the newest checkpoint in its directory."""
    job = _job(ctx, req.job)
    st = job["state"]
    if st not in (states.FAILED, states.WAITING):
        raise p.ProtocolError("refused", f"job {job['id']} is {st}; only a failed job (or one waiting for disk space) "
                                      "can be retried")
    mirrors = getattr(ctx.supervisor, "mirrors", None)
    try:
        if st == states.FAILED and mirrors is not None and mirrors.refetch(job):
            return p.JobActionReply(job=job["id"], state=states.FETCHING,
                                    message="fetching: its checkpoint is downloaded from the mirror again")
    except MirrorError as e:
        raise p.ProtocolError("refused", f"job {job['id']}: {e}") from None
    ctx.store.transition(job["id"], st, states.QUEUED, "lorad retry", retries=0, not_before=0, wait_bytes=None,
                         requested=None)
    ctx.wake()
    where = f"from its checkpoint at step {job['checkpoint_step']}" if job["checkpoint_step"] else "from step 0"
    return p.JobActionReply(job=job["id"], state=states.QUEUED, message=f"queued; it resumes {where}")


def priority(ctx: Context, req: p.SetPriority) -> p.PriorityReply:
    job = _job(ctx, req.job)
    if job["state"] in states.FINAL:
        raise p.ProtocolError("refused", f"job {job['id']} is {job['state']}")
    ctx.store.update(job["id"], priority=req.priority)
    ctx.wake()
    return p.PriorityReply(job=job["id"], state=job["state"], priority=req.priority,
                           message=f"priority {req.priority} (takes effect when the next job is picked)")


def drain(ctx: Context, req: p.Drain) -> p.DrainReply:
    ctx.store.set_meta("drain", "1" if req.on else "0")
    ctx.wake()
    msg = ("draining: running jobs checkpoint and stop; no job starts until `lorad drain --off`" if req.on
           else "taking jobs again")
    return p.DrainReply(draining=req.on, message=msg)


def power(ctx: Context, req: p.Power) -> p.PowerReply:
    """`lorad power`: telemetry per GPU, caps, tuner, UPS; with limit_w/clear, set or drop a manual limit first."""
    from daemon.power import api as power_api

    policy = getattr(ctx.supervisor, "policy", None)
    out: dict[str, Any] = {}
    if req.limit_w is not None or req.clear:
        out["set"] = power_api.set_limit(policy, req.gpu, None if req.clear else req.limit_w)
    return p.PowerReply(**out, **power_api.power_report(policy))


def web_url(ctx: Context, req: p.WebUrl) -> p.WebUrlReply:
    """`lorad web-url`: the dashboard's address with its token (socket users may read it: same people)."""
    from daemon.web.auth import read_token

    token = read_token(ctx.home)
    if ctx.web_url is None or token is None:
        raise p.ProtocolError("refused", "the dashboard is not running (web.enabled: false, or its address was "
                                      "unusable: see the daemon's log)")
    return p.WebUrlReply(url=f"{ctx.web_url}?token={token}", base=ctx.web_url)


def exports(ctx: Context, req: p.Exports) -> p.ExportsReply:
    """`lorad export`: the committed checkpoints on disk and their export files, as their manifests list them (the
    client checks each file's sha256 as it copies it)."""
    job = _job(ctx, req.job)
    try:
        saved = saved_exports(Path(job["workdir"]), req.step)
    except LookupError as e:
        raise p.ProtocolError("not_found", f"job {job['id']} {e}") from None
    return p.ExportsReply.of(job["id"], job["state"], saved)


def gpu(ctx: Context, req: p.Gpu) -> p.GpuReply:
    """`lorad gpu [clear N]`: each GPU's health; with clear, GPU N's faults forgotten first (scheduled again
    unless a fault still holds)."""
    sup = ctx.supervisor
    if req.clear is None:
        return p.GpuReply(gpus=sup.gpu_views() if sup is not None else gpu_health(ctx))
    try:
        if sup is None:
            raise KeyError("no supervisor")
        view = sup.clear_gpu(req.clear)
    except KeyError as e:
        raise p.ProtocolError("refused", str(e.args[0])) from None
    msg = (f"GPU {req.clear} cleared: scheduled again" if view["state"] == "ok" else
           f"GPU {req.clear} cleared, but it is still out: {view['reason']}")
    return p.GpuReply(gpus=sup.gpu_views(), cleared=req.clear, message=msg)


def gpu_health(ctx: Context) -> list[dict[str, Any]]:
    """Each GPU's health as the supervisor last wrote it (meta gpu_health), [] without readings."""
    try:
        out = json.loads(ctx.store.get_meta("gpu_health") or "[]")
    except ValueError:
        return []
    return out if isinstance(out, list) else []


def caption(ctx: Context, req: p.EditCaption) -> p.JobActionReply:
    return caption_edits.edit(_job(ctx, req.job), req)  # refused once training has begun


HANDLERS: dict[str, Callable[[Context, Any], Any]] = {
    "ping": ping, "submit": submit, "status": status, "logs": logs, "pause": pause, "resume": resume,
    "cancel": cancel, "retry": retry, "priority": priority, "drain": drain, "power": power, "web-url": web_url,
    "export": exports, "gpu": gpu, "caption": caption,
}


def dispatch(ctx: Context, req: Any) -> bytes:
    try:
        reply = HANDLERS[req.verb](ctx, req)
    except p.ProtocolError as e:
        return p.error(e.code, e.message)
    except states.IllegalTransition as e:
        # The supervisor moved the job between our read and our write (it just started, say).
        return p.error("conflict", f"{e}; try again")
    return p.answer(reply)
