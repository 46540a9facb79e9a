"""The mirror's uploader and restore against real servers on loopback (moto's S3, sshd's SFTP, a local path).

A finished tiny job's directory is mirrored the way the daemon does it (one JobMirror, told of the commit), then
read back with daemon/mirror/restore.py: every file equal to the local one, the manifest uploaded last, a torn
or corrupted remote checkpoint passed over with its reason, another job's settings refused.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from daemon.config.mirrors import MirrorSettings
from daemon.mirror.remote import MirrorError, Remote
from daemon.mirror.restore import fetch
from daemon.mirror.uploader import JobMirror
from daemon.supervisor.disk_progress import committed_checkpoints
from engine.config.job import dump_job, parse_job
from engine.errors import JobInvalid
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.processes import REPO, child_env


@pytest.fixture(params=["s3", "sftp", "file"])
def remote(request, tmp_path) -> Remote:
    prefix = f"{request.node.name.replace('[', '-').rstrip(']')}-{time.monotonic_ns()}"
    if request.param == "s3":
        settings = request.getfixturevalue("s3_server").mirror(prefix)
    elif request.param == "sftp":
        settings = request.getfixturevalue("sftp_server").mirror(prefix)
    else:
        settings = {"url": f"file://{tmp_path / 'nas'}", "retry_base_s": 0.2}
    return Remote(request.param, MirrorSettings.model_validate(settings))


@pytest.fixture
def job_copy(tmp_path, finished_tiny_job):
    """A copy of the finished tiny job's directory, and its job text."""
    job, cfg, workdir, names = finished_tiny_job
    dest = tmp_path / "work"
    shutil.copytree(workdir, dest)
    return dest, dump_job(cfg), cfg


def mirrored(workdir: Path, text: str, remote: Remote, key: str = "tiny-1", keep: int = 2) -> JobMirror:
    """The daemon's uploader told of the newest local commit and of the job's end, until it has caught up."""
    m = JobMirror("tiny-1", workdir, key, remote, keep, text, RecLog()).start()
    m.committed(committed_checkpoints(workdir)[0].step)
    m.finished()
    wait_until(lambda: m.status()["caught_up"], 60, f"the mirror to catch up ({m.status()})")
    m.close(timeout=5)
    return m


def validate(text: str):
    return parse_job(yaml.safe_load(text), REPO)


def test_a_committed_checkpoint_its_job_events_and_output_are_mirrored_and_read_back_equal(job_copy, remote, tmp_path):
    workdir, text, cfg = job_copy
    m = mirrored(workdir, text, remote)
    assert m.status()["remote_step"] == 12 and m.status()["last_error"] is None
    assert remote.get("tiny-1/job.yaml").decode() == text
    assert remote.listdir("tiny-1/checkpoints") == ["step-00000012"]  # only the newest commit is uploaded
    local = workdir / "checkpoints" / "step-00000012"
    for f in (p for p in local.rglob("*") if p.is_file()):
        assert remote.get(f"tiny-1/checkpoints/step-00000012/{f.relative_to(local).as_posix()}") == f.read_bytes()
    chunks = remote.listdir("tiny-1/events")  # appended in chunks, named by their byte range
    assert b"".join(remote.get(f"tiny-1/events/{c}") for c in chunks) == (workdir / "events.jsonl").read_bytes()
    assert remote.get("tiny-1/output/adapter_model.safetensors") == \
        (workdir / "output" / "adapter_model.safetensors").read_bytes()

    got = fetch(remote, "tiny-1", tmp_path / "staging", validate)
    assert (got.step, got.skipped) == (12, [])
    assert (got.checkpoints / "step-00000012" / "adapter.safetensors").read_bytes() == \
        (local / "adapter.safetensors").read_bytes()


def test_remote_pruning_keeps_the_newest_complete_ones_and_drops_torn_older_uploads(job_copy, tmp_path):
    workdir, text, cfg = job_copy
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    for old in ("step-00000003", "step-00000006"):  # complete older uploads, and one cut short
        remote.put(f"tiny-1/checkpoints/{old}/manifest.json", b"{}")
    remote.put("tiny-1/checkpoints/step-00000009/adapter.safetensors", b"torn")
    mirrored(workdir, text, remote, keep=2)
    assert remote.listdir("tiny-1/checkpoints") == ["step-00000006", "step-00000012"]


