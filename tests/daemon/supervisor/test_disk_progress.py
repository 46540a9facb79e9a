"""What start-up recovery reads of a job's checkpoints: only what the trainer committed inside its directory; a
FIFO or a symlink the trainer user put there is skipped at once (issue 23)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from daemon.supervisor.disk_progress import committed_checkpoints


def checkpoint(workdir: Path, step: int, files: dict[str, bytes], names: dict[str, int] | None = None) -> Path:
    d = workdir / "checkpoints" / f"step-{step:08d}"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    listed = names if names is not None else {n: len(b) for n, b in files.items()}
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {n: {"size": s} for n, s in listed.items()}}))
    return d


def test_only_committed_checkpoints_inside_the_job_count_and_a_fifo_manifest_never_blocks(tmp_path):
    wd = tmp_path / "job"
    checkpoint(wd, 2, {"adapter.safetensors": b"abc"})
    victim = tmp_path / "victim"
    victim.write_bytes(b"12345")
    checkpoint(wd, 4, {}, names={f"../../../{victim.name}": 5})  # names a file outside: never counted
    fifo_dir = checkpoint(wd, 6, {"adapter.safetensors": b"abc"})
    (fifo_dir / "manifest.json").unlink()
    os.mkfifo(fifo_dir / "manifest.json")
    link_dir = checkpoint(wd, 8, {"adapter.safetensors": b"abc"})
    (link_dir / "manifest.json").unlink()
    (link_dir / "manifest.json").symlink_to(wd / "checkpoints" / "step-00000002" / "manifest.json")
    out: list = []
    t = threading.Thread(target=lambda: out.append(committed_checkpoints(wd)), daemon=True)
    t.start()
    t.join(2.0)
    if t.is_alive():  # free it before failing
        os.close(os.open(fifo_dir / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
    assert len(out) == 1, "reading a FIFO manifest blocked"
    assert [c.step for c in out[0]] == [2]
