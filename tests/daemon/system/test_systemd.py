"""systemd integration: the unit file verifies, and the notify protocol speaks to a real datagram socket."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from daemon.system.lock import AlreadyRunning, HomeLock
from daemon.system.notify import SystemdNotifier
from tests.helpers.processes import REPO

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
    n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"})
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
        assert SystemdNotifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert s.recv(100) == b"WATCHDOG=1"
    finally:
        s.close()


def test_outside_systemd_notify_is_a_no_op_and_a_watchdog_for_another_pid_is_ignored():
    assert not SystemdNotifier({}).enabled and not SystemdNotifier({}).ready("x")
    assert SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent/sock"}).watchdog() is False  # never raises


def test_unit_has_the_promised_settings():
    text = UNIT.read_text()
    for line in ["Type=notify", "Restart=always", "StartLimitIntervalSec=0", "KillMode=control-group",
                 "WatchdogSignal=SIGTERM", "StateDirectory=lorad",
                 "RuntimeDirectory=lorad", "WatchdogSec=", "TimeoutStopSec=", "DeviceAllow=/dev/nvidiactl rw",
                 "DeviceAllow=char-nvidia-frontend rw", "NoNewPrivileges=yes", "ProtectSystem=strict"]:
        assert line in text, line
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    from daemon.config.daemon import DaemonConfig

    assert stop > DaemonConfig().stop_grace_s  # systemd must not SIGKILL a trainer that is still checkpointing


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for ln in UNIT.read_text().splitlines():
        if "=" in ln and not ln.lstrip().startswith("#"):
            k, v = ln.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_trainers_get_sigterm_and_their_grace_whether_the_daemon_is_stopped_or_dies():
    """systemd.kill(5): with KillMode=mixed, what is left when the main process exits gets SIGKILL at once, so a
    daemon crash would kill every trainer without its final checkpoint. With control-group the whole unit gets
    KillSignal, and SIGKILL only after TimeoutStopSec; a watchdog timeout sends WatchdogSignal to the same."""
    u = unit_settings()
    assert u["KillMode"] == ["control-group"] and u["KillSignal"] == ["SIGTERM"] and u["WatchdogSignal"] == ["SIGTERM"]
    doc = (REPO / "docs" / "service-and-cli.md").read_text()  # the systemd part of the service's page
    assert "`KillMode=control-group`" in doc and "KillMode=mixed`" not in doc
    assert "`WatchdogSignal=SIGTERM`" in doc


def test_exit_78_is_the_status_systemd_does_not_restart_on():
    from daemon.service.serve import EXIT_CONFIG

    assert unit_settings()["RestartPreventExitStatus"] == [str(EXIT_CONFIG)] and EXIT_CONFIG == 78


def root_in_container_config(tmp_path) -> str:
    """The suite runs as root in a container: the setting that lets a root daemon start there."""
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("run_as_root: true\n")
    return str(cfg)


def serve_once(home) -> subprocess.CompletedProcess:
    from tests.helpers.processes import child_env

    return subprocess.run([sys.executable, "-m", "daemon.client.cli", "serve", "--home", str(home), "--config",
                           root_in_container_config(home.parent)], capture_output=True,
                          text=True, cwd=REPO, env=child_env(), timeout=120)


def test_a_corrupt_state_db_is_one_line_and_exit_78_not_a_traceback(tmp_path):
    home = tmp_path / "home"
    (home / "jobs" / "kept-1234").mkdir(parents=True)
    (home / "state.db").write_bytes(b"garbage, not SQLite " * 500)
    r = serve_once(home)
    assert r.returncode == 78, r.stderr
    assert r.stderr == (f"lorad: {home}/state.db is not a lorad database (corrupt?): move it aside to start fresh "
                        "— job directories under jobs/ are not touched\n")
    assert (home / "jobs" / "kept-1234").is_dir()


def test_a_state_db_locked_by_another_process_is_one_line_and_exit_78(tmp_path, monkeypatch, capsys,
                                                                        keep_signal_handlers):
    import functools

    from daemon.service import serve as service
    from daemon.store.db import Store

    home = tmp_path / "home"
    home.mkdir()
    locker = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], "
                               "isolation_level=None); c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); "
                               "time.sleep(60)", str(home / "state.db")], stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        monkeypatch.setattr(service, "Store", functools.partial(Store, timeout_s=0.3))  # not the 30 s of production
        assert service.serve(home, root_in_container_config(tmp_path)) == 78
    finally:
        locker.kill()
        locker.wait()
    err = capsys.readouterr().err
    assert err == f"lorad: {home}/state.db is locked by another process (pid {locker.pid}): stop it, then start lorad again\n"
    HomeLock(home).acquire()  # the home lock was given back


def dry_run(monkeypatch=None) -> dict[str, str]:
    """What `lorad install-service --dry-run` prints, by the path each part would be written to."""
    from tests.helpers.daemon import cli_in_process
    from tests.helpers.processes import child_env

    r = cli_in_process(["install-service", "--dry-run"], child_env())  # its text is the point, not its process
    assert r.returncode == 0, r.stderr
    parts = r.stdout.split("# --- ")[1:]
    return {p.split("\n", 1)[0].split(" (")[0]: p.split("\n", 1)[1] for p in parts}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_both_installed_units(tmp_path):
    # What install-service writes: ExecStart points at this lorad (verify checks that it is executable).
    out = dry_run()
    units = {path: text for path, text in out.items() if path.startswith("/etc/systemd/system/")}
    assert sorted(units) == ["/etc/systemd/system/lorad-power.service", "/etc/systemd/system/lorad.service"]
    paths = []
    for path, text in units.items():
        exe = text.split("ExecStart=")[1].split()[0]
        if not os.access(exe, os.X_OK):
            text = text.replace(exe, sys.executable)
        paths.append(tmp_path / path.rsplit("/", 1)[1])
        paths[-1].write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", *map(str, paths)], capture_output=True, text=True,
                       cwd=tmp_path)  # the units see each other (Wants=, Before=) in the directory they are in
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if "lorad" in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_install_service_dry_run_prints_both_units_lorad_unprivileged_the_helper_as_root_and_the_starter_config(
        monkeypatch):
    import yaml

    from daemon.config.daemon import DaemonConfig
    from daemon.system import install_service

    monkeypatch.setattr(install_service.shutil, "which", lambda name: "/opt/venv/bin/lorad")
    out = dry_run()
    unit, helper = out["/etc/systemd/system/lorad.service"], out["/etc/systemd/system/lorad-power.service"]
    assert [ln for ln in unit.splitlines() if "/opt/venv/bin/lorad" in ln] == [
        "ExecStart=/opt/venv/bin/lorad serve --home /var/lib/lorad --config /etc/lorad/daemon.yaml"]
    assert [ln for ln in helper.splitlines() if ln.startswith("ExecStart=")] == [
        "ExecStart=/opt/venv/bin/lorad power-helper --user lorad --socket /run/lorad-power/lorad-power.sock "
        "--state /var/lib/lorad-power/changed.json --config /etc/lorad/daemon.yaml"]
    assert "/usr/local/bin/lorad" in unit  # the comment that explains the substitution, as shipped

    def settings(text: str) -> dict[str, list[str]]:
        pairs = [ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#")]
        return {k: [v for k2, v in pairs if k2 == k] for k, _ in pairs}

    u, h = settings(unit), settings(helper)
    assert u["User"] == ["lorad"] and u["Group"] == ["lorad"] and u["CapabilityBoundingSet"] == [""]
    assert "lorad-power.service" in u["Wants"][0] and "lorad-power.service" in u["After"][0]
    assert "User" not in h and h["RuntimeDirectory"] == ["lorad-power"]  # the helper is root's: NVML needs it
    starter = DaemonConfig.model_validate(yaml.safe_load(out["/etc/lorad/daemon.yaml"]))
    assert starter.socket_group == "lorad" and starter.trainer_user is None and starter.run_as_root is False


def test_a_second_lock_on_the_same_home_is_refused_with_the_holder(tmp_path):
    a = HomeLock(tmp_path)
    a.acquire()
    with pytest.raises(AlreadyRunning, match=f"already running on {tmp_path} \\(pid {os.getpid()}\\)"):
        HomeLock(tmp_path).acquire()
    a.release()
    HomeLock(tmp_path).acquire()  # released with the process (or here, explicitly)


def test_lorad_serve_speaks_notify_ready_after_reconciliation_watchdog_and_stopping(tmp_path, notify_socket):
    from tests.helpers.daemon import Daemon, fast_config

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
        if os.geteuid() == 0:  # the suite's root in a container: allowed by run_as_root, and said so at start
            assert '"event": "run_as_root"' in d.log(), d.log()
    finally:
        d.cleanup()
