"""The mirror streams: the daemon's memory stays flat in the size of what it uploads or downloads, and a remote
file larger than its manifest says is refused without reading it (issue 38, D). Large files are sparse (no disk).

The daemon's RSS is sampled while the mirror works (this process: the uploader and the download are threads of
the daemon): before, a 1 GB remote manifest took it from 0.5 to 1.58 GB, and every checkpoint file was read whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from daemon.config.mirrors import MirrorSettings
from daemon.mirror.remote import Remote
from daemon.mirror.restore import fetch
from daemon.mirror.uploader import JobMirror
from tests.daemon.mirror.test_uploader import job_copy, mirrored, validate  # noqa: F401 - job_copy: a fixture
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog

BIG = 128 << 20
FLAT = 48 << 20  # what the daemon may grow by while it moves BIG bytes


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def growth_during(fn):
    """(fn's result, how far this process's RSS rose above where it started while fn ran)."""
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(0, max(peak[0], rss()) - base)


def test_a_remote_file_larger_than_its_manifest_says_is_refused_unread_and_memory_stays_flat(job_copy, tmp_path):  # noqa: F811
    workdir, text, _cfg = job_copy
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    local = sorted((workdir / "checkpoints").iterdir(), reverse=True)
    for n in (2, 1, 0):  # the three newest commits on the mirror, one upload each, as they came
        w = tmp_path / f"then-{n}"
        shutil.copytree(workdir, w)
        for p in local[:n]:
            shutil.rmtree(w / "checkpoints" / p.name)
        mirrored(w, text, remote, keep=5)
    steps = sorted((tmp_path / "nas" / "tiny-1" / "checkpoints").iterdir(), reverse=True)
    newest, older = steps[0], steps[1]
    os.truncate(newest / "adapter.safetensors", BIG)  # the server's copy grew (sparse: no disk)
    os.truncate(older / "manifest.json", BIG)  # and the one before it has a huge manifest
    got, grew = growth_during(lambda: fetch(remote, "tiny-1", tmp_path / "staging", validate))
    assert got.skipped[:2] == [
        (newest.name, f"adapter.safetensors is larger than its manifest says "
                      f"({json.loads((newest / 'manifest.json').read_text())['files']['adapter.safetensors']['size']}"
                      f" bytes): refused"),
        (older.name, "its manifest.json is larger than 16777216 bytes")]
    assert got.step is not None and got.step < int(older.name[5:])  # walked back to one that is whole
    assert grew < FLAT, f"the daemon grew by {grew >> 20} MiB reading {BIG >> 20} MiB files"


def test_the_uploader_streams_a_large_checkpoint_file_and_memory_stays_flat(tmp_path):
    workdir = tmp_path / "work"
    ckpt = workdir / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    with open(ckpt / "big.bin", "wb") as f:
        f.write(b"lorad" * 1000)
        f.truncate(BIG)
    h = hashlib.sha256()
    with open(ckpt / "big.bin", "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 1, "files": {
        "big.bin": {"size": BIG, "sha256": h.hexdigest()}}}))
    remote = Remote("nas", MirrorSettings(url=f"file://{tmp_path / 'nas'}"))
    m = JobMirror("big-1", workdir, "big-1", remote, 1, "name: big\n", RecLog()).start()

    def upload() -> None:
        m.committed(1)
        wait_until(lambda: m.status()["remote_step"] == 1 or m.last_error, 120, "the upload")

    _, grew = growth_during(upload)
    m.close(timeout=5)
    assert m.last_error is None and m.status()["remote_step"] == 1
    sent = tmp_path / "nas" / "big-1" / "checkpoints" / "step-00000001" / "big.bin"
    assert sent.stat().st_size == BIG
    with open(sent, "rb") as f:
        assert f.read(5000) == b"lorad" * 1000
    assert grew < FLAT, f"the daemon grew by {grew >> 20} MiB uploading a {BIG >> 20} MiB file"
