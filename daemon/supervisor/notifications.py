"""Notifications when a job ends or a checkpoint is slow: a webhook (JSON POST) and/or a command.

The supervisor calls `emit()`, which only puts the event on a bounded queue:
one worker thread delivers, with a timeout per try and a few retries with
backoff, so a dead webhook or a hung command never delays the service loop.
A failure is logged once per cause (not once per event) and is never fatal.
(daemon/system/notify.py is something else: systemd's sd_notify.)

The command runs without a shell, as the daemon's user, with the event in its
environment (LORAD_EVENT, LORAD_JOB, ..., and all of it as JSON in
LORAD_EVENT_JSON). It comes from the daemon config, never from a job file.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from daemon.config.notify import NotifySettings
from daemon.supervisor.exit_policy import HELD_FOR_REVIEW

QUEUE_MAX = 1000
BACKOFF_MAX_S = 30.0


def event_of_exit(state: str, reason: str) -> str | None:
    """The notification for a job's new state after its trainer exited (None: nothing to tell)."""
    if state in ("succeeded", "failed"):
        return state
    if state == "interrupted" and reason.startswith("policy"):
        return "stopped_by_power"  # a schedule window, a planned outage, the UPS
    if state == "paused" and reason == HELD_FOR_REVIEW:
        return "captions_ready"  # data.captioner.hold_for_review: a person's turn (lorad resume)
    return None


class Notifications:
    def __init__(self, settings: NotifySettings, log, sleep=time.sleep):
        self.s = settings
        self.log = log
        self.sleep = sleep
        self.q: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_MAX)
        self.failed_causes: set[tuple[str, str]] = set()
        self.delivered = 0
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname()

    @property
    def active(self) -> bool:
        return bool(self.s.on) and (self.s.webhook_url is not None or self.s.command is not None)

    def emit(self, event: str, job_id: str, name: str | None = None, **detail: Any) -> None:
        """Queue one event for delivery; returns at once, whatever the webhook or command does."""
        if not self.active or event not in self.s.on:
            return
        payload = {"event": event, "job": job_id, "name": name, "host": self._host,
                   "ts": datetime.now(timezone.utc).isoformat(), **detail}
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
            self._thread.start()
        try:
            self.q.put_nowait(payload)
        except queue.Full:
            self._failed("queue", "full", f"more than {QUEUE_MAX} notifications waiting; dropping {event}")

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued for at most `timeout_s`, then stop (the thread is a daemon thread)."""
        if self._thread is None:
            return
        try:
            self.q.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    # ---------------------------------------------------------------- delivery (worker thread)
    def _run(self) -> None:
        while True:
            payload = self.q.get()
            if payload is None:
                return
            if self.s.webhook_url is not None:
                self._with_retries("webhook", payload, self._post)
            if self.s.command is not None:
                self._with_retries("command", payload, self._command)

    def _with_retries(self, channel: str, payload: dict[str, Any], send) -> None:
        cause = "?"
        for attempt in range(self.s.retries + 1):
            if attempt:
                self.sleep(min(BACKOFF_MAX_S, 2.0 ** (attempt - 1)))
            try:
                cause = send(payload)
            except Exception as e:  # noqa: BLE001 — a notification must never take the daemon down
                cause = f"{type(e).__name__}: {e}"
            if cause is None:
                self.delivered += 1
                return
        self._failed(channel, cause, f"{payload['event']} of {payload['job']} not delivered after "
                                     f"{self.s.retries + 1} tries")

    def _failed(self, channel: str, cause: str, message: str) -> None:
        key = (channel, cause)
        if key in self.failed_causes:
            return  # said once already: a webhook that is down would otherwise fill the journal
        self.failed_causes.add(key)
        self.log.warning("notify_failed", channel=channel, cause=cause, message=message)

    def _post(self, payload: dict[str, Any]) -> str | None:
        assert self.s.webhook_url is not None
        req = urllib.request.Request(self.s.webhook_url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "lorad"})
        try:
            with urllib.request.urlopen(req, timeout=self.s.timeout_s) as r:
                return None if 200 <= r.status < 300 else f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return f"{type(reason).__name__}: {reason}"

    def _command(self, payload: dict[str, Any]) -> str | None:
        # Reasons and names can carry text a job's code wrote: the command sees them as plain, bounded text.
        payload = {k: env_text(v, MAX_ENV_VALUE) if isinstance(v, str) else v for k, v in payload.items()}
        env = {**os.environ, "LORAD_EVENT_JSON": json.dumps(payload)}
        for k, v in payload.items():
            if v is not None and not isinstance(v, (dict, list)):
                env[f"LORAD_{k.upper()}"] = env_text(str(v), MAX_ENV_VALUE)
        argv = self.s.argv()
        assert argv
        try:
            p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            return f"cannot run {argv[0]}: {e.strerror}"
        try:
            _, err = p.communicate(timeout=self.s.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the command and whatever it started
            p.communicate()
            return f"timed out after {self.s.timeout_s} s"
        if p.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            return f"exit {p.returncode}" + (f": {tail[0][:200]}" if tail else "")
        return None


MAX_ENV_VALUE = 1024  # characters of one LORAD_* value the command sees
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def env_text(text: str, limit: int) -> str:
    """One line of at most `limit` characters: control characters (newlines, escapes, NUL, which exec refuses)
    become a space, so a job's text cannot forge lines in a log the command writes or break its exec."""
    text = _CONTROL.sub(" ", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
