"""The power helper (daemon/power/helper.py), the only root part of lorad: it sets a limit within the GPU's
constraints or restores the default, for one user alone, and puts back every GPU it changed when it stops.

Against the simulated device (no NVML here), on real Unix sockets; the second user is a forked child that
drops to `nobody` (root only). Fuzzed like the daemon's socket (tests/daemon/service/test_socket_bounds.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from daemon.power import helper as helper_mod
from daemon.power.simulated import DEFAULT_W, MAX_W, MIN_W, SimulatedDevice
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.processes import REPO, child_env
from tests.helpers.sockets import ask, ask_as, connect, reachable_dir

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root to become")


class Helper:
    """`helper.run` on a thread: the simulated device it caps, its socket, its state file, its log."""

    def __init__(self, where: Path, device: SimulatedDevice, state: Path | None = None):
        self.device, self.log, self.stop = device, RecLog(), threading.Event()
        self.socket, self.state = where / "power.sock", state or where / "changed.json"
        self.thread = threading.Thread(target=helper_mod.run, args=(
            device, self.socket, self.state, os.getuid(), os.getgid(), self.log, self.stop))
        self.thread.start()
        wait_until(self.socket.exists, 10, "the helper's socket")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def open_dir():
    yield from reachable_dir("lorad-power-")


@pytest.fixture
def helper(open_dir):
    h = Helper(open_dir, SimulatedDevice(2))
    yield h
    h.close()


def closed(c: socket.socket) -> bool:
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True  # closed with the rest of a huge line unread


def test_set_limit_within_the_constraints_and_restore_default(helper):
    c = connect(helper.socket)
    assert ask(c, b'{"op": "set-limit", "gpu": 1, "watts": 250}\n') == {"ok": True, "gpu": 1, "limit_w": 250.0}
    assert helper.device.limit_w(1) == 250.0 and helper.device.limit_w(0) == DEFAULT_W
    assert json.loads(helper.state.read_text()) == {"changed": [1]}  # what a crashed helper's successor restores
    assert ask(c, b'{"op": "restore-default", "gpu": 1}\n') == {"ok": True, "gpu": 1, "limit_w": DEFAULT_W}
    assert helper.device.limit_w(1) == DEFAULT_W and json.loads(helper.state.read_text()) == {"changed": []}


@pytest.mark.parametrize("request_line, why", [
    (f'{{"op": "set-limit", "gpu": 0, "watts": {MIN_W - 1}}}', "outside its limits"),
    (f'{{"op": "set-limit", "gpu": 0, "watts": {MAX_W + 1}}}', "outside its limits"),
    ('{"op": "set-limit", "gpu": 2, "watts": 200}', "no GPU 2"),
    ('{"op": "restore-default", "gpu": 7}', "no GPU 7"),
])
def test_a_limit_outside_the_constraints_or_a_missing_gpu_is_refused_not_clamped(helper, request_line, why):
    c = connect(helper.socket)
    reply = ask(c, request_line.encode() + b"\n")
    assert reply["ok"] is False and why in reply["error"], reply
    assert [helper.device.limit_w(g) for g in (0, 1)] == [DEFAULT_W, DEFAULT_W]
    assert ask(c, b'{"op": "set-limit", "gpu": 0, "watts": 200}\n')["ok"]  # a refusal, not a broken connection


@pytest.mark.parametrize("line", [
    b"\xff\xfe garbage \x00\n",
    b"not json at all\n",
    b"[1, 2, 3]\n",
    b"[" * 500 + b"]" * 500 + b"\n",  # deeper than pydantic's nesting cap, within the line size
    b'{"op": "set-limit", "gpu": 0, "watts": ' + b"[" * 400 + b"]" * 400 + b"}\n",
    b'{"op": "reboot", "gpu": 0}\n',
    b'{"op": "set-limit", "gpu": true, "watts": 200}\n',
    b'{"op": "set-limit", "gpu": 0, "watts": "200"}\n',
    b'{"op": "set-limit", "gpu": 0, "watts": NaN}\n',
    b'{"op": "set-limit", "gpu": -1, "watts": 200}\n',
    b'{"op": "set-limit", "gpu": 0, "watts": 1e308}\n',
    b'{"op": "set-limit", "gpu": 0, "watts": 200, "persist": true}\n',
    b"x" * 5000 + b"\n",
    b"{" + b" " * 2_000_000,  # a huge line without an end: read no further than the bound
])
def test_a_malformed_request_gets_one_error_and_the_connection_closed_and_the_helper_goes_on(helper, line):
    c = connect(helper.socket)
    reply = ask(c, line)
    assert reply["ok"] is False and reply["error"].startswith("bad request"), reply
    assert closed(c)
    assert [helper.device.limit_w(g) for g in (0, 1)] == [DEFAULT_W, DEFAULT_W]
    assert ask(connect(helper.socket), b'{"op": "set-limit", "gpu": 0, "watts": 300}\n')["ok"]
    assert not helper.log.named("power helper connection error")


def test_a_silent_or_partial_client_is_cut_off_and_idle_ones_cannot_hold_more_than_their_slots(helper, monkeypatch):
    monkeypatch.setattr(helper_mod._Handler, "timeout", 0.3)
    partial = connect(helper.socket)
    partial.sendall(b'{"op": "set-')
    assert closed(partial)  # after the timeout, without an answer
    trickle = connect(helper.socket)
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for byte in b'{"op": "restore-default", "gpu": 0}':  # a byte every 0.1 s: one deadline for the line
            trickle.sendall(bytes([byte]))
            time.sleep(0.1)
    assert time.monotonic() - t0 < 2
    monkeypatch.setattr(helper_mod._Handler, "timeout", 5.0)
    held = [connect(helper.socket) for _ in range(helper_mod.MAX_CLIENTS)]
    try:
        assert "busy" in ask(connect(helper.socket), b'{"op": "restore-default", "gpu": 0}\n')["error"]
    finally:
        for c in held:
            c.close()
    wait_until(lambda: ask(connect(helper.socket), b'{"op": "restore-default", "gpu": 0}\n')["ok"], 10,
               "a slot to come back")


@ROOT_ONLY
def test_another_user_cannot_connect_and_is_refused_by_uid_even_when_the_socket_mode_lets_it(helper):
    st = helper.socket.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.getuid())  # the allowed user's alone
    assert "PermissionError" in ask_as(helper.socket, b'{"op": "set-limit", "gpu": 0, "watts": 150}\n')["no"]
    helper.socket.chmod(0o666)  # the mode is one lock; SO_PEERCRED is the other
    reply = ask_as(helper.socket, b'{"op": "set-limit", "gpu": 0, "watts": 150}\n')
    assert reply == {"ok": False, "error": "uid 65534 may not use the power helper"}, reply
    assert helper.device.limit_w(0) == DEFAULT_W
    assert helper.log.named("power helper peer refused") == [{"uid": 65534}]


def test_a_change_the_driver_refuses_is_said_and_not_remembered_as_the_helpers(open_dir):
    h = Helper(open_dir, SimulatedDevice(1, refuse_limits=True))
    try:
        reply = ask(connect(h.socket), b'{"op": "set-limit", "gpu": 0, "watts": 200}\n')
        assert reply["ok"] is False and "insufficient permissions" in reply["error"], reply
        assert json.loads(h.state.read_text()) == {"changed": []}  # nothing for a stop to put back
    finally:
        h.close()


def test_stopping_restores_every_gpu_it_changed_and_only_those(open_dir):
    dev = SimulatedDevice(3)
    dev.set_limit_w(2, 180.0)  # set by someone else before the helper: not the helper's to undo
    h = Helper(open_dir, dev)
    c = connect(h.socket)
    for gpu, watts in ((0, 200), (1, 350)):
        assert ask(c, f'{{"op": "set-limit", "gpu": {gpu}, "watts": {watts}}}\n'.encode())["ok"]
    h.close()
    assert [dev.limit_w(g) for g in range(3)] == [DEFAULT_W, DEFAULT_W, 180.0]
    assert json.loads(h.state.read_text()) == {"changed": []} and not h.socket.exists()


def test_at_start_it_restores_what_a_crashed_run_changed(open_dir):
    dev = SimulatedDevice(2)
    for gpu in (0, 1):
        dev.set_limit_w(gpu, 200.0)  # GPU 1: what the killed helper had set; GPU 0: not its own
    (open_dir / "changed.json").write_text('{"changed": [1, 9]}')  # 9: no such GPU any more
    h = Helper(open_dir, dev)
    try:
        assert [dev.limit_w(g) for g in (0, 1)] == [200.0, DEFAULT_W]
    finally:
        h.close()


def test_lorad_power_helper_serves_until_sigterm_then_restores_and_exits_0(open_dir):
    from daemon.power.helper_client import HelperLimits

    sock, state = open_dir / "power.sock", open_dir / "state" / "changed.json"
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    proc = subprocess.Popen([sys.executable, "-m", "daemon.client.cli", "power-helper", "--simulated", "1",
                             "--user", user, "--socket", str(sock), "--state", str(state)],
                            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: sock.exists() or proc.poll() is not None, 30, "the helper's socket")
        HelperLimits(sock).set_limit_w(0, 250)
        assert json.loads(state.read_text()) == {"changed": [0]}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "power limit restored" in out and json.loads(state.read_text()) == {"changed": []}
    assert not sock.exists()


# --- the daemon's side: CapManager through the helper (daemon/power/helper_client.py) -------------------------


def test_a_daemon_that_is_not_root_caps_through_the_helper_and_restores_with_restore_default(helper):
    from daemon.power.caps import CapManager
    from daemon.power.helper_client import HelperLimits, ThroughHelper

    caps = CapManager(ThroughHelper(helper.device, HelperLimits(helper.socket)), RecLog())
    assert caps.apply(0, 90.0, "job") is True  # clamped to the GPU's minimum first, as with NVML itself
    assert helper.device.limit_w(0) == MIN_W and json.loads(helper.state.read_text()) == {"changed": [0]}
    caps.restore_all("exit")
    assert helper.device.limit_w(0) == DEFAULT_W
    assert json.loads(helper.state.read_text()) == {"changed": []}  # restore-default: the helper forgot it


def test_without_the_helper_caps_are_reported_unavailable_once_and_nothing_else_changes(tmp_path):
    from daemon.config.power import PowerSettings
    from daemon.power.helper_client import HelperLimits, ThroughHelper
    from daemon.power.policy import PowerPolicy

    dev, log = SimulatedDevice(1), RecLog()
    missing = tmp_path / "no-helper.sock"
    pol = PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", log,
                      device=ThroughHelper(dev, HelperLimits(missing)), start_threads=False)
    why = f"power caps unavailable: no power helper at {missing} (sudo systemctl enable --now lorad-power)"
    for _ in range(2):
        out = pol.set_manual_limit(0, 200)
        assert out["ok"] and out["gpus"][0]["applied_w"] is None and out["gpus"][0]["refused"] == why
    assert len(log.named("power limit refused")) == 1  # said once per GPU and limit
    rep = pol.report()
    assert rep["notes"][0] == why and rep["gpus"][0]["refused"] == why and rep["gpus"][0]["limit_w"] == DEFAULT_W
    assert rep["available"] is True  # telemetry goes on


def test_only_a_daemon_that_is_not_root_on_a_real_gpu_goes_through_the_helper():
    from daemon.power.helper_client import ThroughHelper, caps_seam

    class Nvml(SimulatedDevice):
        simulated = False

    real, sim = Nvml(1), SimulatedDevice(1)
    assert caps_seam(real, "/run/x.sock", euid=0) is real  # root sets NVML limits itself
    assert caps_seam(sim, "/run/x.sock", euid=1000) is sim  # the simulated device needs no root
    assert caps_seam(None, "/run/x.sock", euid=1000) is None
    assert isinstance(caps_seam(real, "/run/x.sock", euid=1000), ThroughHelper)


def test_the_helper_caps_only_the_devices_of_the_daemon_config_it_is_given(open_dir):
    from daemon.power.gpu import CapRefused
    from daemon.power.helper_client import HelperLimits

    sock, state, cfg = open_dir / "power.sock", open_dir / "state" / "changed.json", open_dir / "daemon.yaml"
    cfg.write_text("devices: [1]\n")
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    proc = subprocess.Popen([sys.executable, "-m", "daemon.client.cli", "power-helper", "--simulated", "2",
                             "--user", user, "--socket", str(sock), "--state", str(state), "--config", str(cfg)],
                            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: sock.exists() or proc.poll() is not None, 30, "the helper's socket")
        with pytest.raises(CapRefused, match=r"GPU 0 is not one of the daemon's devices \[1\]"):
            HelperLimits(sock).set_limit_w(0, 250)
        HelperLimits(sock).set_limit_w(1, 250)  # one of its devices: capped
        assert json.loads(state.read_text()) == {"changed": [1]}  # GPU 0 was never touched
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
