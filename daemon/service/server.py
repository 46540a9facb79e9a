"""The Unix socket server: NDJSON requests on connection threads, peer checked with SO_PEERCRED.

Set-up order matters: an existing socket is probed (a live daemon answers →
refuse; a dead one → remove; a file that is not a socket → refuse, never
removed), the new one is bound, given mode 0660 and its group, and only then
does it listen: until listen() nobody can connect, so there is no window where
the socket is open to all, and no process-wide umask is touched (other threads
run and create files meanwhile).
Nothing a client sends can crash or block the server: every line is capped,
every request has one total deadline (a client trickling a byte at a time is
dropped when it passes, not when one recv waits too long), JSON nesting is capped
(daemon/protocol.py), and every failure becomes an error reply. One user (peer uid,
SO_PEERCRED) holds at most `max_connections_per_user` of the `max_connections`
slots, so one user's idle connections cannot lock the others out.
"""

from __future__ import annotations

import grp
import os
import pwd
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from daemon import protocol as p


class SocketInUse(Exception):
    pass


class SocketPathTaken(SocketInUse):
    """Something other than a socket is at the socket path: it is never removed."""


def peer_allowed(uid: int, gid: int, group: str | None) -> bool:
    """Root, the daemon's own user, or a member of the configured group."""
    if uid == 0 or uid == os.geteuid():
        return True
    if not group:
        return False
    try:
        g = grp.getgrnam(group)
    except KeyError:
        return False
    if gid == g.gr_gid:
        return True
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return name in g.gr_mem or g.gr_gid in os.getgrouplist(name, pwd.getpwuid(uid).pw_gid)


class SocketServer:
    def __init__(self, path: Path, handle: Callable[[p.BaseModel], bytes], log, group: str | None = None,
                 max_request_bytes: int = 1 << 20, timeout_s: float = 10.0, max_connections: int = 32,
                 max_connections_per_user: int = 8):
        self.path = Path(path)
        self.handle = handle
        self.log = log
        self.group = group
        self.max_request_bytes = max_request_bytes
        self.timeout_s = timeout_s
        self.slots = threading.BoundedSemaphore(max_connections)
        self.per_user = max_connections_per_user
        self._held: dict[int, int] = {}  # peer uid → connections it holds
        self._held_lock = threading.Lock()
        self.sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- set-up
    def start(self) -> None:
        self._remove_stale()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind(str(self.path))
            # Not os.umask(): it is process-wide, and other threads create files meanwhile. Before listen()
            # nobody can connect, so setting the mode and group now leaves no window.
            os.chmod(self.path, 0o660)
        except OSError:
            s.close()
            raise
        if self.group:
            try:
                os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
            except (KeyError, PermissionError) as e:
                self.log.warning("socket_group", group=self.group, error=str(e),
                                 message="the socket keeps the daemon's group")
        s.listen(64)
        self.sock = s
        self._thread = threading.Thread(target=self._accept_loop, name="socket-accept", daemon=True)
        self._thread.start()

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketPathTaken(f"{self.path} exists and is not a socket; not removing it (move it away, or set "
                                  "`socket:` in the daemon config to another path)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError:
            os.unlink(self.path)  # nobody listens: left over from a daemon that died
            return
        finally:
            probe.close()
        raise SocketInUse(f"another daemon answers on {self.path}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------- connections
    def _accept_loop(self) -> None:
        assert self.sock is not None
        while not self._stop.is_set():
            r, _, _ = select.select([self.sock], [], [], 0.2)
            if not r:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            try:
                uid, gid = self._peer(conn)
            except OSError:
                conn.close()
                continue
            if not self._take(uid):
                self._send_quietly(conn, p.error("busy", f"uid {uid} holds {self.per_user} connections already "
                                                 f"(the most per user); try again"))
                conn.close()
                continue
            if not self.slots.acquire(blocking=False):
                self._give_back(uid)
                self._send_quietly(conn, p.error("busy", "too many connections; try again"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, uid, gid), name="socket-conn", daemon=True).start()

    def _take(self, uid: int) -> bool:
        with self._held_lock:
            if self._held.get(uid, 0) >= self.per_user:
                return False
            self._held[uid] = self._held.get(uid, 0) + 1
            return True

    def _give_back(self, uid: int) -> None:
        with self._held_lock:
            if (n := self._held.pop(uid, 0) - 1) > 0:
                self._held[uid] = n

    def _send_quietly(self, conn: socket.socket, data: bytes) -> None:
        try:
            conn.settimeout(self.timeout_s)
            conn.sendall(data)
        except OSError:
            pass

    def _serve(self, conn: socket.socket, uid: int, gid: int) -> None:
        try:
            if not peer_allowed(uid, gid, self.group):
                self.log.warning("peer_refused", uid=uid, gid=gid)
                self._send_quietly(conn, p.error("refused", f"uid {uid} may not use this daemon "
                                                 f"(root, the daemon's user or group {self.group or '-'} only)"))
                return
            buf = b""
            # One deadline for the whole request line (and for the wait before it), not one per recv: a client
            # sending a byte every few seconds would otherwise hold its slot forever.
            deadline = time.monotonic() + self.timeout_s
            while not self._stop.is_set():
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > self.max_request_bytes:
                        # The end of this line cannot be found within the cap: answer and hang up.
                        self._send_quietly(conn, p.error("too_large", f"request larger than {self.max_request_bytes} bytes"))
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    conn.settimeout(left)
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        return
                    if not chunk:
                        return
                    buf += chunk
                    continue
                line, buf = buf[:nl], buf[nl + 1:]
                if not line.strip():
                    continue
                conn.settimeout(self.timeout_s)
                conn.sendall(self._answer(line))
                deadline = time.monotonic() + self.timeout_s
        except OSError:
            pass  # the client went away
        finally:
            conn.close()
            self.slots.release()
            self._give_back(uid)

    def _answer(self, line: bytes) -> bytes:
        if len(line) > self.max_request_bytes:
            return p.error("too_large", f"request larger than {self.max_request_bytes} bytes")
        try:
            req = p.parse_request(line)
        except p.ProtocolError as e:
            return p.error(e.code, e.message)
        try:
            return self.handle(req)
        except Exception as e:  # noqa: BLE001 — a bug in one handler must not take the daemon down
            self.log.error("handler_failed", verb=getattr(req, "verb", "?"), error=f"{type(e).__name__}: {e}",
                           exc_info=True)
            return p.error("internal", f"{type(e).__name__}: {e}")

    @staticmethod
    def _peer(conn: socket.socket) -> tuple[int, int]:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, gid = struct.unpack("3i", raw)
        return uid, gid
