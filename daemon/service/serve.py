"""`lorad serve`: put the parts together, reconcile, say READY, run the loop, stop cleanly.

    lock → store → intake → reconcile → policy → inbox watcher → socket → READY → loop → shutdown

SIGTERM or SIGINT ends the loop: every trainer is asked to checkpoint and
stop (SIGKILL after stop_grace_s), their jobs are recorded as interrupted,
and the next start resumes them. That record is what tells a clean stop from
a crash: a job still `running` in the store at the next start was cut off
(daemon or host down), and recovery counts it as a crash.

A state.db that is corrupt or locked by another process is one line on
stderr and exit 78 (EX_CONFIG; the unit's RestartPreventExitStatus), not a
traceback and a restart loop.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.config.daemon import ConfigInvalid, DaemonConfig, load_config
from daemon.gpu_health.watcher import open_watcher
from daemon.intake.accept import Intake
from daemon.intake.inbox import InboxWatcher
from daemon.intake.prune import RejectedPruner
from daemon.mirror.service import Mirrors
from daemon.power.run_policy import NullPolicy
from daemon.service.dashboard import start_dashboard
from daemon.service.handlers import Context, dispatch
from daemon.service.recovery import reconcile
from daemon.service.server import SocketInUse, SocketServer
from daemon.store.db import Store
from daemon.store.errors import StoreUnusable
from daemon.store.state_files import protect_state_db
from daemon.store.unusable import unusable_reason
from daemon.supervisor import devices as devices_mod
from daemon.supervisor.loop import Supervisor
from daemon.supervisor.notifications import Notifications
from daemon.system import privilege, trainer_user
from daemon.system.lock import AlreadyRunning, HomeLock
from daemon.system.log import setup as setup_log
from daemon.system.notify import SystemdNotifier
from engine.storage.fsio import RealFs, ensure_dir_durable
from engine.version import lorad_version

CHECK_WAIT_S = 0.2  # how long the loop waits for one job's check before asking again on a later tick
EXIT_CONFIG = 78  # EX_CONFIG: systemd will not help by restarting with the same config (or the same state.db)


def make_policy(cfg: DaemonConfig, home: Path, store: Store, log):
    """daemon.power.make_policy (telemetry, caps, schedules, UPS) if it is there, else the null policy."""
    try:
        from daemon.power import make_policy as power_policy  # noqa: PLC0415 — optional, loaded lazily
    except ImportError:
        return NullPolicy()
    try:
        return power_policy(cfg.power, home, home / "state.db", log)
    except Exception as e:  # noqa: BLE001 — power features must never stop training
        log.error("policy_unavailable", error=f"{type(e).__name__}: {e}", message="running without a power policy")
        return NullPolicy()


class CannotStart(Exception):
    """The daemon cannot start as it is set up: one line for stderr, and the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class Parts:
    """What serve() puts together, in the order it stops them."""

    store: Store
    intake: Intake
    notifier: SystemdNotifier
    policy: Any
    inbox: InboxWatcher
    notifications: Notifications
    sup: Supervisor
    ctx: Context


