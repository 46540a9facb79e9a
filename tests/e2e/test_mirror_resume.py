"""Losing the machine: a job mirrored by `lorad serve` resumes on a second daemon with `lorad submit --from`.

Once per backend (moto's S3 server, sshd's SFTP, both on loopback): a job trains with a mirror; once a checkpoint
is on the mirror the daemon and its trainer are SIGKILLed and the whole home is deleted. A second daemon on a new
home resumes the job from the mirror (its download cut short by a SIGKILL once, and started again), and its final
adapter is bit-identical to an uninterrupted run; that daemon, SIGKILLed again right after the job succeeded, mirrors
its output once restarted. Nothing of
the credentials is in the homes, the logs, `lorad status` or the pages. (A mirror that cannot work:
tests/daemon/mirror/test_submit.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from daemon.config.mirrors import MirrorSettings
from daemon.mirror.remote import Remote
from daemon.mirror.uploader import newest_remote
from tests.helpers.daemon import Daemon, adapter_file, fast_config, job_events, wait_until

pytestmark = pytest.mark.slow


def grep_tree(root: Path, secret: str) -> list[str]:
    found = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and secret.encode() in p.read_bytes():
            found.append(str(p))
    return found


@pytest.mark.parametrize("backend", ["s3", "sftp"])
def test_a_machine_lost_mid_run_resumes_elsewhere_from_the_mirror_bit_identical(backend, request, tmp_path, svc_job,
                                                                                svc_reference):
    server = request.getfixturevalue(f"{backend}_server")
    mirror = server.mirror(f"loss-{tmp_path.name}")
    remote = Remote("off", MirrorSettings.model_validate(mirror))
    cfg = fast_config(tmp_path.parent, mirrors={"off": mirror}, default_mirror="off")
    # Its steps pause (tests only): the micro model trains 24 steps in about a second, sooner than the first
    # upload could land; the second daemon trains at full speed.
    a = Daemon(tmp_path / "home-a", cfg, LORAD_DEBUG_STEP_DELAY_S="0.15")
    try:
        a.start()
        jid = a.cli("submit", str(svc_job)).stdout.strip()
        wait_until(lambda: newest_remote(remote, jid), 120, "a checkpoint on the mirror", poll=0.02)
    finally:
        a.cleanup()  # SIGKILL: the daemon and its trainer
    said_by_a = a.log()
    shutil.rmtree(a.home)  # the machine is gone, its disk with it

    # On a slow link (tests only: a pause after each downloaded file) submit answers at once, the job `fetching`
    # with its download's progress in the status; the daemon SIGKILLed mid-download starts it again at its next
    # start, and the job trains on from the mirror's checkpoint all the same.
    b = Daemon(tmp_path / "home-b", cfg, LORAD_DEBUG_MIRROR_FETCH_DELAY_S="0.4")
    try:
        b.start()
        out = b.cli("submit", "--from", f"{mirror['url']}/{jid}").stdout
        new = out.split()[0]
        assert "fetching" in out and b.job(new)["state"] == "fetching", out
        wait_until(lambda: "files" in b.cli("status").stdout, 30, "the download's progress in the status")
        b.sigkill()
        assert b.trainers() == [] and not (b.home / "jobs" / new / "checkpoints").exists()
        # Its uploads are slow this time (a second per file of a checkpoint): the daemon is SIGKILLed as soon as
        # the job succeeded, its output not yet mirrored; the next start uploads it.
        b.env.pop("LORAD_DEBUG_MIRROR_FETCH_DELAY_S")
        b.env["LORAD_DEBUG_MIRROR_FILE_DELAY_S"] = "1"
        b.start()
        j = b.wait_state(new, {"succeeded", "failed"}, 180)
        b.sigkill()
        assert j["state"] == "succeeded", j
        assert not remote.exists(f"{new}/output/lorad-output.json")
        b.env.pop("LORAD_DEBUG_MIRROR_FILE_DELAY_S")
        b.start()
        workdir = Path(j["workdir"])
        assert adapter_file(workdir) == svc_reference  # bit-identical to the run that never moved
        resumed = [e for e in job_events(workdir) if e.get("event") == "resumed"]
        assert resumed and 0 < resumed[0]["from_step"] < 24, resumed  # from the mirror, mid-run
        # It goes on mirroring under its own id (the key it came from is only read): its output lands there, and
        # the status says caught up.
        lag = wait_until(lambda: (m := b.job(new)["mirror"]) and m["caught_up"] and m, 60, "the output mirrored")
        assert remote.get(f"{new}/output/adapter_model.safetensors") == svc_reference
        assert remote.exists(f"{new}/output/lorad-output.json") and newest_remote(remote, new) == 24
        assert lag["key"] == new and lag["last_error"] is None and lag["output_mirrored"]
        assert not remote.exists(f"{jid}/output/lorad-output.json") and newest_remote(remote, jid) < 24
        assert "mirror behind" not in b.cli("status").stdout
        status = b.cli("status").stdout + b.cli("status", new).stdout
        if backend == "s3":
            pages = dashboard_pages(b, new)
            for where, text in [("daemon a's log", said_by_a), ("daemon b's log", b.log()), ("status", status),
                                ("pages", pages)]:
                assert server.secret not in text, f"the secret is in {where}"
            assert grep_tree(b.home, server.secret) == []
            assert "lorad_mirror_behind_steps{" in pages
    finally:
        b.cleanup()


def dashboard_pages(d: Daemon, job_id: str) -> str:
    """The jobs page, the job's page (signed in as a browser is, with the token once) and /metrics."""
    url = json.loads(d.cli("web-url", "--json").stdout)["url"].split("?")[0].rstrip("/")
    token = (d.home / "web.token").read_text().strip()
    with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as web:
        pages = [web.get(f"/jobs?token={token}").text, web.get(f"/jobs/{job_id}").text]
        pages.append(web.get("/metrics", headers={"Authorization": f"Bearer {token}"}).text)
    assert "id='mirror'" in pages[1], pages[1][-2000:]
    return "".join(pages)

