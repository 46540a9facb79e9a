"""The dashboard and /metrics as a Starlette app, built from plain arguments so tests can drive it directly.

Reads come from a StoreView (read-only SQLite + events.jsonl); every action
(pause, resume, cancel, priority, submit) is a typed protocol request passed to
`call`, which in the daemon runs the very handler the socket verb runs — one
source of truth. `call` returns the reply as a dict: {"ok": true, "data": …} or
{"ok": false, "error": code, "message": …}.
"""

from __future__ import annotations

import bisect
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from daemon import protocol as p
from daemon.config.web import WebSettings, is_loopback
from daemon.supervisor.disk_progress import committed_checkpoints, open_export
from daemon.web import auth, pages
from daemon.web import submit as submit_help
from daemon.web.charts import Line, line_chart
from daemon.web.downsample import mean_near
from daemon.web.guard import BodyLimit, HostCheck, allowed_hosts
from daemon.web.storeview import History, StoreView

Caller = Callable[[BaseModel], dict[str, Any]]
SAMPLE_NAME = re.compile(r"^[\w.-]+\.(png|mp4)$")  # images, and the video families' clips
POWER_WINDOW_S = 3600
POWER_BUCKET_S = 6.0  # the power page's charts: one point per GPU per 6 s (600 in the hour)
NEAREST_SAMPLE_S = 10.0  # a step's W is the telemetry sample nearest in time, if one is this close
SESSION_DAYS = 7


