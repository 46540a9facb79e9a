"""The power helper (`lorad power-helper`, systemd/lorad-power.service): the one part of lorad that runs as root.

Changing a GPU's NVML power limit needs root; nothing else lorad does does. So, as Zeus's zeusd does, a small
root process owns that one capability and the daemon (the `lorad` user) asks it over a Unix socket:

    {"op": "set-limit", "gpu": 0, "watts": 250}   → {"ok": true, "gpu": 0, "limit_w": 250.0}
    {"op": "restore-default", "gpu": 0}           → {"ok": true, "gpu": 0, "limit_w": 400.0}
    anything else                                 → {"ok": false, "error": "..."}, and the connection is closed

One JSON object a line, at most MAX_LINE bytes, typed by pydantic (unknown keys refused). Watts outside the
GPU's NVML constraints are refused, never clamped, and so is a GPU that is not one of the daemon config's
`devices` (--config: the helper caps only those; "auto" or no config: every GPU). Who may ask: the socket file is the allowed user's, mode 0600,
and each connection's SO_PEERCRED uid must be that user's (any other is refused, root too: root needs no helper). It restores
NVML's default limit on every GPU it changed when it stops (SIGTERM), and at start on those a previous run
changed and did not restore (it crashed): that list is the state file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json

from daemon.power.gpu import CapRefused, Device

MAX_LINE = 1024  # a request is ~50 bytes
MAX_CLIENTS = 4  # the daemon uses one connection at a time
CLIENT_TIMEOUT_S = 5.0  # a request line must arrive whole within this long


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SetLimit(_Msg):
    op: Literal["set-limit"]
    gpu: int = Field(ge=0, le=63)
    watts: float = Field(gt=0, le=100_000, allow_inf_nan=False)


class RestoreDefault(_Msg):
    op: Literal["restore-default"]
    gpu: int = Field(ge=0, le=63)


REQUEST: TypeAdapter[SetLimit | RestoreDefault] = TypeAdapter(
    Annotated[Union[SetLimit, RestoreDefault], Field(discriminator="op")])


class Reply(_Msg):
    ok: bool
    gpu: int | None = None
    limit_w: float | None = None
    error: str | None = None


def peer_uid(conn: socket.socket) -> int:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class PowerHelper:
    """What the helper does, without the socket: one request line → one reply; the changed GPUs remembered."""

    def __init__(self, device: Device, state_path: Path, log: Any, devices: list[int] | None = None):
        self.device, self.state_path, self.log = device, Path(state_path), log
        self.devices = devices  # the daemon config's `devices`: the only GPUs it caps (None: "auto", every one)
        self.lock = threading.Lock()  # NVML calls and the state file, one request at a time
        self.changed: set[int] = set()

    def answer(self, line: bytes) -> tuple[Reply, bool]:
        """The reply, and whether the connection may go on (False after a malformed request)."""
        try:
            req = REQUEST.validate_python(from_json(line))  # pydantic's parser: nesting is bounded
        except ValueError as e:  # ValidationError is one
            why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()) \
                if isinstance(e, ValidationError) else f"not JSON ({e})"
            return Reply(ok=False, error=f"bad request: {why}"[:300]), False
        try:
            with self.lock:
                limit = self.set_limit(req.gpu, req.watts) if isinstance(req, SetLimit) else self.restore(req.gpu)
        except CapRefused as e:
            return Reply(ok=False, gpu=req.gpu, error=str(e)), True
        return Reply(ok=True, gpu=req.gpu, limit_w=limit), True

    def _check_gpu(self, gpu: int):
        if gpu >= self.device.count():
            raise CapRefused(f"no GPU {gpu} (this machine has {self.device.count()})")
        if self.devices is not None and gpu not in self.devices:
            raise CapRefused(f"GPU {gpu} is not one of the daemon's devices {self.devices} (its config's `devices`): "
                             f"not capped")
        return self.device.info(gpu)

    def set_limit(self, gpu: int, watts: float) -> float:
        info = self._check_gpu(gpu)
        if not info.min_w <= watts <= info.max_w:
            raise CapRefused(f"GPU {gpu}: {watts:g} W is outside its limits [{info.min_w:g}, {info.max_w:g}] W")
        was_changed = gpu in self.changed
        self.changed.add(gpu)
        self._save()  # first: a crash after the change still leaves it listed for the next start
        try:
            self.device.set_limit_w(gpu, watts)
        except CapRefused:
            if not was_changed:  # the driver kept its limit: not ours to restore
                self.changed.discard(gpu)
                self._save()
            raise
        self.log.info("power limit set", gpu=gpu, limit_w=watts)
        return watts

    def restore(self, gpu: int) -> float:
        info = self._check_gpu(gpu)
        self.device.set_limit_w(gpu, info.default_w)
        self.changed.discard(gpu)
        self._save()
        self.log.info("power limit restored", gpu=gpu, limit_w=info.default_w)
        return info.default_w

    def restore_all(self, gpus: set[int] | None = None) -> None:
        """Every GPU changed (or `gpus`, a previous run's list) back to its default; a failure is logged, not raised."""
        with self.lock:
            for gpu in sorted(self.changed if gpus is None else gpus):
                try:
                    self.restore(gpu)
                except CapRefused as e:
                    self.log.error("power limit restore failed", gpu=gpu, error=str(e))

    def restore_left_over(self) -> None:
        """At start: the GPUs a previous run changed and never restored (it was killed)."""
        try:
            left = {int(g) for g in json.loads(self.state_path.read_text())["changed"]}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log.error("power helper state unreadable", path=str(self.state_path), error=str(e))
            return
        self.restore_all({g for g in left if 0 <= g < self.device.count()})

    def _save(self) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")  # in the helper's own root-only directory
        tmp.write_text(json.dumps({"changed": sorted(self.changed)}))
        os.replace(tmp, self.state_path)


class _Handler(socketserver.StreamRequestHandler):
    timeout = CLIENT_TIMEOUT_S  # each request line must arrive whole within this long (one deadline per line)

    def handle(self) -> None:
        helper: PowerHelper = self.server.helper  # type: ignore[attr-defined]
        buf = b""
        while True:
            line, buf = self._line(buf)
            if line is None:
                return
            if len(line) > MAX_LINE or not line.endswith(b"\n"):
                self._send(Reply(ok=False, error=f"bad request: a line is at most {MAX_LINE} bytes"))
                return
            reply, go_on = helper.answer(line)
            if not self._send(reply) or not go_on:
                return

    def _line(self, buf: bytes) -> tuple[bytes | None, bytes]:
        """The next line (with its newline; over MAX_LINE bytes: cut there) and what follows it; None: the peer
        hung up, went silent, or trickled past the deadline."""
        deadline = time.monotonic() + self.timeout
        while b"\n" not in buf and len(buf) <= MAX_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, b""
            self.connection.settimeout(left)
            try:
                chunk = self.connection.recv(MAX_LINE + 1 - len(buf))
            except OSError:  # the timeout, a reset
                return None, b""
            if not chunk:
                return None, b""
            buf += chunk
        end = buf.find(b"\n") + 1 or MAX_LINE + 1
        return buf[:end], buf[end:]

    def _send(self, reply: Reply) -> bool:
        try:
            self.wfile.write(reply.model_dump_json(exclude_none=True).encode() + b"\n")
            return True
        except OSError:
            return False


class HelperServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, helper: PowerHelper, allowed_uid: int, allowed_gid: int):
        self.helper, self.allowed_uid = helper, allowed_uid
        self.active = threading.BoundedSemaphore(MAX_CLIENTS)
        path = Path(path)
        if path.is_socket():
            path.unlink()  # a previous run's (systemd's RuntimeDirectory is emptied at stop anyway)
        # Bound and listening under a temporary name, then renamed into place: a client that finds the path finds
        # a socket that accepts (between bind and listen a connect is refused).
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        old = os.umask(0o177)  # 0600 from the first moment, not after a chmod
        try:
            super().__init__(str(tmp), _Handler)
        finally:
            os.umask(old)
        os.chown(tmp, allowed_uid, allowed_gid)  # only that user (and root) may connect at all
        os.rename(tmp, path)
        self.server_address = str(path)

    def verify_request(self, request, client_address) -> bool:
        uid = peer_uid(request)
        if uid != self.allowed_uid:
            self.helper.log.warning("power helper peer refused", uid=uid)
            self._refuse(request, f"uid {uid} may not use the power helper")
            return False
        if not self.active.acquire(blocking=False):
            self._refuse(request, "busy: too many connections")
            return False
        return True

    def _refuse(self, request: socket.socket, why: str) -> None:
        try:
            request.sendall(Reply(ok=False, error=why).model_dump_json(exclude_none=True).encode() + b"\n")
        except OSError:
            pass

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.active.release()

    def handle_error(self, request, client_address) -> None:
        self.helper.log.warning("power helper connection error")  # never a traceback on stderr per client


