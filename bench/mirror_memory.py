"""The daemon's memory while a large checkpoint goes to its mirror and comes back: flat in the checkpoint's size.

    .venv/bin/python bench/mirror_memory.py                       # a 256 MiB checkpoint file, a file:// mirror
    .venv/bin/python bench/mirror_memory.py --size-mb 2048 --backend s3

One checkpoint with one large file (sparse on the local disk: no write to make it) is uploaded by the daemon's own
uploader (daemon/mirror/uploader.py, a JobMirror told of the commit) and downloaded by the daemon's own download
(daemon/mirror/restore.py, as `lorad submit --from` runs it), in this process, as in the daemon. A thread samples
this process's RSS (VmRSS) every 5 ms; each phase prints how far it rose above where the phase started. The
baseline, measured in the same run, is what the mirror did before it streamed: the file read whole into memory
(`read_bytes`, as `read_in_job(most=1<<40)` and `fs.cat_file` did). Printed: each phase's growth in MiB, and the
ratio of the streamed phases' growth to the baseline's (bar: under 0.25; streamed, it is a few MiB of buffers).
--backend s3 runs moto's S3 server on loopback (tests/helpers/storage.py; its own memory is its own process's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def growth(fn) -> int:
    """How far this process's RSS rose above where it was while fn ran (bytes)."""
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(0, max(peak[0], rss()) - base)


def checkpoint(workdir: Path, size: int, cfg) -> Path:
    """jobs/ID/checkpoints/step-00000001/ with every file a checkpoint needs; optimizer.safetensors is `size`
    bytes (sparse), the others small; its manifest as the engine writes it (format, step, identity, sha256s)."""
    from engine.checkpoint.store import CHECKPOINT_FILES, FORMAT_VERSION

    d = workdir / "checkpoints" / "step-00000001"
    d.mkdir(parents=True)
    files = {}
    for name in CHECKPOINT_FILES:
        with open(d / name, "wb") as f:
            f.write(f"lorad bench {name}\n".encode())
            if name == "optimizer.safetensors":
                f.truncate(size)
        h = hashlib.sha256()
        with open(d / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        files[name] = {"size": (d / name).stat().st_size, "sha256": h.hexdigest()}
    (d / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "step": 1, "files": files,
                                                 "config_hash": cfg.identity_hash(), "identity": cfg.identity()}))
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256, help="the checkpoint's large file, MiB (default 256)")
    ap.add_argument("--backend", choices=["file", "s3"], default="file")
    args = ap.parse_args()

    import yaml

    from daemon.config.mirrors import MirrorSettings
    from daemon.mirror.remote import Remote
    from daemon.mirror.restore import fetch
    from daemon.mirror.uploader import JobMirror
    from engine.config.job import dump_job, parse_job
    from tests.helpers.fakes import RecLog
    from tests.helpers.jobs import QUICKSTART_DATA

    size = args.size_mb << 20
    root = Path(tempfile.mkdtemp(prefix="lorad-mirror-memory-"))
    s3 = None
    try:
        if args.backend == "s3":
            from tests.helpers.storage import start_s3

            s3 = start_s3(root)
            settings = s3.mirror("bench", timeout_s=60.0)
        else:
            settings = {"url": f"file://{root / 'nas'}"}
        remote = Remote(args.backend, MirrorSettings.model_validate(settings))
        raw = {"name": "bench", "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
               "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 1}}
        cfg = parse_job(raw, REPO)
        text = dump_job(cfg)
        workdir = root / "jobs" / "bench-1"
        big = checkpoint(workdir, size, cfg) / "optimizer.safetensors"
        print(f"checkpoint: {size >> 20} MiB in optimizer.safetensors (+4 small files), mirror: {args.backend}; "
              f"RSS at start {rss() >> 20} MiB")

        m = JobMirror("bench-1", workdir, "bench-1", remote, 1, text, RecLog()).start()

        def upload() -> None:
            m.committed(1)
            while m.status()["remote_step"] != 1:
                if m.last_error:
                    raise RuntimeError(m.last_error)
                time.sleep(0.01)

        t0 = time.monotonic()
        up = growth(upload)
        up_s = time.monotonic() - t0
        m.close(timeout=5)

        got = []

        def download() -> None:
            got.append(fetch(remote, "bench-1", root / "staging", lambda t: parse_job(yaml.safe_load(t), REPO)))

        t0 = time.monotonic()
        down = growth(download)
        down_s = time.monotonic() - t0
        assert got[0].step == 1, got[0].skipped
        back = got[0].checkpoints / "step-00000001" / "optimizer.safetensors"
        assert back.stat().st_size == size
        shutil.rmtree(root / "staging")

        whole = growth(lambda: big.read_bytes())  # the baseline: what a whole-file read costs
        print(f"upload   (streamed): +{up / 2**20:7.1f} MiB RSS, {up_s:6.1f} s")
        print(f"download (streamed): +{down / 2**20:7.1f} MiB RSS, {down_s:6.1f} s")
        print(f"baseline (the file read whole, as before): +{whole / 2**20:7.1f} MiB RSS")
        ratio = max(up, down) / max(whole, 1)
        print(f"ratio streamed/whole: {ratio:.3f} (bar < 0.25): {'ok' if ratio < 0.25 else 'OVER'}")
        return 0 if ratio < 0.25 else 1
    finally:
        if s3 is not None:
            s3.server.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