def serve(home: Path, config_path: str | None) -> int:
    home = Path(home).resolve()
    try:
        cfg = load_config(config_path)
    except ConfigInvalid as e:
        print(f"lorad: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:  # before anything is created or opened: a root daemon outside a container touches nothing
        as_root = privilege.check_daemon_user(os.geteuid(), cfg.run_as_root)
    except ConfigInvalid as e:
        print(f"lorad: {e}", file=sys.stderr)
        return EXIT_CONFIG
    log = setup_log()
    if as_root:
        log.warning("run_as_root", trainer_user=cfg.trainer_user,
                    message="run_as_root: this daemon runs as root in a container"
                            + ("" if cfg.trainer_user else "; job code runs as root too"))
    ensure_dir_durable(RealFs(), home)
    lock = HomeLock(home)
    try:
        lock.acquire()
    except AlreadyRunning as e:
        print(f"lorad: {e}", file=sys.stderr)
        return 1
    t0 = time.time()
    parts = None
    try:
        store = open_store(home, cfg, config_path, log)
        stop, sups = threading.Event(), []
        on_signals(stop, sups)
        parts = build_parts(home, cfg, config_path, store, log, stop, t0)
        sups.append(parts.sup)
        # Watching before anyone can reach the socket: a client that sees the daemon answer and then drops a file
        # into the inbox is seen at once, not at the next rescan (inbox_rescan_s, 10 s by default).
        parts.inbox.start()
        server = start_socket(cfg, parts.ctx, log)
    except CannotStart as e:
        if parts is not None:
            parts.inbox.stop()
        print(f"lorad: {e}", file=sys.stderr)
        lock.release()
        return e.code
    web = start_dashboard(home, cfg, parts.ctx, log)
    log.info("ready", socket=str(parts.ctx.socket_path), devices=list(parts.sup.devices),
             seconds=round(time.time() - t0, 3))
    parts.notifier.ready(parts.sup.status_line())
    try:
        run_loop(parts.sup, stop, cfg.tick_s)
    finally:
        stop_parts(parts, server, web, cfg, log, t0)
        lock.release()
    return 0


def open_store(home: Path, cfg: DaemonConfig, config_path: str | None, log) -> Store:
    """state.db opened (mode 0640), and the trainer user checked once the store is known to be usable."""
    db_path = home / "state.db"
    try:
        protect_state_db(db_path)
    except OSError as e:  # a directory in its place, a read-only home, ...: opening it below says what is wrong
        log.warning("state_db_mode", path=str(db_path), error=str(e), message="could not set its mode to 0640")
    try:
        store = Store(db_path)
    except StoreUnusable as e:
        raise CannotStart(str(e), EXIT_CONFIG) from None
    try:
        # A root daemon (run_as_root, in a container) with a trainer_user: that user exists and is not root.
        # Checked once the state.db is known to be usable, so that its verdict (exit 78 too) is the one a broken
        # home gets.
        trainer_user.resolve(cfg.trainer_user, os.geteuid())
    except ConfigInvalid as e:
        store.close()
        raise CannotStart(f"{config_path or 'daemon config'}: {e}", EXIT_CONFIG) from None
    return store


def on_signals(stop: threading.Event, sups: list[Supervisor]) -> None:
    """SIGTERM and SIGINT stop the loop (and mark the supervisors as shutting down at once); SIGHUP and SIGPIPE
    are ignored."""

    def on_stop(signum, frame) -> None:
        stop.set()
        for s in sups:
            # At once, not at the end of this tick: under systemd the trainers get the same SIGTERM, and one
            # that exits before shutdown() begins must be recorded as interrupted by it, not requeued.
            s.shutting_down = True
            s.wake.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal must not stop training
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def build_parts(home: Path, cfg: DaemonConfig, config_path: str | None, store: Store, log, stop: threading.Event,
                t0: float) -> Parts:
    """Intake, reconcile what the last run left, then the policy, devices, inbox, notifications and supervisor."""
    notifier = SystemdNotifier()
    intake = Intake(home, cfg, store, log)
    intake.check_wait_s = CHECK_WAIT_S  # recovery and the loop never wait on one job's files (daemon/intake/checks.py)
    log.info("starting", version=lorad_version(), home=str(home), pid=os.getpid(), config=config_path)
    notifier.status("reconciling")
    try:
        reconciled = reconcile(home, cfg, store, log, intake)
    except sqlite3.DatabaseError as e:
        why = unusable_reason(home / "state.db", e)  # corruption that opening did not see, or a lock taken since
        if why is None:
            raise
        store.close()
        raise CannotStart(why, EXIT_CONFIG) from None
    policy = make_policy(cfg, home, store, log)
    devs = devices_mod.detect(cfg.devices)
    inbox = InboxWatcher(home / "inbox", cfg.inbox_settle_s, cfg.inbox_rescan_s)
    notifications = Notifications(cfg.notify, log)
    mirrors = Mirrors(home, cfg, store, log)
    health = open_watcher(cfg, policy, devs, store.get_meta("gpu_held"), log)  # daemon/gpu_health/
    sup = Supervisor(home, cfg, store, devs, log, intake=intake, inbox=inbox, policy=policy, notifier=notifier,
                     notifications=notifications, mirrors=mirrors, health=health,
                     prune_rejected=RejectedPruner(intake.rejected, cfg.rejected_keep_days, cfg.rejected_keep, log,
                                                    store, (cfg.finished_events_keep_days, cfg.finished_events_keep)))
    if health is not None:
        health.groups = lambda: {c.pid for c in list(sup.children.values())}  # trainers lead their process groups
        health.start()
    mirrors.resume(sup.wake.set)  # what the last run left behind: uploads not caught up, downloads cut short
    sup.shutting_down = stop.is_set()
    for st in reconciled.stuck:  # orphans that outlived SIGKILL: reported, their GPUs kept out of scheduling
        sup.stuck.add(st)
    ctx = Context(home=home, store=store, intake=intake, supervisor=sup, started_at=t0,
                  socket_path=cfg.socket_path(home))
    return Parts(store=store, intake=intake, notifier=notifier, policy=policy, inbox=inbox,
                 notifications=notifications, sup=sup, ctx=ctx)


def start_socket(cfg: DaemonConfig, ctx: Context, log) -> SocketServer:
    """The control socket, serving requests from now on."""
    sock_path = ctx.socket_path
    server = SocketServer(sock_path, lambda req: dispatch(ctx, req), log, group=cfg.socket_group,
                          max_request_bytes=cfg.max_request_bytes, timeout_s=cfg.client_timeout_s,
                          max_connections=cfg.max_connections,
                          max_connections_per_user=cfg.max_connections_per_user)
    try:
        server.start()
    except SocketInUse as e:
        raise CannotStart(str(e), 1) from None
    except OSError as e:  # a path longer than AF_UNIX allows (107 bytes), a read-only directory, ...
        raise CannotStart(f"cannot create the socket at {sock_path}: {e}; set `socket:` in the daemon config",
                          1) from None
    return server


def run_loop(sup: Supervisor, stop: threading.Event, tick_s: float) -> None:
    """A tick, then wait for the next one (or for a trainer's heartbeat to wake it), until stopped."""
    while not stop.is_set():
        sup.tick()
        sup.wake.wait(tick_s)
        sup.wake.clear()


def stop_parts(parts: Parts, server: SocketServer, web, cfg: DaemonConfig, log, t0: float) -> None:
    """Checkpoint and stop the trainers, then close the socket, dashboard, policy, store and notifiers."""
    n = len(parts.sup.children)
    log.info("stopping", trainers=n)
    parts.notifier.stopping(f"stopping: checkpointing {n} job(s)" if n else "stopping")
    parts.inbox.stop()
    parts.sup.shutdown(cfg.stop_grace_s)
    if parts.sup.health is not None:
        parts.sup.health.stop()
    server.close()
    if web is not None:
        web.close()
    try:
        parts.policy.close()
    except Exception as e:  # noqa: BLE001
        log.error("policy_close_failed", error=str(e))
    parts.store.close()
    parts.notifications.close()  # what is queued gets its chance (a few seconds at most)
    parts.notifier.close()
    log.info("stopped", seconds=round(time.time() - t0, 1))
