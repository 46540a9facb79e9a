"""Notifications: a webhook POST and a command per job event, delivered off the supervisor's thread."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from daemon.config.notify import NotifySettings
from daemon.supervisor.notifications import Notifications, event_of_exit
from tests.helpers.fakes import RecLog


class Hook:
    """A local HTTP server that records POSTed JSON; `status` is what it answers, `delay` how long it stalls."""

    def __init__(self, status: int = 200, delay: float = 0.0):
        self.got: list[dict] = []
        self.hits = 0
        hook = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                hook.hits += 1
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(hook.delay)
                if hook.status == 200:
                    hook.got.append(json.loads(body))
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.status, self.delay = status, delay
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_webhook_gets_the_event_as_json(hook):
    n = Notifications(NotifySettings(webhook_url=hook.url), RecLog())
    n.emit("succeeded", "job-1a2b", "job", state="succeeded", step=300, total=300)
    n.close()
    (got,) = hook.got
    assert got["event"] == "succeeded" and got["job"] == "job-1a2b" and got["name"] == "job" and got["step"] == 300
    assert got["host"] and got["ts"]


def test_command_runs_with_the_event_in_its_environment(tmp_path):
    out = tmp_path / "said.txt"
    script = f"import os; open({str(out)!r}, 'a').write(os.environ['LORAD_EVENT'] + ' ' + os.environ['LORAD_JOB'] " \
             f"+ ' ' + os.environ['LORAD_REASON'] + '\\n')"
    n = Notifications(NotifySettings(command=[sys.executable, "-c", script]), RecLog())
    n.emit("stopped_by_power", "j-1", "j", reason="policy:ups on battery")
    n.emit("failed", "j-2", "j", reason="retry budget spent")
    n.close()
    assert out.read_text().splitlines() == ["stopped_by_power j-1 policy:ups on battery", "failed j-2 retry budget spent"]


def test_events_not_asked_for_are_not_sent(hook):
    n = Notifications(NotifySettings(webhook_url=hook.url, on=["failed"]), RecLog())
    n.emit("succeeded", "a", "a")
    n.emit("failed", "b", "b")
    n.close()
    assert [g["job"] for g in hook.got] == ["b"]


def test_a_dead_webhook_is_retried_then_logged_once_per_cause_and_never_blocks():
    bad = Hook(status=503)
    log, slept = RecLog(), []
    n = Notifications(NotifySettings(webhook_url=bad.url, retries=2), log, sleep=slept.append)
    t0 = time.monotonic()
    for i in range(3):
        n.emit("failed", f"j-{i}", "j")
    assert time.monotonic() - t0 < 0.05  # emit only queues
    n.close()
    bad.close()
    assert bad.hits == 9 and slept == [1.0, 2.0] * 3  # 1 try + 2 retries per event, backoff 1 s then 2 s
    assert log.named("notify_failed") == [{"channel": "webhook", "cause": "HTTP 503",
                                           "message": "failed of j-0 not delivered after 3 tries"}]


def test_a_hung_command_is_killed_at_its_timeout_and_a_missing_one_is_reported(tmp_path):
    log = RecLog()
    n = Notifications(NotifySettings(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5,
                                     retries=0), log)
    t0 = time.monotonic()
    n.emit("failed", "j", "j")
    n.close(timeout_s=10)
    assert time.monotonic() - t0 < 5
    assert log.named("notify_failed")[0]["cause"] == "timed out after 0.5 s"
    log2 = RecLog()
    n2 = Notifications(NotifySettings(command=str(tmp_path / "nope"), retries=0), log2)
    n2.emit("failed", "j", "j")
    n2.close()
    assert "cannot run" in log2.named("notify_failed")[0]["cause"]


def test_a_slow_webhook_times_out():
    slow = Hook(delay=2.0)
    log = RecLog()
    n = Notifications(NotifySettings(webhook_url=slow.url, timeout_s=0.3, retries=0), log)
    n.emit("failed", "j", "j")
    n.close()
    slow.close()
    assert "timed out" in log.named("notify_failed")[0]["cause"]


def test_which_exits_notify():
    assert event_of_exit("succeeded", "finished") == "succeeded"
    assert event_of_exit("failed", "retry budget spent") == "failed"
    assert event_of_exit("interrupted", "policy:window closed") == "stopped_by_power"
    assert event_of_exit("interrupted", "shutdown") is None
    assert event_of_exit("paused", "paused by the user") is None


def test_notify_config_is_strict():
    with pytest.raises(ValidationError, match="on"):
        NotifySettings(on=["succeded"])
    with pytest.raises(ValidationError, match="webhook_url"):
        NotifySettings(webhook_url="file:///etc/passwd")
    with pytest.raises(ValidationError, match="command"):
        NotifySettings(command="  ")
    assert NotifySettings(command="notify-send 'lorad job'").argv() == ["notify-send", "lorad job"]
    assert not Notifications(NotifySettings(), RecLog()).active


def test_the_yaml_key_on_is_read_as_on_not_as_true(tmp_path):
    from daemon.config.daemon import load_config

    cfg = tmp_path / "d.yaml"
    cfg.write_text("notify:\n  command: [/bin/true]\n  on: [failed]\n")
    assert load_config(cfg).notify.on == ["failed"]


def test_the_command_sees_job_text_as_one_bounded_line_without_control_characters(tmp_path):
    out = tmp_path / "env.json"
    script = f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"
    n = Notifications(NotifySettings(command=[sys.executable, "-c", script]), RecLog())
    n.emit("failed", "j-1", "j", reason="boom\nFAKE: all good\x1b[2J\x00" + "x" * 5000)
    n.close()
    env = json.loads(out.read_text())
    assert env["LORAD_REASON"].startswith("boom FAKE: all good ") and len(env["LORAD_REASON"]) == 1024
    assert "\n" not in env["LORAD_REASON"] and "\x1b" not in env["LORAD_REASON"] and "\x00" not in env["LORAD_REASON"]
    assert json.loads(env["LORAD_EVENT_JSON"])["reason"] == env["LORAD_REASON"]  # the same text, as valid JSON
