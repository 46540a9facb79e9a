"""Crash-state enumeration of the checkpoint commit.

Crash model (what a power cut may leave on disk, per POSIX and ext4/xfs practice):

* File contents: bytes written to a file are durable only after an fsync of
  that file. A write not yet fsynced may survive whole, not at all (the old
  contents, or an empty file if it was new), torn to a prefix, or as garbage
  of the right length (blocks allocated but never written).
* Directory entries: creating a name (mkdir, creating a file, the target of a
  rename) or removing one (the source of a rename, rmtree) is durable only
  after an fsync of the directory that holds the name. Until then each such
  name is independently in its old or new state (present or absent); a rename
  may therefore appear done, undone, or as both or neither of its names. The
  objects themselves (a directory's own entries, a file's data) follow their
  own rules above, wherever the names point.
* fsync is honest: after it returns, what it covers survives.

A recording file layer wraps the real one while a real `CheckpointStore.commit`
runs. For every prefix of the recorded operations we build an in-memory model
of the disk, enumerate every state the model allows, write each state into a
fresh directory and run the real loader on it. It must return the previous or
the new checkpoint with exactly its saved contents, must never raise, and once
`commit` has returned it must return the new one.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import pytest
import torch

from engine.checkpoint.state import snapshot
from engine.checkpoint.store import CheckpointStore, Snapshot
from engine.config.train import TrainConfig
from engine.storage.fsio import RealFs
from engine.training.optim import build_optimizer

HASH = "0123456789abcdef"


# ----------------------------------------------------------------- recording layer
class RecordingFs:
    """Passes every operation to the real file layer and records the ones that succeeded."""

    def __init__(self, inner=None):
        self.inner = inner or RealFs()
        self.ops: list[tuple] = []

    def mkdir(self, path):
        self.inner.mkdir(path)
        self.ops.append(("mkdir", Path(path)))

    def write(self, path, chunks):
        data = b"".join(bytes(c) for c in chunks)
        n = self.inner.write(path, [data])
        self.ops.append(("write", Path(path), data))
        return n

    def fsync(self, path):
        self.inner.fsync(path)
        self.ops.append(("fsync", Path(path)))

    def fsync_dir(self, path):
        self.inner.fsync_dir(path)
        self.ops.append(("fsync_dir", Path(path)))

    def rename(self, src, dst):
        self.inner.rename(src, dst)
        self.ops.append(("rename", Path(src), Path(dst)))

    def rmtree(self, path):
        existed = Path(path).exists()
        self.inner.rmtree(path)
        if existed:
            self.ops.append(("rmtree", Path(path)))


# ----------------------------------------------------------------- disk model
@dataclass(eq=False)
class File:
    data: bytes  # what a reader sees now
    durable: bytes  # what survives a power cut for sure


@dataclass(eq=False)
class Dir:
    entries: dict[str, Node] = field(default_factory=dict)  # names now
    durable: dict[str, Node] = field(default_factory=dict)  # names as of the last fsync of this directory


Node = Union[File, Dir]


def model_of(path: Path) -> Dir:
    """The model of a directory tree that is fully on disk (everything durable)."""
    d = Dir()
    for p in sorted(path.iterdir()):
        node: Node = model_of(p) if p.is_dir() else File(p.read_bytes(), p.read_bytes())
        d.entries[p.name] = node
    d.durable = dict(d.entries)
    return d


class Disk:
    def __init__(self, top: Path):
        self.top = top
        self.root = model_of(top)

    def _parent(self, path: Path) -> tuple[Dir, str]:
        rel = path.relative_to(self.top).parts
        d = self.root
        for part in rel[:-1]:
            d = d.entries[part]
            assert isinstance(d, Dir)
        return d, rel[-1]

    def _node(self, path: Path) -> Node:
        if path == self.top:
            return self.root
        parent, name = self._parent(path)
        return parent.entries[name]

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "mkdir":
            parent, name = self._parent(op[1])
            parent.entries[name] = Dir()
        elif kind == "write":
            parent, name = self._parent(op[1])
            old = parent.entries.get(name)
            if isinstance(old, File):  # truncate and rewrite the same inode
                old.data = op[2]
            else:
                parent.entries[name] = File(op[2], b"")
        elif kind == "fsync":
            f = self._node(op[1])
            f.durable = f.data
        elif kind == "fsync_dir":
            d = self._node(op[1])
            d.durable = dict(d.entries)
        elif kind == "rename":
            sp, sn = self._parent(op[1])
            dp, dn = self._parent(op[2])
            dp.entries[dn] = sp.entries.pop(sn)
        elif kind == "rmtree":
            parent, name = self._parent(op[1])
            _unlink_all(parent.entries[name])
            del parent.entries[name]
        else:
            raise AssertionError(f"unknown op {kind}")


def _unlink_all(node: Node) -> None:
    if isinstance(node, Dir):
        for child in node.entries.values():
            _unlink_all(child)
        node.entries = {}


ABSENT = object()


def file_states(f: File) -> list[bytes]:
    if f.data == f.durable:
        return [f.data]
    torn = [f.durable, b"", f.data[: len(f.data) // 2], bytes(b ^ 0x5A for b in f.data), f.data]
    return list(dict.fromkeys(torn))


def dir_states(d: Dir) -> list[dict[str, Any]]:
    """Every tree a power cut could leave for directory `d` (values: bytes for files, dicts for dirs)."""
    per_name = []
    for name in sorted(set(d.entries) | set(d.durable)):
        now, durable = d.entries.get(name), d.durable.get(name)
        candidates = [now] if now is durable else [durable, now]
        options: list[Any] = []
        for node in candidates:
            if node is None:
                options.append(ABSENT)
            elif isinstance(node, File):
                options.extend(file_states(node))
            else:
                options.extend(dir_states(node))
        per_name.append([(name, o) for o in options])
    return [{n: o for n, o in combo if o is not ABSENT} for combo in itertools.product(*per_name)]


def materialise(tree: dict[str, Any], dest: Path) -> None:
    dest.mkdir()
    for name, v in tree.items():
        if isinstance(v, dict):
            materialise(v, dest / name)
        else:
            (dest / name).write_bytes(v)


# ----------------------------------------------------------------- real snapshots
def make_snapshots(n: int) -> list[Snapshot]:
    """n snapshots of a small model trained with a real bitsandbytes AdamW8bit (8-bit states included)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 64)  # 8192 weights: above bitsandbytes' 4096 threshold for 8-bit state
    params = dict(layer.named_parameters())
    opt = build_optimizer(list(params.values()), TrainConfig(optimizer="adamw8bit", lr=0.01))
    gen = torch.Generator().manual_seed(1)
    snaps = []
    for step in range(1, 4 * n + 1):
        layer(torch.randn(4, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 4 == 0:
            state = {"step": step, "samples_consumed": step * 4, "dataset_size": 100}
            snaps.append(snapshot(step, params, opt, gen, state))
    assert any(t.dtype == torch.uint8 for t in snaps[-1].optimizer_tensors.values())
    return snaps


def same_contents(loaded, snap: Snapshot) -> bool:
    def tensors_equal(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    return (
        loaded.step == snap.step
        and tensors_equal(loaded.adapter, snap.adapter)
        and tensors_equal(loaded.optimizer_tensors, snap.optimizer_tensors)
        and tensors_equal(loaded.rng_tensors, snap.rng_tensors)
        and loaded.optimizer_tree == snap.optimizer_tree
        and loaded.state == snap.state
    )


@pytest.fixture(scope="module")
def snaps() -> list[Snapshot]:
    return make_snapshots(2)


def check_every_crash_state(tmp_path: Path, snaps, keep: int, previous: bool, fs_wrapper=None, only_final=False):
    """Commit snaps[1] (on top of snaps[0] if `previous`); return (states checked, violations).

    only_final: check only the states after commit() returned, and stop at the first violation
    (a broken commit leaves thousands of torn states; one is enough to prove the check bites).
    """
    prev, new = snaps
    work = tmp_path / "job"
    work.mkdir()
    if previous:
        CheckpointStore(work / "checkpoints", HASH, keep).commit(prev)
    disk = Disk(work)
    rec = RecordingFs()
    fs = fs_wrapper(rec) if fs_wrapper else rec
    CheckpointStore(work / "checkpoints", HASH, keep, fs=fs).commit(new)

    violations: list[str] = []
    checked = 0
    # Thousands of small trees: on tmpfs when there is one, to spare the shared disk.
    shm = Path("/dev/shm")
    scratch = Path(tempfile.mkdtemp(prefix="lorad-crash-", dir=shm if shm.is_dir() else tmp_path))
    for k in range(len(rec.ops) + 1):
        if k:
            disk.apply(rec.ops[k - 1])
        committed = k == len(rec.ops)  # commit() has returned: the new checkpoint must be durable
        if only_final and not committed:
            continue
        for i, tree in enumerate(dir_states(disk.root)):
            checked += 1
            d = scratch / f"{k}-{i}"
            materialise(tree, d)
            where = f"after op {k} ({rec.ops[k - 1][0] if k else 'none'}) state {i}"
            try:
                loaded, _ = CheckpointStore(d / "checkpoints", HASH, keep).load_latest()
            except Exception as e:  # the loader must never fail
                violations.append(f"{where}: loader raised {e!r}")
                continue
            if loaded is None:
                ok = not previous and not committed
            elif loaded.step == new.step:
                ok = same_contents(loaded, new)
            elif loaded.step == prev.step:
                ok = previous and not committed and same_contents(loaded, prev)
            else:
                ok = False
            if not ok:
                violations.append(f"{where}: loaded {None if loaded is None else loaded.step}")
            shutil.rmtree(d)
            if only_final and violations:
                break
    shutil.rmtree(scratch)
    return checked, violations


@pytest.mark.parametrize(
    "keep, previous",
    [(3, True), (1, True), (3, False)],
    ids=["over-previous", "over-previous-pruned", "first-checkpoint"],
)
def test_every_power_cut_during_commit_leaves_old_or_new_checkpoint(tmp_path, snaps, keep, previous):
    checked, violations = check_every_crash_state(tmp_path, snaps, keep, previous)
    assert checked > 50  # the enumeration really explored torn and missing states
    assert not violations, f"{len(violations)} of {checked} crash states broke the promise, e.g. {violations[:5]}"


class SkipsFileFsync:
    """A file layer that forgets to fsync files: the enumeration must catch it."""

    def __init__(self, inner):
        self.inner = inner

    def fsync(self, path):
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SkipsParentFsync:
    """A file layer that never fsyncs the checkpoints/ directory after the rename."""

    def __init__(self, inner):
        self.inner = inner

    def fsync_dir(self, path):
        if Path(path).name != "checkpoints":
            self.inner.fsync_dir(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("broken", [SkipsFileFsync, SkipsParentFsync])
def test_the_enumeration_catches_a_commit_that_skips_an_fsync(tmp_path, snaps, broken):
    checked, violations = check_every_crash_state(tmp_path, snaps, keep=3, previous=True, fs_wrapper=broken, only_final=True)
    assert violations, f"a commit without {broken.__name__} passed all {checked} crash states"