def test_a_torn_or_corrupted_remote_checkpoint_is_passed_over_with_its_reason(job_copy, sftp_server, tmp_path):
    workdir, text, cfg = job_copy
    remote = Remote("sftp", MirrorSettings.model_validate(sftp_server.mirror("walk-back")))
    older = workdir / "checkpoints"
    shutil.rmtree(older / "step-00000012")  # the mirror first sees the older commit ...
    newest_local = max(p.name for p in older.iterdir())
    mirrored(workdir, text, remote, keep=5)
    # ... then a newer one whose manifest never landed (the uploader killed between files) ...
    remote.put("tiny-1/checkpoints/step-00000012/adapter.safetensors", b"half")
    got = fetch(remote, "tiny-1", tmp_path / "staging", validate)
    assert got.step == int(newest_local[5:])
    assert got.skipped == [("step-00000012", "no manifest.json (its upload never finished)")]
    # ... and the one before it flipped on the server's disk: walked back past both, each with its reason.
    served = sftp_server.root / "walk-back" / "tiny-1" / "checkpoints" / newest_local / "adapter.safetensors"
    data = bytearray(served.read_bytes())
    data[len(data) // 2] ^= 0xFF
    served.write_bytes(bytes(data))
    got = fetch(remote, "tiny-1", tmp_path / "staging2", validate)
    assert got.step is None or got.step < int(newest_local[5:])
    assert got.skipped[1] == (newest_local, "adapter.safetensors fails its sha256 checksum (corrupted)")


def test_a_job_whose_settings_differ_from_the_checkpoints_is_refused_naming_the_keys(job_copy, tmp_path):
    workdir, text, cfg = job_copy
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    mirrored(workdir, text, remote)
    other = yaml.safe_load(text)
    other["train"]["lr"] = 0.005
    with pytest.raises(JobInvalid, match=r"train\.lr 0\.002 → 0\.005"):
        fetch(remote, "tiny-1", tmp_path / "staging", validate, text=yaml.safe_dump(other))


UPLOAD_ONCE = """
import sys, yaml
from pathlib import Path
from daemon.config.mirrors import MirrorSettings
from daemon.mirror.remote import Remote
from daemon.mirror.uploader import JobMirror
from daemon.supervisor.disk_progress import committed_checkpoints
from tests.helpers.fakes import RecLog
remote = Remote("s3", MirrorSettings.model_validate(yaml.safe_load(sys.argv[2])))
m = JobMirror("tiny-1", Path(sys.argv[1]), "tiny-1", remote, 5, sys.argv[3], RecLog())
m._pass()
"""


def test_an_uploader_killed_between_files_leaves_nothing_a_resume_would_choose(job_copy, s3_server, tmp_path):
    workdir, text, cfg = job_copy
    settings = s3_server.mirror("killed")
    remote = Remote("s3", MirrorSettings.model_validate(settings))
    newest = workdir / "checkpoints" / "step-00000012"
    aside = tmp_path / "step-00000012"
    newest.rename(aside)
    mirrored(workdir, text, remote, keep=5)  # the older commit is complete on the mirror
    aside.rename(newest)
    child = subprocess.Popen([sys.executable, "-c", UPLOAD_ONCE, str(workdir), yaml.safe_dump(settings), text],
                             env=child_env(LORAD_DEBUG_MIRROR_FILE_DELAY_S="0.3"), cwd=REPO)
    wait_until(lambda: remote.listdir("tiny-1/checkpoints/step-00000012"), 30, "the first file of step 12")
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    left = remote.listdir("tiny-1/checkpoints/step-00000012")
    assert left and "manifest.json" not in left
    got = fetch(remote, "tiny-1", tmp_path / "staging", validate)
    assert got.step is not None and got.step < 12
    assert got.skipped == [("step-00000012", "no manifest.json (its upload never finished)")]


def test_bad_credentials_a_missing_bucket_or_a_wrong_endpoint_fail_the_check_without_showing_the_secret(s3_server,
                                                                                                        tmp_path):
    wrong = tmp_path / "wrong.yaml"
    creds = yaml.safe_load(s3_server.credentials.read_text())
    wrong.write_text(yaml.safe_dump({**creds, "secret": "not-the-secret-at-all"}))
    cases = {
        "bad secret": s3_server.mirror("x", credentials_file=str(wrong)),
        "no bucket": {**s3_server.mirror("x"), "url": "s3://no-such-bucket/x"},
        "wrong endpoint": s3_server.mirror("x", endpoint_url="http://127.0.0.1:9", timeout_s=1.0),
    }
    said = {}
    for what, settings in cases.items():
        with pytest.raises(MirrorError) as e:
            Remote("s3", MirrorSettings.model_validate(settings)).check()
        said[what] = str(e.value)
        assert "not-the-secret-at-all" not in said[what] and s3_server.secret not in said[what]
    assert "signature" in said["bad secret"].lower()
    assert "bucket does not exist" in said["no bucket"]
    assert "127.0.0.1:9" in said["wrong endpoint"]
    Remote("s3", MirrorSettings.model_validate(s3_server.mirror("x"))).check()  # the right ones pass


def test_a_mirror_that_goes_down_is_retried_with_backoff_and_catches_up_once_back(job_copy, sftp_server):
    workdir, text, cfg = job_copy
    remote = Remote("sftp", MirrorSettings.model_validate(sftp_server.mirror("down")))
    sftp_server.server.kill()
    try:
        m = JobMirror("tiny-1", workdir, "tiny-1", remote, 2, text, RecLog()).start()
        m.committed(12)
        wait_until(lambda: m.status()["last_error"], 30, "the failure to show")
        assert m.status()["behind_steps"] == 12 and m.status()["remote_step"] is None
    finally:
        sftp_server.server.start()
    wait_until(lambda: m.status()["remote_step"] == 12, 30, f"the catch-up ({m.status()})")
    wait_until(lambda: m.status()["last_error"] is None, 10, "the error to clear")
    m.close(timeout=5)


def test_the_bandwidth_cap_paces_uploads_to_its_average_rate(tmp_path):
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}", bandwidth_bytes_s=1_000_000))
    started = time.monotonic()
    for i in range(6):
        remote.put(f"f{i}", bytes(100_000))
    took = time.monotonic() - started
    assert took >= 0.6 - 0.25 - 0.02  # 600 kB at 1 MB/s, less the burst allowed after a quiet spell
    assert [len(remote.get(f"f{i}")) for i in range(6)] == [100_000] * 6


