"""`lorad submit --from` keys are job ids, never paths, and a restored job writes only under its own id.

A socket-group member's `--from nfs/../home/jobs/OTHER` made the daemon upload into another job's directory, and
`--from nfs/OTHER` took over another job's mirror prefix (issue 38, B). Through the daemon's own handlers, a file://
mirror whose folder sits beside the home, so `..` would reach it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from daemon import protocol as p
from daemon.config.daemon import DaemonConfig
from daemon.config.mirrors import MirrorSettings
from daemon.intake.accept import Intake
from daemon.mirror.remote import MirrorError, Remote
from daemon.mirror.service import Mirrors
from daemon.service import handlers
from daemon.store.db import Store
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import good_job
from tests.helpers.processes import REPO


def tree(root: Path) -> dict[str, str]:
    """Every file below root and its sha256: what must not change."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture
def daemon(tmp_path):
    """A daemon (handlers in process) whose one mirror `nfs` is tmp/nas; a victim job accepted and mirrored there
    (its prefix: its own id), and another machine's job on the mirror that was never here."""
    home, nas = tmp_path / "home", tmp_path / "nas"
    home.mkdir()
    cfg = DaemonConfig.model_validate({"allowed_roots": ["{home}", str(REPO)], "mirrors": {"nfs": {"url": f"file://{nas}"}}})
    store, log = Store(home / "state.db"), RecLog()
    mirrors = Mirrors(home, cfg, store, log)
    sup = SimpleNamespace(mirrors=mirrors, wake=threading.Event(), notes=[], policy=None, children={})
    ctx = handlers.Context(home=home, store=store, intake=Intake(home, cfg, store, log), supervisor=sup,
                           started_at=time.time(), socket_path=home / "lorad.sock")
    text = yaml.safe_dump(good_job("victim"))
    victim = ctx.intake.submit_text("victim.yaml", text).job_id
    remote = Remote("nfs", MirrorSettings(url=f"file://{nas}"))
    remote.put(f"{victim}/job.yaml", text.encode())
    remote.put(f"{victim}/checkpoints/step-00000004/manifest.json", b"{}")
    remote.put("elsewhere-1a2b/job.yaml", yaml.safe_dump(good_job("elsewhere")).encode())
    yield SimpleNamespace(ctx=ctx, home=home, nas=nas, victim=victim, remote=remote, mirrors=mirrors)
    mirrors.close()
    store.close()


def test_a_from_key_that_is_a_path_or_another_jobs_id_is_refused_in_one_line_and_nothing_changes(daemon):
    before = {"home": tree(daemon.home / "jobs"), "nas": tree(daemon.nas)}
    for ref, said in [
        (f"nfs/../home/jobs/{daemon.victim}", "is not a job id"),  # out of the mirror, into the victim's directory
        (f"nfs//{daemon.home}/jobs/{daemon.victim}", "is not a job id"),  # an absolute key
        (f"file://{daemon.nas}/../home/jobs/{daemon.victim}", "is not a job id"),  # MIRROR_URL/KEY
        (f"nfs/{daemon.victim}/checkpoints", "is not a job id"),  # a separator
        (f"nfs/{daemon.victim}", f"{daemon.victim} is a job of this daemon"),  # its prefix is that job's own
    ]:
        with pytest.raises(p.ProtocolError) as e:
            handlers.submit(daemon.ctx, p.Submit(name="from.yaml", from_mirror=ref))
        msg = e.value.message
        assert e.value.code == "invalid_job" and said in msg and "\n" not in msg, (ref, msg)
        assert ref.rpartition("/")[2] in msg or daemon.victim in msg  # it names the key
    assert [j["id"] for j in daemon.ctx.store.jobs()] == [daemon.victim]  # nothing accepted
    assert {"home": tree(daemon.home / "jobs"), "nas": tree(daemon.nas)} == before


def test_a_restored_job_reads_its_key_and_mirrors_under_its_own_id_only(daemon):
    before = tree(daemon.nas)
    reply = handlers.submit(daemon.ctx, p.Submit(name="from.yaml", from_mirror="nfs/elsewhere-1a2b"))
    new = reply.job
    wait_until(lambda: daemon.ctx.store.get(new)["state"] == "queued", 30, "the restored job queued")
    daemon.mirrors.committed(new, 0)  # its uploader starts: job.yaml goes under its own id
    wait_until(lambda: (daemon.nas / new / "job.yaml").is_file(), 30, "the new job's own prefix")
    assert daemon.mirrors.status(new)["key"] == new
    after = tree(daemon.nas)
    assert {k: v for k, v in after.items() if not k.startswith(f"{new}/")} == before  # the rest unchanged


def test_every_remote_path_is_checked_before_it_is_built_and_a_download_never_writes(tmp_path):
    remote = Remote("nfs", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    for rel in ["../x", "/etc/passwd", "a/../../b", "ok-1/../../b", "ok-1//b", ".", "ok-1/./b"]:
        with pytest.raises(MirrorError, match=r"is not a (job id|path below its key)"):
            remote.path(rel)
    assert remote.path("Flux.v2-1a2b/checkpoints/step-00000001/x") == f"{tmp_path}/nas/Flux.v2-1a2b/checkpoints/" \
                                                                        "step-00000001/x"
    reader = Remote("nfs", MirrorSettings(url=f"file://{tmp_path / 'nas'}"), read_only=True)
    for attempt in (lambda: reader.put("ok-1/x", b"x"), lambda: reader.remove("ok-1")):
        with pytest.raises(MirrorError, match="only reads it"):
            attempt()
    assert not (tmp_path / "nas").exists()
