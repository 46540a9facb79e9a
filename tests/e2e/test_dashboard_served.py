"""`lorad serve` serves the dashboard from its own process; `lorad web-url` prints where, with the token."""

from __future__ import annotations

import http.cookiejar
import socket
import urllib.error
import urllib.request

import pytest

from daemon import protocol as p
from tests.helpers.daemon import Daemon, fast_config


def test_serve_starts_the_dashboard_and_web_url_signs_a_browser_in(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    good = Daemon(tmp_path / "a", fast_config(tmp_path, web={"listen": "127.0.0.1:0"}))
    bad = Daemon(tmp_path / "b", fast_config(tmp_path, web={"listen": f"127.0.0.1:{taken}"}))
    try:
        good.start(wait=False)
        bad.start(wait=False)
        good.wait_ready()
        bad.wait_ready()
        url = good.cli("web-url", real=True).stdout.strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url and ":0/" not in url
        assert good.call(p.WebUrl())["url"] == url
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with browser.open(url, timeout=10) as r:  # ?token= → a session cookie → /jobs
            assert r.status == 200 and "No jobs yet" in r.read().decode()
            assert r.url.endswith("/jobs")
        assert [c.name for c in jar] == [f"lorad_session_{url.split(':')[2].split('/')[0]}"]  # its port's
        base = url.split("?")[0]
        with browser.open(base + "metrics", timeout=10) as r:
            assert "lorad_up 1.0" in r.read().decode()
        try:
            urllib.request.urlopen(base + "jobs", timeout=10)
            raise AssertionError("served without the token")
        except urllib.error.HTTPError as e:
            assert e.code == 401
        assert (good.home / "web.token").stat().st_mode & 0o077 == 0

        # An address in use: the daemon says so and keeps running without the dashboard.
        with pytest.raises(p.ProtocolError, match="dashboard is not running"):
            bad.call(p.WebUrl())
        assert "web_unavailable" in bad.log()
        assert good.terminate() == 0 and bad.terminate() == 0
    finally:
        busy.close()
        good.cleanup()
        bad.cleanup()
