"""`lorad export` works on any home: with no daemon serving it (a job trained with `lorad run`, or the daemon
stopped), the saved steps are read straight from HOME/jobs/ID with the daemon's checks — committed checkpoints
only, sha256 verified while copying, no symlink followed, and a copy cut short leaves no file under its name."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from daemon.client.cli import main as lorad
from tests.helpers.jobs import EXPORT_FILES, commit_checkpoint
from tests.helpers.processes import PY, REPO, child_env

WEIGHTS = "pytorch_lora_weights.safetensors"


def test_export_lists_and_copies_a_step_from_a_home_no_daemon_serves(tmp_path, capsys):
    home = tmp_path / "home"
    commit_checkpoint(home / "jobs" / "tiny", 2)
    commit_checkpoint(home / "jobs" / "tiny", 4, {WEIGHTS: b"step-4"})
    (home / "jobs" / "tiny" / "checkpoints" / "step-00000006.tmp-1-2" / "export").mkdir(parents=True)  # torn save
    assert lorad(["export", "tiny", "--home", str(home), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["state"] == "on disk, no daemon"
    assert [s["step"] for s in listed["steps"]] == [4, 2]

    dest = tmp_path / "out"
    assert lorad(["export", "ti", "--home", str(home), "--step", "2", "--to", str(dest)]) == 0  # a prefix will do
    assert {n: (dest / n).read_bytes() for n in EXPORT_FILES} == EXPORT_FILES
    assert "job tiny step 2: 2 file(s) copied" in capsys.readouterr().out

    assert lorad(["export", "tiny", "--home", str(home), "--step", "3", "--to", str(tmp_path / "x")]) == 1
    assert "job tiny has no saved step 3 (saved steps: 4, 2)" in capsys.readouterr().err


def test_export_without_a_daemon_refuses_a_file_that_fails_its_checksum_and_a_symlinked_job(tmp_path, capsys):
    home = tmp_path / "home"
    ckpt = commit_checkpoint(home / "jobs" / "tiny", 2)
    (ckpt / "export" / WEIGHTS).write_bytes(b"diffusers-bytez")  # same size, one byte flipped
    assert lorad(["export", "tiny", "--home", str(home), "--step", "2", "--to", str(tmp_path / "b")]) == 1
    assert "fails verification" in capsys.readouterr().err
    assert not (tmp_path / "b" / WEIGHTS).exists()

    elsewhere = tmp_path / "someone-elses"
    commit_checkpoint(elsewhere, 2)
    (home / "jobs" / "theirs").symlink_to(elsewhere, target_is_directory=True)
    assert lorad(["export", "theirs", "--home", str(home), "--step", "2", "--to", str(tmp_path / "c")]) == 1
    assert "holds no job named 'theirs'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_an_export_killed_mid_copy_leaves_no_file_under_its_final_name(tmp_path):
    home = tmp_path / "home"
    commit_checkpoint(home / "jobs" / "big", 2, {WEIGHTS: bytes(128 << 20)})  # long enough to copy to be caught mid-way
    dest = tmp_path / "out"
    p = subprocess.Popen([PY, "-m", "daemon.client.cli", "export", "big", "--home", str(home), "--step", "2",
                          "--to", str(dest)], env=child_env(), cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (dest.is_dir() and any(dest.iterdir())) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    assert p.returncode == -signal.SIGKILL, "the copy finished before the kill: make the file larger"
    assert not (dest / WEIGHTS).exists()
    assert [f.name for f in dest.iterdir()] and all(f.name.startswith(".") for f in dest.iterdir())


def test_export_lists_a_files_name_with_terminal_escapes_escaped(tmp_path, capsys):
    """Issue 38 F: the names `lorad export` lists come from the job's directory, which its trainer writes; an ESC
    sequence among them (here: one that retitles the terminal) is printed as its escape, never sent raw."""
    home = tmp_path / "home"
    commit_checkpoint(home / "jobs" / "tiny", 2, {"\x1b]0;owned\x07x.safetensors": b"x"})
    assert lorad(["export", "tiny", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07x.safetensors" in out