def run(device: Device, socket_path: Path, state_path: Path, allowed_uid: int, allowed_gid: int, log: Any,
        stop: threading.Event | None = None, devices: list[int] | None = None) -> int:
    """Restore what a crashed run left, serve until SIGTERM/SIGINT (or `stop`), restore every changed GPU."""
    stop = stop or threading.Event()
    helper = PowerHelper(device, state_path, log, devices)
    helper.restore_left_over()
    server = HelperServer(socket_path, helper, allowed_uid, allowed_gid)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="power-helper", daemon=True)
    t.start()
    log.info("power helper ready", socket=str(socket_path), uid=allowed_uid, gpus=device.count(),
             devices=devices if devices is not None else "all")
    try:
        while not stop.wait(0.5):  # short waits: the signal handler runs between them
            pass
    finally:
        server.shutdown()
        server.server_close()
        Path(socket_path).unlink(missing_ok=True)
        helper.restore_all()
        log.info("power helper stopped", restored="all")
    return 0


def cmd_power_helper(args: Any) -> int:
    """`lorad power-helper`: NVML's device (or --simulated N GPUs, for demos and tests), the user from --user."""
    import pwd
    import sys

    from daemon.power.telemetry import open_device
    from daemon.system.log import setup as setup_log

    try:
        who = pwd.getpwnam(args.user)
    except KeyError:
        print(f"lorad: power-helper: no user {args.user!r} (sudo lorad install-service creates it)", file=sys.stderr)
        return 78
    devices = None
    if args.config:  # the daemon's config (root's to write): its `devices` are the only GPUs the helper caps
        from daemon.config.daemon import ConfigInvalid, load_config

        try:
            picked = load_config(args.config).devices
        except ConfigInvalid as e:
            print(f"lorad: power-helper: {e}", file=sys.stderr)
            return 78
        devices = None if picked == "auto" else sorted(picked)
    log = setup_log()
    device = open_device("simulated" if args.simulated else "nvml", log, args.simulated or 1)
    if device is None:
        print("lorad: power-helper: no NVML device to cap (no driver or no GPU); nothing to do", file=sys.stderr)
        return 78  # EX_CONFIG: restarting cannot help
    Path(args.state).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return run(device, Path(args.socket), Path(args.state), who.pw_uid, who.pw_gid, log, devices=devices)
    finally:
        device.close()
