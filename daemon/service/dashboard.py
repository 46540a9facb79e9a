"""Start the dashboard inside the daemon: its token, read-only store view, metrics and listener, in one call."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.store import states
from daemon.web.auth import ensure_token


def start_dashboard(home: Path, cfg: Any, ctx: Any, log) -> Any:
    """The running WebListener, or None (disabled in the config, or its address unusable: said once, not fatal)."""
    if not cfg.web.enabled:
        return None
    # Imported here: a daemon with `web.enabled: false` never loads starlette, uvicorn or prometheus-client.
    from daemon.service import handlers
    from daemon.web import metrics
    from daemon.web.app import Dashboard, build_app
    from daemon.web.listener import WebListener
    from daemon.web.storeview import StoreView

    token = ensure_token(home, cfg.socket_group, log)
    view = StoreView(Path(home) / "state.db")

    def call(req: p.BaseModel) -> dict[str, Any]:
        return json.loads(handlers.dispatch(ctx, req))  # the socket verb's own handler and error mapping

    def health() -> dict[str, Any]:
        mirrors = getattr(ctx.supervisor, "mirrors", None)
        return {**handlers.ping(ctx, p.Ping()).wire(), "inbox_stuck": len(ctx.intake.stuck) if ctx.intake else 0,
                "mirrors": mirrors.statuses() if mirrors is not None else {}}

    dash = Dashboard(home, view, cfg.web, call, token, metrics.registry(view, health, Path(home) / "rejected"),
                     schedule=cfg.power.schedule.model_dump(), max_body_bytes=cfg.max_request_bytes,
                     mirror_lag=ctx.supervisor.mirrors.status if getattr(ctx.supervisor, "mirrors", None) else None)
    listener = WebListener(build_app(dash), cfg.web.listen, cfg.web.header_timeout_s)
    try:
        listener.start()
    except OSError as e:
        log.error("web_unavailable", listen=cfg.web.listen, error=str(e),
                  message="running without the dashboard; set web.listen to a free address")
        view.close()
        return None
    ctx.web_url = listener.url
    # The jobs that are training now are the pages people open first: read their histories in the background.
    live = [(r["id"], Path(r["workdir"])) for r in view.query(
        "SELECT id, workdir FROM jobs WHERE state IN (?, ?, ?) AND workdir IS NOT NULL",
        (states.RUNNING, states.PAUSED, states.INTERRUPTED))]
    threading.Thread(target=view.warm, args=(live,), name="web-warm", daemon=True).start()
    log.info("web", url=listener.url, token_file=str(Path(home) / "web.token"))
    return listener
