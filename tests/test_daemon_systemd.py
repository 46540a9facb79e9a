"""systemd integration: the unit file verifies, and the notify protocol speaks to a real datagram socket."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from daemon.lock import AlreadyRunning, HomeLock
from daemon.notify import Notifier
from tests.conftest import REPO

UNIT = REPO / "systemd" / "lorad.service"


@pytest.fixture
def notify_socket(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    s.settimeout(2)
    yield s, str(tmp_path / "notify")
    s.close()


def test_ready_status_watchdog_and_extend_arrive_as_datagrams(notify_socket):
    s, path = notify_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"})
    assert n.enabled and n.watchdog_s == 3.0
    n.ready("idle; 0 queued")
    assert s.recv(4096).decode().split("\n") == ["READY=1", "STATUS=idle; 0 queued", f"MAINPID={os.getpid()}"]
    n.status("job-1 step 3/10")
    assert s.recv(4096) == b"STATUS=job-1 step 3/10"
    n.watchdog()
    assert s.recv(4096) == b"WATCHDOG=1"
    n.extend_timeout(120)
    assert s.recv(4096) == b"EXTEND_TIMEOUT_USEC=120000000"
    n.stopping("stopping")
    assert s.recv(4096).startswith(b"STOPPING=1")


def test_abstract_socket_names_are_supported():
    name = f"lorad-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(2)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert s.recv(100) == b"WATCHDOG=1"
    finally:
        s.close()


def test_outside_systemd_notify_is_a_no_op_and_a_watchdog_for_another_pid_is_ignored():
    assert not Notifier({}).enabled and not Notifier({}).ready("x")
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent/sock"}).watchdog() is False  # never raises


def test_unit_has_the_promised_settings():
    text = UNIT.read_text()
    for line in ["Type=notify", "Restart=always", "StartLimitIntervalSec=0", "KillMode=mixed", "StateDirectory=lorad",
                 "RuntimeDirectory=lorad", "WatchdogSec=", "TimeoutStopSec=", "DeviceAllow=/dev/nvidiactl rw",
                 "DeviceAllow=char-nvidia-frontend rw", "NoNewPrivileges=yes", "ProtectSystem=strict"]:
        assert line in text, line
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    from daemon.settings import DaemonConfig

    assert stop > DaemonConfig().stop_grace_s  # systemd must not SIGKILL a trainer that is still checkpointing


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_installed_unit(tmp_path):
    # What install-service writes: ExecStart points at this lorad (verify checks that it is executable).
    unit = subprocess.run([sys.executable, "-m", "daemon.cli", "install-service", "--dry-run"], capture_output=True,
                          text=True, cwd=REPO, check=True).stdout
    exe = unit.split("ExecStart=")[1].split()[0]
    if not os.access(exe, os.X_OK):
        unit = unit.replace(exe, sys.executable)
    path = tmp_path / "lorad.service"
    path.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if "lorad.service" in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_a_second_lock_on_the_same_home_is_refused_with_the_holder(tmp_path):
    a = HomeLock(tmp_path)
    a.acquire()
    with pytest.raises(AlreadyRunning, match=f"already running on {tmp_path} \\(pid {os.getpid()}\\)"):
        HomeLock(tmp_path).acquire()
    a.release()
    HomeLock(tmp_path).acquire()  # released with the process (or here, explicitly)


def test_lorad_serve_speaks_notify_ready_after_reconciliation_watchdog_and_stopping(tmp_path, notify_socket):
    from tests.daemon_helpers import Daemon, fast_config

    s, path = notify_socket
    d = Daemon(tmp_path / "home", fast_config(tmp_path), NOTIFY_SOCKET=path, WATCHDOG_USEC="600000")
    try:
        d.start()
        got: list[str] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not ("READY=1" in got and got.count("WATCHDOG=1") >= 2):
            try:
                got += s.recv(4096).decode().split("\n")
            except TimeoutError:
                pass
        assert got[0] == "STATUS=reconciling"  # before READY: reconciliation runs first
        assert "READY=1" in got and f"MAINPID={d.proc.pid}" in got
        assert got.index("READY=1") < got.index("WATCHDOG=1")
        assert any(x.startswith("STATUS=idle; 0 queued") for x in got)
        assert d.terminate(30) == 0
        rest = []
        while True:
            try:
                rest += s.recv(4096).decode().split("\n")
            except TimeoutError:
                break
        assert "STOPPING=1" in rest
    finally:
        d.cleanup()
