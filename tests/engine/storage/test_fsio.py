"""engine/storage/fsio.py: a durable write never writes through a name someone else could plant."""

from __future__ import annotations

import os

import pytest

from engine.storage.fsio import RealFs, write_file_durable


def test_a_symlink_planted_at_a_guessable_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    for guess in (f".out.json.tmp-{os.getpid()}", ".out.json.tmp", ".out.json.tmp-0"):
        (shared / guess).symlink_to(victim)

    write_file_durable(RealFs(), shared / "out.json", b"{}")

    assert victim.read_bytes() == b"precious"
    assert (shared / "out.json").read_bytes() == b"{}" and not (shared / "out.json").is_symlink()
    leftovers = sorted(p.name for p in shared.iterdir() if not p.is_symlink() and p.name != "out.json")
    assert leftovers == []  # the temp file was renamed into place


def test_two_writes_use_different_temp_names_and_the_file_gets_the_usual_mode(tmp_path, monkeypatch):
    names = []
    fs = RealFs()
    real_write = fs.write
    monkeypatch.setattr(fs, "write", lambda p, chunks: names.append(p.name) or real_write(p, chunks))
    write_file_durable(fs, tmp_path / "a", b"1")
    write_file_durable(fs, tmp_path / "a", b"2")
    assert len(set(names)) == 2 and all(n.startswith(".a.tmp-") for n in names)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_the_file_layer_does_not_write_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError):
        RealFs().write(tmp_path / "link", [b"x"])
    assert victim.read_bytes() == b"precious"


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