class Dashboard:
    def __init__(self, home: Path, view: StoreView, settings: WebSettings, call: Caller, token: str,
                 metrics: CollectorRegistry | None = None, schedule: dict[str, Any] | None = None,
                 max_body_bytes: int = 1 << 20, mirror_lag: Callable[[str], dict[str, Any] | None] | None = None):
        self.home = Path(home)
        self.mirror_lag = mirror_lag or (lambda job_id: None)  # a job's mirror lag (daemon/mirror/service.py)
        self.view = view
        self.s = settings
        self.call = call
        self.token = token
        self.metrics = metrics
        self.schedule = schedule or {}
        self.max_body_bytes = max_body_bytes

    # ---------------------------------------------------------------- auth
    def _denied(self, status: int, why: str) -> Response:
        body = pages.layout("Sign in", f"<h2>{'Token required' if status == 401 else 'Refused'}</h2><p>{pages.e(why)}</p>"
                            "<p>Open the address that <code>lorad web-url</code> prints.</p>")
        return HTMLResponse(body, status_code=status)

    @staticmethod
    def _cookie(request: Request) -> str:
        """The session cookie's name: bound to the port this dashboard listens on (its socket's, not the Host's)."""
        return auth.cookie_name((request.scope.get("server") or (None, None))[1])

    def check(self, request: Request) -> Response | None:
        """None when the request may proceed; else the response that refuses it (or signs a browser in)."""
        given = request.query_params.get("token")
        if given is not None:
            if not auth.token_ok(self.token, given):
                return self._denied(403, "wrong token")
            if request.method == "GET" and request.url.path != "/metrics":
                # Signed in: a session cookie from now on, and the token leaves the address bar.
                q = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                target = request.url.path + ("?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in q) if q else "")
                resp = RedirectResponse(target, status_code=303)
                resp.set_cookie(self._cookie(request), auth.new_session(self.token), max_age=SESSION_DAYS * 86400,
                                httponly=True, samesite="strict", path="/")
                return resp
            return None
        header = request.headers.get("authorization", "")
        if header:
            kind, _, value = header.partition(" ")
            if kind.lower() != "bearer" or not auth.token_ok(self.token, value.strip()):
                return self._denied(403, "wrong token")
            return None
        cookie = request.cookies.get(self._cookie(request))
        if cookie is None:
            return self._denied(401, "this dashboard needs its token")
        if not auth.session_ok(self.token, cookie):
            return self._denied(401, "this session is no longer valid (the token changed)")
        return None

    def check_post(self, request: Request, form: Any) -> Response | None:
        """A POST needs the token or session, and (for a browser session) the session's CSRF token and its origin."""
        if (denied := self.check(request)) is not None:
            return denied
        if request.headers.get("authorization"):
            return None  # a script with the token: browsers never send this header on their own
        origin = request.headers.get("origin")
        own = f"{request.url.scheme}://{request.url.netloc}"
        if origin is not None and origin != own:
            return self._denied(403, f"cross-site request refused (origin {origin})")
        if not auth.csrf_ok(self.token, request.cookies.get(self._cookie(request)), form.get("csrf")):
            return self._denied(403, "missing or wrong CSRF token: reload the page and try again")
        return None

    def csrf(self, request: Request) -> str:
        cookie = request.cookies.get(self._cookie(request))
        return auth.csrf_for(self.token, cookie) if cookie and auth.session_ok(self.token, cookie) else ""

    # ---------------------------------------------------------------- helpers
    def _page(self, request: Request, title: str, inner: str, extra: str = "", live: bool = True) -> Response:
        if request.query_params.get("live") == "1":
            return HTMLResponse(inner)
        body = extra + (pages.live(inner, self.s.poll_s) if live else inner)
        return HTMLResponse(pages.layout(title, body, self.s.poll_s if live else None,
                                         said=request.query_params.get("said")))

    def _ask(self, req: BaseModel) -> dict[str, Any]:
        try:
            return self.call(req)
        except Exception as e:  # noqa: BLE001 — a failed action is a message on the page, not a 500
            return {"ok": False, "error": "internal", "message": f"{type(e).__name__}: {e}"}

    # ---------------------------------------------------------------- pages
    def index(self, request: Request) -> Response:
        return self.check(request) or RedirectResponse("/jobs", status_code=303)

    def jobs(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied
        notes = self.view.meta_json("gpu_notes", {})  # daemon/gpu_health/supervision.py
        jobs = [{**j, "gpu_note": notes.get(j["id"])} for j in self.view.jobs()]
        gpus = pages.gpu_health_table(self.view.meta_json("gpu_health", []))
        return self._page(request, "Jobs", gpus + pages.jobs_table(jobs), extra="<h2>Jobs</h2>")

    def job(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied
        job_id = request.path_params["job"]
        j = self.view.job(job_id)
        if j is None:
            return HTMLResponse(pages.layout("No such job", f"<p>No job {pages.e(job_id)}.</p>"), status_code=404)
        workdir = Path(j["workdir"])
        h = self.view.series(job_id, workdir)
        inner = "".join([
            pages.job_summary(j), pages.mirror_lag(self.mirror_lag(job_id)), pages.actions(j, self.csrf(request)),
            "<section><h2>Training</h2>", pages.history_note(h.read, h.size),
            "<div class=charts>", self.job_charts(job_id, h), "</div></section>",
            pages.samples_grid(job_id, h.samples),
            pages.saved_steps(job_id, [c for c in committed_checkpoints(workdir) if c.exports], h.samples),
            pages.checkpoints_table(h.checkpoints),
            pages.attempts_table(self.view.attempts(job_id)),
            pages.events_list("Events (events.jsonl, newest last)", self.view.events_tail(workdir), "events"),
            pages.events_list("State changes", [{"ts": pages.when(r["ts"]), "event": r["kind"], **r["data"]}
                                                for r in self.view.store_events(job_id)], "transitions"),
        ])
        return self._page(request, job_id, inner, extra=f"<h2>{pages.e(j['name'])} <small>{pages.e(job_id)}</small></h2>")

    def job_charts(self, job_id: str, h: History) -> str:
        """The history's curves: each is at most 2 points per bucket of the downsampled series (history.py), so
        the cost stays flat however long the job."""
        loss_lines = [Line("loss", h.loss, "s0", reported=h.reported)]
        if h.val:
            loss_lines.append(Line("validation loss", h.val, "s1"))
        watts = self._watts_by_step(job_id, h.times)
        jps = [(s, w * v) for s, w in watts if (v := mean_near(h.speed_means, s)) is not None]
        return "".join([
            line_chart("loss" if not h.val else "loss and validation loss", loss_lines, chart_id="chart-loss"),
            line_chart("learning rate", [Line("lr", h.lr, "s2")], chart_id="chart-lr"),
            line_chart("seconds per step", [Line("s/step", h.speed, "s0")], unit="s", chart_id="chart-speed"),
            line_chart("power", [Line("W", watts, "s1")], unit="W", chart_id="chart-watts"),
            line_chart("energy per step", [Line("J/step", jps, "s2")], unit="J", chart_id="chart-jps"),
        ])

    def _watts_by_step(self, job_id: str, times: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """(step, W) where a telemetry sample lies near the step's time. The job's telemetry is averaged in SQL over
        spans of a 2000th of the job's time (1 s at least), so a week-long job's rows are not all fetched."""
        if not times:
            return []
        t0, t1 = min(t for _, t in times), max(t for _, t in times)
        bucket_s = max(1.0, (t1 - t0) / 2000)
        samples = self.view.job_power_samples(job_id, t0 - NEAREST_SAMPLE_S, t1 + NEAREST_SAMPLE_S, bucket_s)
        near = max(NEAREST_SAMPLE_S, bucket_s)
        at = [t for t, _ in samples]
        out: list[tuple[int, float]] = []
        for s, ts in times:
            i = bisect.bisect_left(at, ts)
            if i > 0 and (i == len(at) or ts - at[i - 1] < at[i] - ts):
                i -= 1
            if at and abs(at[i] - ts) <= near:
                out.append((s, samples[i][1]))
        return out

    def sample_image(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied
        j = self.view.job(request.path_params["job"])
        name = request.path_params["name"]
        if j is None or not SAMPLE_NAME.match(name):
            return PlainTextResponse("not found", status_code=404)
        root = (Path(j["workdir"]) / "samples").resolve()
        path = (root / f"step-{int(request.path_params['step']):08d}" / name).resolve()
        if root not in path.parents or not path.is_file():
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(path, media_type="video/mp4" if path.suffix == ".mp4" else "image/png")

    def export_file(self, request: Request) -> Response:
        """One export file of a saved step: its name must be one the step's manifest lists; opened by descriptor
        (no symlink anywhere below the job directory) and streamed from it."""
        if (denied := self.check(request)) is not None:
            return denied
        j = self.view.job(request.path_params["job"])
        step, name = int(request.path_params["step"]), request.path_params["name"]
        listed = next((c for c in committed_checkpoints(Path(j["workdir"])) if c.step == step), None) if j else None
        if listed is None or name not in {f.name for f in listed.exports}:
            return PlainTextResponse("not found", status_code=404)
        try:
            fd = open_export(Path(j["workdir"]), step, name)
        except OSError:
            return PlainTextResponse("not found", status_code=404)
        size = os.fstat(fd).st_size

        def chunks():
            with os.fdopen(fd, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        leaf = re.sub(r"[^\w.-]", "_", name.rsplit("/", 1)[-1])  # the manifest's name, made safe for a header
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers={
            "Content-Length": str(size),
            "Content-Disposition": f"attachment; filename=\"{j['id']}-step-{step}-{leaf}\""})

    async def action(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied  # before a byte of the body is read
        form = await request.form(max_files=1, max_fields=10)  # at most max_body_bytes (guard.BodyLimit)
        if (denied := self.check_post(request, form)) is not None:
            return denied
        job_id, verb = request.path_params["job"], request.path_params["verb"]
        try:
            expect = form.get("expect") or None  # the state the page showed
            req: BaseModel = {"pause": lambda: p.Pause(job=job_id, expect=expect), "resume": lambda: p.Resume(job=job_id),
                              "cancel": lambda: p.Cancel(job=job_id, expect=expect),
                              "priority": lambda: p.SetPriority(job=job_id, priority=int(form.get("priority", "")))
                              }[verb]()
        except KeyError:
            return PlainTextResponse("unknown action", status_code=404)
        except (ValueError, ValidationError):
            return RedirectResponse(f"/jobs/{quote(job_id)}?said={quote('priority must be a whole number -1000..1000')}",
                                    status_code=303)
        reply = await run_in_threadpool(self._ask, req)
        said = p.parse_reply(req, reply["data"]).message if reply.get("ok") else f"refused: {reply.get('message')}"
        return RedirectResponse(f"/jobs/{quote(job_id)}?said={quote(said)}", status_code=303)

    def submit_page(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied
        return self._page(request, "Submit", pages.submit_form(self.csrf(request)), live=False)

    async def submit(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied  # an upload from someone without the token is never read, let alone spooled
        form = await request.form(max_files=1, max_fields=10)  # at most max_body_bytes (guard.BodyLimit)
        if (denied := self.check_post(request, form)) is not None:
            return denied
        upload = form.get("file")
        name, text = "web.yaml", str(form.get("text") or "")
        if upload is not None and not isinstance(upload, str) and upload.filename:
            raw = await upload.read()
            text = raw.decode("utf-8", errors="replace")
            name = re.sub(r"[^\w.-]", "_", Path(upload.filename).name)[:100] or "web.yaml"
        if not text.strip():
            return self._page(request, "Submit", pages.submit_form(self.csrf(request), text,
                                                                  [(None, "paste a job or choose a file")]), live=False)
        reply = await run_in_threadpool(self._ask, p.Submit(name=name, text=text))
        if reply.get("ok"):
            job = p.SubmitReply.model_validate(reply["data"]).job
            return RedirectResponse(f"/jobs/{quote(job)}?said={quote('accepted')}", status_code=303)
        problems = submit_help.locate(text, reply.get("message", ""), name)
        return HTMLResponse(pages.layout("Submit", pages.submit_form(self.csrf(request), text, problems)),
                            status_code=400)

    def power(self, request: Request) -> Response:
        if (denied := self.check(request)) is not None:
            return denied
        reply = self._ask(p.Power())
        report = reply.get("data") if reply.get("ok") else {"notes": [reply.get("message")]}
        since = time.time() - POWER_WINDOW_S
        rows = self.view.gpu_samples(since, bucket_s=POWER_BUCKET_S)
        throttled = self.view.throttle_counts(since)
        charts = []
        for gpu in sorted({r["gpu"] for r in rows}):
            mine = [r for r in rows if r["gpu"] == gpu]
            t0 = mine[0]["ts"]

            def col(key: str, mine=mine, t0=t0) -> list[tuple[float, float]]:
                return [((r["ts"] - t0) / 60, float(r[key])) for r in mine if r[key] is not None]

            throttles = throttled.get(gpu, {})
            charts.append(f"<h3>GPU {gpu}{' (SIMULATED)' if mine[-1]['simulated'] else ''}</h3><div class=charts>"
                          + line_chart("power and limit", [Line("W", col("power_w"), "s0"),
                                                           Line("limit", col("limit_w"), "s1")],
                                       x_label="minutes", unit="W", chart_id=f"gpu{gpu}-power")
                          + line_chart("clocks", [Line("SM", col("sm_mhz"), "s0"), Line("memory", col("mem_mhz"), "s2")],
                                       x_label="minutes", unit="MHz", chart_id=f"gpu{gpu}-clocks")
                          + line_chart("temperature", [Line("°C", col("temp_c"), "s1")], x_label="minutes",
                                       unit="°C", chart_id=f"gpu{gpu}-temp")
                          + "</div><p>throttle reasons in the last hour: "
                          + (pages.e(", ".join(f"{k} ({v} samples)" for k, v in sorted(throttles.items())))
                             if throttles else "none") + "</p>")
        inner = (pages.power_tables(report, self.schedule) + "<section><h2>Last hour</h2>"
                 + ("".join(charts) or "<p>no telemetry recorded in the last hour</p>") + "</section>")
        return self._page(request, "Power", inner, extra="<h2>Power</h2>")

    def metrics_endpoint(self, request: Request) -> Response:
        if self.s.metrics_auth == "loopback":
            host = request.client.host if request.client else ""
            if not is_loopback(host):
                return PlainTextResponse("metrics are served to loopback clients only", status_code=403)
        elif (denied := self.check(request)) is not None:
            return denied
        if self.metrics is None:
            return PlainTextResponse("metrics are not available", status_code=503)
        return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)


def build_app(dash: Dashboard) -> Starlette:
    # Outermost first: a request for another Host is refused before anything else looks at it.
    middleware = [Middleware(HostCheck, allowed_hosts=allowed_hosts(dash.s), www_redirect=False),
                  Middleware(BodyLimit, max_bytes=dash.max_body_bytes)]
    return Starlette(middleware=middleware, routes=[
        Route("/", dash.index),
        Route("/jobs", dash.jobs),
        Route("/jobs/{job}", dash.job),
        Route("/jobs/{job}/samples/{step:int}/{name}", dash.sample_image),
        Route("/jobs/{job}/exports/{step:int}/{name:path}", dash.export_file),
        Route("/jobs/{job}/{verb}", dash.action, methods=["POST"]),
        Route("/submit", dash.submit_page, methods=["GET"]),
        Route("/submit", dash.submit, methods=["POST"]),
        Route("/power", dash.power),
        Route("/metrics", dash.metrics_endpoint),
    ])
