"""The dashboard over HTTP: token and session, CSRF, every page, every action through the socket handlers."""

from __future__ import annotations

import json
import re
import stat
import time

import pytest
from starlette.testclient import TestClient

from daemon.config.daemon import ConfigInvalid, load_config
from daemon.config.web import WebSettings
from daemon.power.telemetry import Sample
from daemon.power.telemetry_store import TelemetryStore
from daemon.store import states
from daemon.web import auth
from tests.helpers.web import BASE, Site, iso, quick_job_yaml, signed_in, step_line


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


@pytest.fixture
def client(site):
    with TestClient(site.app, base_url=BASE) as c:
        yield c


def csrf_of(page: str) -> str:
    return re.search(r"name=csrf value='([0-9a-f]+)'", page).group(1)


# ---------------------------------------------------------------- token, session, CSRF
def test_every_page_needs_the_token(site, client):
    for path in ("/", "/jobs", "/jobs/x", "/submit", "/power", "/metrics"):
        assert client.get(path).status_code == 401, path
    assert client.get("/jobs?token=wrong").status_code == 403
    assert client.get("/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 403
    forged = TestClient(site.app, base_url=BASE, cookies={auth.cookie_name(8742): "forged.0123"})
    assert forged.get("/jobs").status_code == 401
    assert client.post("/jobs/x/pause", data={"csrf": "x"}).status_code == 401


def test_the_token_is_sent_once_then_an_httponly_strict_cookie_is_kept(site, client):
    jid = site.add_job("alpha")
    r = client.get(f"/jobs?token={site.token}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/jobs"  # the token leaves the address bar
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    page = client.get("/jobs")  # the cookie alone now
    assert page.status_code == 200 and jid in page.text
    assert client.get("/jobs", headers={"Authorization": f"Bearer {site.token}"}).status_code == 200


def test_a_new_token_ends_every_session(site, client):
    signed_in(client, site.token)
    (site.home / "web.token").unlink()
    site.dash.token = auth.ensure_token(site.home)
    assert client.get("/jobs").status_code == 401


def test_token_file_is_private_and_kept_across_restarts(tmp_path):
    t1 = auth.ensure_token(tmp_path)
    assert stat.S_IMODE((tmp_path / "web.token").stat().st_mode) == 0o600
    assert auth.ensure_token(tmp_path) == t1 and len(t1) >= 32


def test_post_without_the_sessions_csrf_token_is_refused_and_changes_nothing(site, client):
    jid = site.add_job()
    signed_in(client, site.token)
    assert client.post(f"/jobs/{jid}/pause", data={}).status_code == 403
    assert client.post(f"/jobs/{jid}/pause", data={"csrf": "0" * 64}).status_code == 403
    other = TestClient(site.app, base_url=BASE)
    signed_in(other, site.token)
    foreign = csrf_of(other.get(f"/jobs/{jid}").text)  # another session's token is no good here
    assert client.post(f"/jobs/{jid}/pause", data={"csrf": foreign}).status_code == 403
    good = csrf_of(client.get(f"/jobs/{jid}").text)
    r = client.post(f"/jobs/{jid}/pause", data={"csrf": good}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    assert site.store.get(jid)["state"] == states.QUEUED and site.calls == []


# ---------------------------------------------------------------- actions: the socket verbs' handlers
def test_pause_resume_priority_cancel_go_through_the_socket_handlers(site, client):
    jid = site.add_job()
    signed_in(client, site.token)
    csrf = csrf_of(client.get(f"/jobs/{jid}").text)
    r = client.post(f"/jobs/{jid}/pause", data={"csrf": csrf}, headers={"Origin": BASE})
    assert r.status_code == 200 and "paused" in r.text and site.store.get(jid)["state"] == states.PAUSED
    assert "id=resume" in r.text and "id=pause" not in r.text
    client.post(f"/jobs/{jid}/resume", data={"csrf": csrf})
    assert site.store.get(jid)["state"] == states.QUEUED
    client.post(f"/jobs/{jid}/priority", data={"csrf": csrf, "priority": "7"})
    assert site.store.get(jid)["priority"] == 7
    r = client.post(f"/jobs/{jid}/resume", data={"csrf": csrf})
    assert "refused: job" in r.text and "not paused" in r.text  # the handler's own words
    client.post(f"/jobs/{jid}/cancel", data={"csrf": csrf})
    assert site.store.get(jid)["state"] == states.CANCELLED
    assert site.calls == ["pause", "resume", "priority", "resume", "cancel"]


def test_a_pause_button_pressed_on_a_page_the_job_has_moved_on_from_is_refused(site, client):
    jid = site.add_job()
    signed_in(client, site.token)
    page = client.get(f"/jobs/{jid}").text
    assert "name=expect value='queued'" in page
    site.store.begin_attempt(jid, 0)  # it started while the page was open
    r = client.post(f"/jobs/{jid}/pause", data={"csrf": csrf_of(page), "expect": "queued"}, headers={"Origin": BASE})
    assert "refused: job" in r.text and "running now, not queued" in r.text
    job = site.store.get(jid)
    assert job["state"] == states.RUNNING and job["requested"] is None  # not stopped on a stale look


def test_a_script_with_the_bearer_token_needs_no_csrf(site, client):
    jid = site.add_job()
    r = client.post(f"/jobs/{jid}/pause", headers={"Authorization": f"Bearer {site.token}"})
    assert r.status_code == 200 and site.store.get(jid)["state"] == states.PAUSED


def test_bad_priority_is_a_message_not_an_error(site, client):
    jid = site.add_job()
    signed_in(client, site.token)
    csrf = csrf_of(client.get(f"/jobs/{jid}").text)
    r = client.post(f"/jobs/{jid}/priority", data={"csrf": csrf, "priority": "5000"})
    assert "priority must be a whole number" in r.text and site.store.get(jid)["priority"] == 0


# ---------------------------------------------------------------- submit
def test_submit_pasted_yaml_queues_the_job(site, client):
    signed_in(client, site.token)
    csrf = csrf_of(client.get("/submit").text)
    r = client.post("/submit", data={"csrf": csrf, "text": quick_job_yaml("pasted")})
    assert r.status_code == 200 and "accepted" in r.text
    (job,) = site.store.jobs()
    assert job["name"] == "pasted" and job["source"] == "submit:web.yaml"


def test_submit_uploaded_file(site, client):
    signed_in(client, site.token)
    csrf = csrf_of(client.get("/submit").text)
    r = client.post("/submit", data={"csrf": csrf},
                    files={"file": ("my job.yaml", quick_job_yaml("uploaded").encode(), "application/yaml")})
    assert r.status_code == 200
    assert [j["name"] for j in site.store.jobs()] == ["uploaded"]
    assert site.store.jobs()[0]["source"] == "submit:my_job.yaml"


def test_submit_shows_the_validators_error_next_to_the_key_it_names(site, client):
    signed_in(client, site.token)
    csrf = csrf_of(client.get("/submit").text)
    text = quick_job_yaml().replace("  batch_size: 2\n", "  batch_size: 2\n  stepz: 4\n")
    r = client.post("/submit", data={"csrf": csrf, "text": text})
    assert r.status_code == 400 and site.store.jobs() == []
    marked = re.search(r"<span class=bad><i class=lineno>(\d+)</i>(.*?)<span class=why>(.*?)</span>", r.text)
    assert marked is not None
    line_no, line, why = marked.groups()
    assert text.splitlines()[int(line_no) - 1] == "  stepz: 4" and "stepz" in line
    assert "train.stepz: unknown key" in why and "did you mean train.steps" in why


def test_submit_refuses_without_csrf(site, client):
    signed_in(client, site.token)
    assert client.post("/submit", data={"text": quick_job_yaml()}).status_code == 403
    assert site.store.jobs() == []


# ---------------------------------------------------------------- pages
def test_jobs_page_shows_state_progress_loss_speed_eta_power(site, client):
    a, b = site.add_job("alpha", total=200), site.add_job("beta")
    site.store.transition(a, states.QUEUED, states.RUNNING, "test", gpu=0)
    site.store.update(a, step=50, loss=1.25, s_per_step=0.4, eta_s=60.0)
    ts = TelemetryStore(site.home / "state.db")
    ts.add_job_energy(a, "Sim", True, energy_j=5000.0, seconds=20.0, steps=50, limit_w=300)
    ts.close()
    signed_in(client, site.token)
    page = client.get("/jobs").text
    row = re.search(rf"<tr data-job='{a}'>(.*?)</tr>", page).group(1)
    for want in ("running", "width:25.0%", "50/200", "1.25", "0.400", "1m00s", ">250<", ">100.0<"):
        assert want in row, want
    assert f"data-job='{b}'" in page
    live = client.get("/jobs?live=1").text  # what the page's script fetches: the table alone
    assert live.startswith("<table id='jobs'>") and "<html" not in live


def test_job_page_draws_one_point_per_reported_step_and_the_rest(site, client):
    jid = site.add_job("curves")
    wd = site.workdir(jid)
    t0 = time.time() - 100
    with open(wd / "events.jsonl", "w") as f:
        for s in range(1, 7):
            f.write(step_line(s, 2.0 - s * 0.1, t0 + s))
        f.write(json.dumps({"event": "checkpoint_committed", "step": 4, "path": "/x/step-00000004", "seconds": 0.2,
                            "ts": iso(t0 + 4)}) + "\n")
        for s in range(5, 9):  # a resume from step 4 reports 5 and 6 again: the last report of a step wins
            f.write(step_line(s, 1.0, t0 + 10 + s))
        f.write('{"event": "samples", "step": 8, "paths": ["/p/00.png", "/p/01.png"], "prompts": ["a cat", "a dog"]}\n')
        f.write('{"event": "step", "step": 9, "lo')  # a torn last line
    sample_dir = wd / "samples" / "step-00000008"
    sample_dir.mkdir(parents=True)
    (sample_dir / "00.png").write_bytes(b"\x89PNG fake")
    ts = TelemetryStore(site.home / "state.db")
    ts.add_samples([Sample(ts=t0 + 10 + s, gpu=0, power_w=200.0 + s, energy_mj=None, energy_source="x", sm_mhz=1000,
                           mem_mhz=5000, temp_c=60, util_gpu=90, util_mem=50, limit_w=300, throttle=[],
                           simulated=True) for s in range(5, 9)], {0: jid})
    ts.close()
    site.store.begin_attempt(jid, 0)
    signed_in(client, site.token)
    page = client.get(f"/jobs/{jid}").text
    loss = re.search(r'id="chart-loss".*?<polyline [^>]*data-points="(\d+)"[^>]*points="([^"]*)"', page)
    assert loss.group(1) == "8" and len(loss.group(2).split()) == 8
    watts = re.search(r'id="chart-watts".*?data-points="(\d+)"', page).group(1)
    assert watts == "4"  # W only where a telemetry sample lies near the step
    assert re.search(r'id="chart-jps".*?data-points="4"', page)
    assert "<h2>Samples</h2>" in page and "a cat" in page and f"/jobs/{jid}/samples/8/00.png" in page
    assert "id=checkpoints" in page and "<td class=num>4</td>" in page
    assert "id=attempts" in page and "running" in page
    assert "id=pause" in page and "id=cancel" in page
    assert client.get(f"/jobs/{jid}/samples/8/00.png").content == b"\x89PNG fake"
    assert client.get(f"/jobs/{jid}/samples/8/..%2F..%2Fjob.png").status_code == 404
    assert client.get(f"/jobs/{jid}/samples/8/missing.png").status_code == 404
    assert client.get("/jobs/nope").status_code == 404


def steps_of(h) -> list[int]:
    return [s for s, _ in h.loss]


def test_events_are_read_incrementally(site):
    jid = site.add_job()
    wd = site.workdir(jid)
    (wd / "events.jsonl").write_text(step_line(1, 1.0, 1.0))
    h = site.view.series(jid, wd)
    assert steps_of(h) == [1] and h.read == h.size == len(step_line(1, 1.0, 1.0))
    with open(wd / "events.jsonl", "a") as f:
        f.write(step_line(2, 0.9, 2.0) + '{"event": "step", "st')
    assert steps_of(site.view.series(jid, wd)) == [1, 2]  # the line being written is not taken yet
    with open(wd / "events.jsonl", "a") as f:
        f.write('ep": 3, "loss": 0.8}\n')  # the torn line completes
    assert steps_of(site.view.series(jid, wd)) == [1, 2, 3]


def test_a_line_torn_by_a_kill_costs_only_that_line(site):
    jid = site.add_job()
    wd = site.workdir(jid)
    # killed mid-write at step 2: the resumed engine starts a new line after the torn one
    (wd / "events.jsonl").write_text(step_line(1, 1.0, 1.0) + '{"event": "step", "st\n' + step_line(3, 0.8, 3.0))
    assert steps_of(site.view.series(jid, wd)) == [1, 3]


def test_warming_reads_a_history_so_the_first_view_reads_nothing_more(site):
    jid = site.add_job()
    wd = site.workdir(jid)
    (wd / "events.jsonl").write_text("".join(step_line(i, 1.0 / i, float(i)) for i in range(1, 51)))
    site.view.warm([(jid, wd)])
    warmed = site.view.series(jid, wd, most_bytes=0)  # a view that may read nothing finds it all read
    assert warmed.reported == 50 and warmed.read == (wd / "events.jsonl").stat().st_size


def test_a_long_backlog_is_read_on_a_thread_while_the_page_shows_what_is_read(site, client, monkeypatch):
    from daemon.web import storeview

    monkeypatch.setattr(storeview, "PAGE_READ_BYTES", 4096)
    monkeypatch.setattr(storeview, "CATCH_UP_BYTES", 4096)
    jid = site.add_job("backlog", total=2000)
    wd = site.workdir(jid)
    (wd / "events.jsonl").write_text("".join(step_line(i, 1.0 / i, float(i), total=2000) for i in range(1, 2001)))
    signed_in(client, site.token)
    page = client.get(f"/jobs/{jid}").text
    assert "Reading this job's history" in page and 'data-reported="2000"' not in page
    deadline = time.monotonic() + 20
    while "Reading this job's history" in page and time.monotonic() < deadline:
        time.sleep(0.05)
        page = client.get(f"/jobs/{jid}?live=1").text
    assert 'data-reported="2000"' in page and "Reading this job's history" not in page


def test_power_page_and_schedule(tmp_path):
    site = Site(tmp_path)
    site.dash.schedule = {"timezone": "UTC", "run_windows": [{"days": "mon-fri", "start": "22:00", "end": "06:00"}],
                          "caps": [{"days": "*", "start": "08:00", "end": "18:00", "limit_w": 200}]}
    ts = TelemetryStore(site.home / "state.db")
    now = time.time()
    ts.add_samples([Sample(ts=now - 120 + 10 * i, gpu=0, power_w=250.0, energy_mj=None, energy_source="x", sm_mhz=1500,
                           mem_mhz=5000, temp_c=70, util_gpu=99, util_mem=40, limit_w=300,
                           throttle=["sw_power_cap"] if i % 2 else [], simulated=True) for i in range(10)])
    ts.close()
    with TestClient(site.app, base_url=BASE) as c:
        signed_in(c, site.token)
        page = c.get("/power").text
    site.close()
    assert 'id="gpu0-power"' in page and 'data-points="10"' in page
    assert "sw_power_cap (5 samples)" in page
    assert "power features are not running" in page  # no policy in this daemon: the handler says so
    assert "22:00" in page and ">200<" in page


# ---------------------------------------------------------------- metrics
def test_metrics_reads_the_store_at_scrape_time(tmp_path):
    from daemon.web.metrics import registry

    site = Site(tmp_path)
    jid = site.add_job("m", total=100)
    site.store.transition(jid, states.QUEUED, states.RUNNING, "test", gpu=0)
    site.store.update(jid, step=10, loss=0.5, s_per_step=0.25, eta_s=22.5)
    t = time.time()
    (site.workdir(jid) / "events.jsonl").write_text(
        json.dumps({"event": "checkpoint_committed", "step": 8, "ts": iso(t - 30)}) + "\n")
    ts = TelemetryStore(site.home / "state.db")
    ts.add_samples([Sample(ts=t, gpu=0, power_w=222.0, energy_mj=None, energy_source="x", sm_mhz=1400, mem_mhz=5000,
                           temp_c=66, util_gpu=97, util_mem=40, limit_w=280, throttle=["sw_power_cap"],
                           simulated=True)], {0: jid})
    ts.add_job_energy(jid, "Sim", True, energy_j=3600.0, seconds=10.0, steps=10, limit_w=280)
    ts.close()
    (site.home / "rejected" / "bad.yaml.error.txt").write_text("x")
    site.dash.metrics = registry(site.view, lambda: {"uptime_s": 12.0, "running": 1, "inbox_stuck": 2},
                                 site.home / "rejected")
    with TestClient(site.app, base_url=BASE) as c:
        assert c.get("/metrics").status_code == 401
        text = c.get("/metrics", headers={"Authorization": f"Bearer {site.token}"}).text
    site.close()
    lab = f'job="{jid}",name="m"'
    for line in ['lorad_jobs{state="running"} 1.0', 'lorad_jobs{state="failed"} 0.0', f"lorad_job_step{{{lab}}} 10.0",
                 f"lorad_job_loss{{{lab}}} 0.5", f"lorad_job_seconds_per_step{{{lab}}} 0.25",
                 f"lorad_job_power_watts{{{lab}}} 222.0", f"lorad_job_joules_per_step{{{lab}}} 360.0",
                 f"lorad_job_energy_kwh{{{lab}}} 0.001", 'lorad_gpu_power_watts{gpu="0"} 222.0',
                 'lorad_gpu_power_limit_watts{gpu="0"} 280.0', 'lorad_gpu_throttle{gpu="0",reason="sw_power_cap"} 1.0',
                 "lorad_inbox_rejected_files 1.0", "lorad_inbox_stuck_files 2.0", "lorad_up 1.0",
                 "lorad_store_readable 1.0"]:
        assert line in text, line
    age = float(re.search(rf"lorad_job_seconds_since_checkpoint{{{lab}}} ([\d.]+)", text).group(1))
    assert 29 <= age < 60


def test_metrics_loopback_only_when_configured(tmp_path):
    site = Site(tmp_path, metrics_auth="loopback")
    from daemon.web.metrics import registry

    site.dash.metrics = registry(site.view, lambda: {}, site.home / "rejected")
    with TestClient(site.app, base_url=BASE, client=("127.0.0.1", 5000)) as c:
        assert c.get("/metrics").status_code == 200 and "lorad_up 1.0" in c.get("/metrics").text
    with TestClient(site.app, base_url=BASE, client=("10.1.2.3", 5000)) as c:
        assert c.get("/metrics", headers={"Authorization": f"Bearer {site.token}"}).status_code == 403
    site.close()


# ---------------------------------------------------------------- config
def test_web_config_is_strict(tmp_path):
    assert WebSettings().listen == "127.0.0.1:8742" and WebSettings().enabled
    with pytest.raises(ValueError, match="allow_remote"):
        WebSettings(listen="0.0.0.0:8742")
    assert WebSettings(listen="0.0.0.0:8742", allow_remote=True).host_port() == ("0.0.0.0", 8742)
    assert WebSettings(listen="[::1]:9000").host_port() == ("::1", 9000)
    for bad in ("8742", "localhost:http", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            WebSettings(listen=bad)
    cfg = tmp_path / "d.yaml"
    cfg.write_text("web:\n  listn: 127.0.0.1:1\n")
    with pytest.raises(ConfigInvalid, match="web.listn"):
        load_config(cfg)


def test_a_long_job_is_drawn_thinned_with_its_true_count(site, client):
    jid = site.add_job("long", total=5000)
    with open(site.workdir(jid) / "events.jsonl", "w") as f:
        for s in range(1, 5001):
            f.write(step_line(s, 1.0 / s, 1000.0 + s, total=5000))
    signed_in(client, site.token)
    page = client.get(f"/jobs/{jid}").text
    drawn, reported = map(int, re.search(r'id="chart-loss".*?data-points="(\d+)" data-reported="(\d+)"', page).groups())
    assert reported == 5000 and 500 <= drawn <= 1001


def test_the_listener_does_not_hold_small_responses_back_for_acks(site):
    """uvicorn writes a response's head and body separately: with Nagle on, every page waited ~40 ms for the
    client's delayed ACK (bench/web_pages.py: /submit 48 ms → 4 ms). Accepted sockets inherit TCP_NODELAY."""
    import socket as so
    import urllib.request

    from daemon.web.app import build_app
    from daemon.web.listener import WebListener

    web = WebListener(build_app(site.dash), "127.0.0.1:0")
    web.start()
    try:
        assert web.sock.getsockopt(so.IPPROTO_TCP, so.TCP_NODELAY) != 0
        req = urllib.request.Request(f"{web.url}submit", headers={"Authorization": f"Bearer {site.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    finally:
        web.close()


def test_the_view_reads_a_store_no_daemon_has_open_and_never_writes_it(tmp_path):
    import sqlite3

    from daemon.store.db import Store
    from daemon.web.storeview import StoreView

    store = Store(tmp_path / "state.db")
    store.add_job("a-1", "a", tmp_path, 0, 5, "test")
    store.close()  # as after a clean stop: no -wal / -shm files left
    view = StoreView(tmp_path / "state.db")
    assert [j["id"] for j in view.jobs()] == ["a-1"]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        view.query("DELETE FROM jobs")
    view.close()


def test_the_session_cookie_is_bound_to_the_dashboards_port_so_two_on_one_host_keep_their_own(tmp_path):
    # A browser keeps one cookie per (host, path, name), whatever the port: two users' dashboards on 127.0.0.1
    # under one name overwrote each other's session (and each was sent the other's).
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    sites = [Site(tmp_path / "a"), Site(tmp_path / "b")]
    try:
        jar: dict[str, str] = {}
        for port, s in zip((8742, 8743), sites, strict=True):
            with TestClient(s.app, base_url=f"http://127.0.0.1:{port}") as c:
                r = c.get(f"/jobs?token={s.token}", follow_redirects=False)
                assert r.status_code == 303
                jar.update(r.cookies)  # what the browser's jar for 127.0.0.1 holds, by name
        assert sorted(jar) == [auth.cookie_name(8742), auth.cookie_name(8743)]
        for port, s in zip((8742, 8743), sites, strict=True):
            with TestClient(s.app, base_url=f"http://127.0.0.1:{port}", cookies=jar) as c:
                assert c.get("/jobs").status_code == 200, port  # each still signed in to its own
    finally:
        for s in sites:
            s.close()
