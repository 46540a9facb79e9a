"""A damaged newest checkpoint is skipped, named, and the one before it loads."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.checkpoint.store import CheckpointStore
from tests.helpers.jobs import adapter_bytes, read_events
from tests.helpers.processes import PY, REPO, child_env


@pytest.fixture
def trained(finished_tiny_job):
    return finished_tiny_job


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated adapter": ("adapter.safetensors", truncate, "truncated"),
    "bit-flipped optimizer state": ("optimizer.safetensors", flip_bit, "checksum"),
    "bit-flipped rng state": ("rng.safetensors", flip_bit, "checksum"),
    "truncated manifest": ("manifest.json", truncate, "manifest.json"),
    "missing manifest": ("manifest.json", lambda p: p.unlink(), "no manifest"),
    "missing state file": ("state.json", lambda p: p.unlink(), "missing"),
    # valid JSON of the wrong shape: one flipped bit turns a key into another
    "manifest key flipped": ("manifest.json", lambda p: p.write_text(p.read_text().replace('"size"', '"sizd"', 1)),
                             "unreadable (KeyError"),
    "manifest without the adapter": ("manifest.json", lambda p: _drop_file_entry(p, "adapter.safetensors"),
                                     "lists no adapter.safetensors"),
    "manifest files not a mapping": ("manifest.json", lambda p: _set_key(p, "files", [1, 2]), "manifest.json"),
}


def _drop_file_entry(path: Path, name: str) -> None:
    m = json.loads(path.read_text())
    del m["files"][name]
    path.write_text(json.dumps(m))


def _set_key(path: Path, key: str, value) -> None:
    m = json.loads(path.read_text())
    m[key] = value
    path.write_text(json.dumps(m))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_is_skipped_with_its_name_and_reason(trained, tmp_path, damage):
    _, cfg, workdir, names = trained
    ck = tmp_path / "checkpoints"
    shutil.copytree(workdir / "checkpoints", ck)
    fname, hurt, why = DAMAGE[damage]
    hurt(ck / "step-00000012" / fname)

    loaded, skipped = CheckpointStore(ck, cfg.identity_hash(), keep=10).load_latest()

    previous = int(names[-2][5:])
    assert loaded is not None and loaded.step == previous and loaded.state["step"] == previous
    assert [s.name for s in skipped] == ["step-00000012"]
    assert why in skipped[0].reason
    # Set aside, not deleted: the damaged files stay for a post-mortem, and never shadow a new step-12.
    assert not (ck / "step-00000012").exists()
    assert [p.name for p in ck.iterdir() if p.name.startswith("step-00000012.invalid-")]


def test_walk_back_passes_several_damaged_checkpoints(trained, tmp_path):
    _, cfg, workdir, names = trained
    ck = tmp_path / "checkpoints"
    shutil.copytree(workdir / "checkpoints", ck)
    flip_bit(ck / names[-1] / "adapter.safetensors")
    truncate(ck / names[-2] / "optimizer.json")
    loaded, skipped = CheckpointStore(ck, cfg.identity_hash(), keep=10).load_latest()
    assert loaded.step == int(names[-3][5:])
    assert [s.name for s in skipped] == [names[-1], names[-2]]


def test_lorad_run_warns_on_stderr_and_resumes_from_the_previous_one(trained, tmp_path):
    job, cfg, workdir, names = trained
    home = tmp_path / "home"
    shutil.copytree(workdir.parents[1], home)
    mine = home / "jobs" / cfg.name
    finished = adapter_bytes(mine)
    flip_bit(mine / "checkpoints" / "step-00000012" / "adapter.safetensors")

    p = subprocess.run([PY, "-m", "daemon.client.cli", "run", str(job), "--home", str(home), "--quiet"],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)

    assert p.returncode == 0, p.stderr
    warnings = [ln for ln in p.stderr.splitlines() if "skipped checkpoint" in ln]
    assert len(warnings) == 1 and "step-00000012" in warnings[0] and "checksum" in warnings[0]
    events = read_events(mine)
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and skipped[-1]["checkpoint"] == "step-00000012" and skipped[-1]["level"] == "warning"
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed[-1]["from_step"] == int(names[-2][5:])
    # Retraining steps 9-12 from the good checkpoint reproduces the lost one exactly.
    assert adapter_bytes(mine) == finished


def test_only_the_newest_set_aside_invalid_checkpoints_are_kept(tmp_path):
    """Invalid checkpoints are renamed aside for inspection; pruning keeps the newest few, never valid ones."""
    from engine.checkpoint.store import KEEP_INVALID, CheckpointStore

    root = tmp_path / "checkpoints"
    root.mkdir()
    for i in range(KEEP_INVALID + 3):
        (root / f"step-{i:08d}.invalid-skipped-{1000 + i}").mkdir()
    (root / "step-00000007").mkdir()  # named like a checkpoint: pruning of checkpoints is by `keep`, not here
    CheckpointStore(root, "h", keep=3).prune()
    left = sorted(p.name for p in root.iterdir())
    want_aside = [f"step-{i:08d}.invalid-skipped-{1000 + i}" for i in range(3, KEEP_INVALID + 3)]
    assert left == sorted(want_aside + ["step-00000007"])


def test_a_checkpoint_from_a_newer_lorad_is_neither_walked_past_nor_set_aside(trained, tmp_path):
    from engine.errors import NewerCheckpoint

    _, cfg, workdir, _ = trained
    ck = tmp_path / "checkpoints"
    shutil.copytree(workdir / "checkpoints", ck)
    _set_key(ck / "step-00000012" / "manifest.json", "format", 99)
    with pytest.raises(NewerCheckpoint, match="newer lorad .* upgrade lorad"):
        CheckpointStore(ck, cfg.identity_hash(), keep=10).load_latest()
    assert (ck / "step-00000012" / "manifest.json").is_file()  # untouched: pruning can never delete it
    assert not [p for p in ck.iterdir() if ".invalid-" in p.name]
