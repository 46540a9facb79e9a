"""The UPS, against a fake upsd on loopback speaking the NUT line protocol: OL → OB → LB → OL."""

from __future__ import annotations

import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from daemon.config.power import PowerSettings, UpsSettings
from daemon.power import simulated as sim
from daemon.power.policy import PowerPolicy
from daemon.power.run_policy import RunningJob
from daemon.power.simulated import SimulatedDevice
from daemon.power.ups import NutClient, NutError, UpsMonitor
from tests.helpers.fakes import RecLog


class FakeUpsd:
    """Enough of upsd for a client: GET VAR, LIST VAR, LIST UPS, LOGOUT, and ERR for the rest."""

    def __init__(self, ups: str = "myups"):
        self.ups, self.status = ups, "OL"
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.requests: list[str] = []
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.srv.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _vars(self):
        return {"ups.status": self.status, "battery.charge": "100" if self.status == "OL" else "40",
                "ups.model": 'Smart "UPS" 1500'}

    def _client(self, conn: socket.socket):
        f = conn.makefile("rwb")
        with conn:
            for raw in f:
                line = raw.decode().strip()
                self.requests.append(line)
                parts = line.split()
                if parts[:2] == ["GET", "VAR"] and len(parts) == 4:
                    if parts[2] != self.ups:
                        out = "ERR UNKNOWN-UPS"
                    elif parts[3] not in self._vars():
                        out = "ERR VAR-NOT-SUPPORTED"
                    else:
                        v = self._vars()[parts[3]].replace('"', '\\"')
                        out = f'VAR {self.ups} {parts[3]} "{v}"'
                elif parts[:2] == ["LIST", "VAR"] and len(parts) == 3 and parts[2] == self.ups:
                    body = [f'VAR {self.ups} {k} "{v.replace(chr(34), chr(92) + chr(34))}"' for k, v in self._vars().items()]
                    out = "\n".join([f"BEGIN LIST VAR {self.ups}", *body, f"END LIST VAR {self.ups}"])
                elif parts[:2] == ["LIST", "UPS"]:
                    out = f'BEGIN LIST UPS\nUPS {self.ups} "fake"\nEND LIST UPS'
                elif parts[:1] == ["LOGOUT"]:
                    f.write(b"OK Goodbye\n")
                    f.flush()
                    return
                else:
                    out = "ERR UNKNOWN-COMMAND"
                f.write(out.encode() + b"\n")
                f.flush()

    def close(self):
        self._stop = True
        self.srv.close()


@pytest.fixture
def upsd():
    u = FakeUpsd()
    yield u
    u.close()


def test_nut_client_reads_vars_and_reports_errors(upsd):
    c = NutClient("127.0.0.1", upsd.port, 2.0)
    assert c.get_var("myups", "ups.status") == "OL"
    v = c.list_vars("myups")
    assert v["ups.status"] == "OL" and v["ups.model"] == 'Smart "UPS" 1500'
    with pytest.raises(NutError, match="UNKNOWN-UPS"):
        c.get_var("other", "ups.status")
    c.close()


def _wait_for(pred, timeout: float, every: float = 0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = pred()
        if r:
            return r
        time.sleep(every)
    return None


def test_ol_ob_lb_ol_checkpoints_within_one_poll_stops_at_lb_and_resumes_after_ol_held(tmp_path: Path, upsd):
    poll = 0.2
    settings = PowerSettings(ups=UpsSettings(enabled=True, port=upsd.port, name="myups", poll_s=poll,
                                             resume_after_s=0.6, on_battery="lowest_cap"))
    dev = SimulatedDevice(1)
    log = RecLog()
    pol = PowerPolicy(settings, tmp_path, tmp_path / "state.db", log, device=dev)  # real poll thread
    job = RunningJob(job_id="j1", name="j1", pid=1, gpu=0, started_at=0.0, total=100, power={})
    running = [job]
    pol.on_job_start(job)

    def tick():
        return pol.tick(datetime.now(timezone.utc), running)

    assert _wait_for(lambda: pol.ups.connected, 2.0)
    d = tick()
    assert d.may_start and not d.checkpoint_now and d.stop_running is None

    # OB: a checkpoint is asked for within one poll interval (+ the supervisor's tick), exactly once
    upsd.status = "OB DISCHRG"
    t0 = time.monotonic()
    d = _wait_for(lambda: (lambda d: d if d.checkpoint_now else None)(tick()), 2.0, every=0.01)
    latency = time.monotonic() - t0
    assert d is not None and latency <= poll + 0.1, latency
    assert d.stop_running is None and not d.may_start  # lowest_cap: keep training, start nothing new
    assert dev.limit_w(0) == sim.MIN_W  # dropped to the lowest cap
    assert not tick().checkpoint_now  # once per outage

    # LB: clean stop of every job
    upsd.status = "OB LB"
    d = _wait_for(lambda: (lambda d: d if d.stop_running else None)(tick()), 2.0)
    assert d is not None and "low battery" in d.stop_running and not d.may_start
    running = []  # the supervisor stopped the trainer (exit 75, requeued)
    pol.on_job_end("j1", 75)

    # OL: nothing starts until it has been held for resume_after_s, then caps come back
    upsd.status = "OL CHRG"
    t_ol = time.monotonic()
    assert _wait_for(lambda: pol.ups.mode == "recovering", 2.0)
    assert not tick().may_start
    d = _wait_for(lambda: (lambda d: d if d.may_start else None)(tick()), 3.0)
    assert d is not None and time.monotonic() - t_ol >= 0.6
    assert dev.limit_w(0) == sim.DEFAULT_W
    pol.close()


def test_on_battery_pause_stops_jobs_and_a_flicker_to_ol_does_not_resume_early():
    clock = [0.0]
    m = UpsMonitor(UpsSettings(enabled=True, on_battery="pause", resume_after_s=60), RecLog(), clock=lambda: clock[0])
    m._update("OB", 0.0)
    a = m.advice(0.0)
    assert a.checkpoint_now and a.stop_reason and not a.may_start
    m._update("OL", 10.0)
    m._update("OB", 20.0)  # power fails again: a new outage, a new checkpoint
    assert m.advice(20.0).checkpoint_now
    m._update("OL", 30.0)
    assert not m.advice(89.0).may_start  # held 59 s
    assert m.advice(90.0).may_start  # held 60 s


def test_lost_ups_connection_is_reported_once_and_is_not_fatal(upsd):
    log = RecLog()
    m = UpsMonitor(UpsSettings(enabled=True, port=upsd.port, name="myups", timeout_s=0.5), log)
    m.poll_once()
    assert m.connected and m.status == "OL"
    upsd.close()
    m.client.close()
    for _ in range(3):
        m.poll_once()
    assert m.connected is False and m.status == "OL"  # the last known status stands
    assert len(log.named("UPS unreachable; keeping the last known status")) == 1
    assert any("UPS unreachable" in n for n in m.advice().notes)
    m.stop()