def test_files_the_trainer_user_links_elsewhere_are_never_uploaded(job_copy, tmp_path):
    workdir, text, cfg = job_copy
    secret = tmp_path / "someone-elses.txt"
    secret.write_text("TOPSECRET\n")
    (workdir / "output" / "linked.txt").symlink_to(secret)
    (workdir / "events.jsonl").unlink()
    (workdir / "events.jsonl").symlink_to(secret)
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    mirrored(workdir, text, remote)
    assert "linked.txt" not in remote.listdir("tiny-1/output") and remote.listdir("tiny-1/events") == []
    assert not any(b"TOPSECRET" in p.read_bytes() for p in (tmp_path / "nas").rglob("*") if p.is_file())


def test_a_checkpoint_pruned_locally_while_it_goes_is_no_error_the_next_newest_goes_instead(job_copy, tmp_path,
                                                                                             monkeypatch):
    workdir, text, cfg = job_copy
    monkeypatch.setenv("LORAD_DEBUG_MIRROR_FILE_DELAY_S", "0.1")
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    m = JobMirror("tiny-1", workdir, "tiny-1", remote, 2, text, RecLog()).start()
    m.committed(12)
    wait_until(lambda: remote.listdir("tiny-1/checkpoints/step-00000012"), 30, "step 12 under way")
    shutil.rmtree(workdir / "checkpoints" / "step-00000012")  # the trainer's pruning, as it would race
    older = committed_checkpoints(workdir)[0].step
    wait_until(lambda: m.status()["remote_step"] == older, 30, f"step {older} mirrored instead ({m.status()})")
    m.close(timeout=5)
    assert m.status()["last_error"] is None
    assert "manifest.json" not in remote.listdir("tiny-1/checkpoints/step-00000012")
