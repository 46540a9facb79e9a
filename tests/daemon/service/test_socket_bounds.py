"""The socket's bounds against one user: connection slots per peer uid, and a nesting cap on request JSON.

Real Unix sockets; the second user is a forked child that drops to `nobody` (root only: skipped otherwise).
"""

from __future__ import annotations

import os

import pytest

from daemon import protocol as p
from daemon.service.server import SocketServer
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.sockets import ask, ask_as, connect, reachable_dir


def serve(where, **kw) -> SocketServer:
    s = SocketServer(where / "b.sock", lambda req: p.encode(p.Reply(data={"verb": req.verb})), RecLog(),
                     group="nogroup", max_request_bytes=1 << 20, timeout_s=5.0, **kw)
    s.start()
    return s


def answered(reply: dict) -> bool:
    return reply.get("ok") is True and reply.get("data") == {"verb": "ping"}


@pytest.fixture
def open_dir():
    yield from reachable_dir("lorad-sock-")


@pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root to become")
def test_one_user_holding_its_slots_leaves_the_others_theirs(open_dir):
    s = serve(open_dir, max_connections=8, max_connections_per_user=3)
    held = []
    try:
        held = [connect(s.path) for _ in range(3)]  # idle: each holds a slot until the request deadline
        over = ask(connect(s.path), b'{"verb": "ping"}\n')
        assert over["ok"] is False and over["error"] == "busy" and "per user" in over["message"], over
        assert answered(ask_as(s.path, b'{\"verb\": \"ping\"}\n'))  # another user still gets in
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

