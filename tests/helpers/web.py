"""A dashboard over a real store, real handlers and real intake, in-process (Starlette's TestClient)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from daemon.config.daemon import DaemonConfig
from daemon.config.web import WebSettings
from daemon.intake.accept import Intake
from daemon.service import handlers
from daemon.store.db import Store
from daemon.web.app import Dashboard, build_app
from daemon.web.auth import ensure_token
from daemon.web.storeview import StoreView
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import QUICKSTART_DATA
from tests.helpers.processes import REPO

BASE = "http://127.0.0.1:8742"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def step_line(step: int, loss: float, t: float, total: int = 10, **extra: Any) -> str:
    return json.dumps({"event": "step", "step": step, "total": total, "loss": loss, "lr": 0.001 * step,
                       "s_per_step": 0.5, "eta_s": 1.0, "ts": iso(t), "level": "info", **extra}) + "\n"


def quick_job_yaml(name: str = "webjob", steps: int = 10) -> str:
    return (f"name: {name}\nmodel:\n  family: causal_lm\n  path: builtin:tiny-llama\n  dtype: float32\n"
            f"data:\n  path: {QUICKSTART_DATA}\n  text_field: text\n  seq_len: 32\n"
            f"train:\n  steps: {steps}\n  batch_size: 2\n")


class Site:
    """home + store + intake + handlers + the dashboard; `app` for TestClient, `store` for arranging state."""

    def __init__(self, tmp: Path, **web: Any):
        self.home = tmp / "home"
        self.home.mkdir()
        self.cfg = DaemonConfig.model_validate({"allowed_roots": ["{home}", str(REPO)], "web": web})
        self.store = Store(self.home / "state.db")
        self.intake = Intake(self.home, self.cfg, self.store, RecLog())
        self.ctx = handlers.Context(home=self.home, store=self.store, intake=self.intake, supervisor=None,
                                    started_at=time.time(), socket_path=self.home / "lorad.sock")
        self.token = ensure_token(self.home)
        self.view = StoreView(self.home / "state.db")
        self.calls: list[str] = []

        def call(req):
            self.calls.append(req.verb)
            return json.loads(handlers.dispatch(self.ctx, req))

        self.dash = Dashboard(self.home, self.view, WebSettings.model_validate(web), call, self.token,
                              schedule=self.cfg.power.schedule.model_dump())
        self.app = build_app(self.dash)

    def add_job(self, name: str = "job", total: int = 10) -> str:
        jid = self.store.new_id(name)
        workdir = self.home / "jobs" / jid
        workdir.mkdir(parents=True)
        self.store.add_job(jid, name, workdir, 0, total, "submit:test")
        return jid

    def workdir(self, jid: str) -> Path:
        return self.home / "jobs" / jid

    def close(self) -> None:
        self.view.close()
        self.store.close()


def signed_in(client, token: str) -> None:
    """What a browser does with the URL `lorad web-url` prints: the token once, then the cookie."""
    r = client.get(f"/jobs?token={token}", follow_redirects=False)
    assert r.status_code == 303, r.text
