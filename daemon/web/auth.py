"""Who may use the dashboard: the token in HOME/web.token, sessions and CSRF tokens derived from it.

The token travels once (`?token=` on the URL `lorad web-url` prints, or an
`Authorization: Bearer` header for scripts and Prometheus); a browser then
keeps a session cookie (HttpOnly, SameSite=Strict, named for the dashboard's port) of the form SID.MAC, where
MAC = HMAC(token, SID). Every POST carries a CSRF token HMAC(token, "csrf:"+SID)
in a hidden field and, when the browser sends one, an Origin equal to the
page's own. Nothing is kept on the server: a restart keeps sessions valid, and
replacing web.token ends them all.
"""

from __future__ import annotations

import grp
import hashlib
import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE = "web.token"
COOKIE = "lorad_session"


def cookie_name(port: int | None) -> str:
    """The session cookie's name on the dashboard listening on PORT: browsers send a host's cookies to every port
    of it, so two services on 127.0.0.1 (two users' dashboards) would overwrite one another's under one name."""
    return f"{COOKIE}_{port}" if port else COOKIE


def ensure_token(home: Path, group: str | None = None, log=None) -> str:
    """The token in HOME/web.token, created (0600, or 0640 owned by `group`) if missing or empty."""
    path = Path(home) / TOKEN_FILE
    try:
        token = path.read_text(encoding="ascii").strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.tmp")
    # Born 0600: the token is never readable by others, not even between create and chmod.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
        if group:
            try:
                os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
                os.fchmod(fd, 0o640)
            except (KeyError, PermissionError) as e:
                if log is not None:
                    log.warning("web_token_group", group=group, error=str(e), message="web.token stays 0600")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return token


def read_token(home: Path) -> str | None:
    try:
        return (Path(home) / TOKEN_FILE).read_text(encoding="ascii").strip() or None
    except (FileNotFoundError, PermissionError):
        return None


def _mac(token: str, what: str) -> str:
    return hmac.new(token.encode(), what.encode(), hashlib.sha256).hexdigest()


def token_ok(token: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(token.encode(), given.encode())


def new_session(token: str) -> str:
    sid = secrets.token_urlsafe(16)
    return f"{sid}.{_mac(token, 'session:' + sid)}"


def session_ok(token: str, cookie: str | None) -> bool:
    if not cookie or "." not in cookie:
        return False
    sid, mac = cookie.rsplit(".", 1)
    return hmac.compare_digest(mac.encode(), _mac(token, "session:" + sid).encode())


def csrf_for(token: str, cookie: str) -> str:
    """The CSRF token of a session: only a page served to that session's holder can know it."""
    sid = cookie.rsplit(".", 1)[0]
    return _mac(token, "csrf:" + sid)


def csrf_ok(token: str, cookie: str | None, given: str | None) -> bool:
    if not cookie or not given or not session_ok(token, cookie):
        return False
    return hmac.compare_digest(csrf_for(token, cookie).encode(), given.encode())
