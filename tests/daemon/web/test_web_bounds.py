"""The dashboard's bounds, over real uvicorn on loopback and raw sockets: the token before any body is read,
bodies counted as they arrive (chunked ones too), a deadline on request heads, and the Host check (DNS
rebinding)."""

from __future__ import annotations

import socket
import time

import pytest

from daemon.web.app import build_app
from daemon.web.listener import WebListener
from daemon.web.metrics import registry
from tests.helpers.web import Site


@pytest.fixture
def served(tmp_path):
    site = Site(tmp_path, metrics_auth="loopback")
    site.dash.metrics = registry(site.view, lambda: {}, site.home / "rejected")
    web = WebListener(build_app(site.dash), "127.0.0.1:0", header_timeout_s=0.5)
    web.start()
    yield site, web
    web.close()
    site.close()


def connect(web: WebListener) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", web.port), timeout=5)
    c.settimeout(3)
    return c


def response(c: socket.socket) -> bytes:
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = c.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


UPLOAD = b'--b\r\nContent-Disposition: form-data; name="file"; filename="job.yaml"\r\n\r\n'


def send_chunks(c: socket.socket, total: int, chunk: int = 64 << 10, end: bool = True) -> int:
    """A multipart upload of one file, chunked, sent until the server stops taking it (it answered, hung up);
    end=False leaves it unfinished, as a large upload is when the server answers."""
    sent = 0
    try:
        c.sendall(b"%x\r\n" % len(UPLOAD) + UPLOAD + b"\r\n")
        while sent < total:
            c.sendall(b"%x\r\n" % chunk + b"#" * chunk + b"\r\n")
            sent += chunk
        if end:
            c.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def post_head(web: WebListener, path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{web.port}",
                         "Content-Type: multipart/form-data; boundary=b", "Transfer-Encoding: chunked", *headers])
            + "\r\n\r\n").encode()


def test_an_upload_without_the_token_is_refused_before_its_body_is_read(served):
    site, web = served
    c = connect(web)
    c.sendall(post_head(web, "/submit"))
    send_chunks(c, 64 << 10, end=False)  # the first chunk of a 300 MB upload; the rest is not sent yet
    head = response(c)  # today's answer, not the one after the upload has been spooled
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
    c.close()
    assert site.calls == []


def test_a_chunked_body_is_counted_and_cut_at_the_cap(served):
    site, web = served
    c = connect(web)
    c.sendall(post_head(web, "/submit", f"Authorization: Bearer {site.token}"))
    send_chunks(c, 4 * site.dash.max_body_bytes)  # no Content-Length to refuse it by
    assert response(c).startswith(b"HTTP/1.1 413")
    c.close()
    assert site.calls == []


def test_a_client_trickling_its_headers_is_dropped_at_the_deadline(served):
    _, web = served
    c = connect(web)
    c.sendall(f"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1:{web.port}\r\n".encode())
    t0, closed = time.monotonic(), False
    while time.monotonic() - t0 < 3:
        try:
            c.sendall(b"X-Slow: 1\r\n")
            c.settimeout(0.2)
            if c.recv(1024) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
    assert closed and time.monotonic() - t0 < 2.5, "the server kept a connection whose headers never ended"
    c.close()
    ok = connect(web)  # a client that sends its request at once is served as before, then kept alive
    ok.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{web.port}\r\n\r\n".encode())
    assert response(ok).startswith(b"HTTP/1.1 200")
    ok.close()


@pytest.mark.parametrize("host, status", [("127.0.0.1:{port}", 200), ("localhost:{port}", 200),
                                          ("[::1]:{port}", 200), ("evil.example:{port}", 400),
                                          ("evil.example", 400), ("127.0.0.1.evil.example", 400)])
def test_only_the_dashboards_own_names_are_answered_metrics_included(served, host, status):
    site, web = served
    for path, auth in (("/metrics", ""), ("/jobs", f"Authorization: Bearer {site.token}\r\n")):
        c = connect(web)
        c.sendall(f"GET {path} HTTP/1.1\r\nHost: {host.format(port=web.port)}\r\n{auth}\r\n".encode())
        head = response(c)
        assert head.startswith(f"HTTP/1.1 {status}".encode()), (path, host, head[:200])
        c.close()


def test_the_names_answered_follow_the_listen_address_and_web_hosts():
    from daemon.config.web import WebSettings
    from daemon.web.guard import allowed_hosts

    assert allowed_hosts(WebSettings()) == ["localhost"]  # and every IP literal
    remote = allowed_hosts(WebSettings(listen="0.0.0.0:8742", allow_remote=True, hosts=["Lorad.Example"]))
    assert {"localhost", socket.gethostname().lower(), "lorad.example"} <= set(remote)
    assert allowed_hosts(WebSettings(listen="box.lan:8742", allow_remote=True)).count("box.lan") == 1
    assert "*" in allowed_hosts(WebSettings(hosts=["*"]))
