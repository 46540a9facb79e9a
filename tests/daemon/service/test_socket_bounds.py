"""The socket's bounds against one user: connection slots per peer uid, and a nesting cap on request JSON.

Real Unix sockets; the second user is a forked child that drops to `nobody` (root only: skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.service.server import SocketServer
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog


def serve(where, **kw) -> SocketServer:
    s = SocketServer(where / "b.sock", lambda req: p.encode(p.Reply(data={"verb": req.verb})), RecLog(),
                     group="nogroup", max_request_bytes=1 << 20, timeout_s=5.0, **kw)
    s.start()
    return s


def connect(path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(str(path))
    return c


def ask(c: socket.socket, line: bytes) -> dict:
    try:
        c.sendall(line)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once (busy): its answer is already waiting
    out = b""
    while not out.endswith(b"\n"):
        chunk = c.recv(65536)
        if not chunk:
            break
        out += chunk
    assert out, "the server hung up without an answer"
    return json.loads(out)


def ping_as(path, uid: int) -> dict:
    """A ping from a child process running as `uid`: its answer, or {"no": reason}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover — the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(uid)
            reply = json.dumps(ask(connect(path), b'{"verb": "ping"}\n'))
        except BaseException as e:  # noqa: BLE001
            reply = json.dumps({"no": repr(e)})
        os.write(w, reply.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def answered(reply: dict) -> bool:
    return reply.get("ok") is True and reply.get("data") == {"verb": "ping"}


@pytest.fixture
def open_dir():
    """A directory `nobody` can reach a socket in (pytest's own temp dir is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="lorad-sock-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root to become")
def test_one_user_holding_its_slots_leaves_the_others_theirs(open_dir):
    s = serve(open_dir, max_connections=8, max_connections_per_user=3)
    held = []
    try:
        held = [connect(s.path) for _ in range(3)]  # idle: each holds a slot until the request deadline
        over = ask(connect(s.path), b'{"verb": "ping"}\n')
        assert over["ok"] is False and over["error"] == "busy" and "per user" in over["message"], over
        assert answered(ping_as(s.path, 65534))  # another user still gets in
        held.pop().close()
        # The server notices the hang-up on its connection thread's next recv: soon, not at once.
        again = wait_until(lambda: (r := ask(connect(s.path), b'{"verb": "ping"}\n'))["ok"] and r, 10,
                           "the closed connection's slot to come back", poll=0.05)
        assert answered(again)
    finally:
        for c in held:
            c.close()
        s.close()


def test_a_request_nested_100k_deep_gets_a_clean_error_and_the_connection_keeps_working(tmp_path):
    s = serve(tmp_path)
    try:
        c = connect(s.path)
        deep = ask(c, b"[" * 100_000 + b"]" * 100_000 + b"\n")
        assert deep["ok"] is False and deep["error"] == "bad_json" and "nest" in deep["message"], deep
        deep_in_object = ask(c, b'{"verb": "ping", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n")
        assert deep_in_object["error"] == "bad_json"
        assert answered(ask(c, b'{"verb": "ping"}\n'))
        c.close()
        assert not s.log.named("handler_failed")
    finally:
        s.close()

