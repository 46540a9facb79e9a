"""Unix-socket clients for the socket tests: a connection, one request and its answer, a request from another
user (a forked child that drops to it), and a directory that user can reach a socket in."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534


def connect(path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(str(path))
    return c


def ask(c: socket.socket, line: bytes) -> dict:
    """Send one request line and read one answer line."""
    try:
        c.sendall(line)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before reading (busy, bad peer): its answer is already waiting
    out = b""
    while not out.endswith(b"\n"):
        chunk = c.recv(65536)
        if not chunk:
            break
        out += chunk
    assert out, "the server hung up without an answer"
    return json.loads(out)


def ask_as(path, line: bytes, uid: int = NOBODY, gid: int = NOBODY) -> dict:
    """`line` sent from a child process running as `uid`: the answer, or {"no": the error}. Root only."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover — the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            reply = ask(connect(path), line)
        except BaseException as e:  # noqa: BLE001
            reply = {"no": repr(e)}
        os.write(w, json.dumps(reply).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def reachable_dir(prefix: str) -> Iterator[Path]:
    """A directory another user can reach a socket in (pytest's own temp dir is root's alone); for a fixture."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)
