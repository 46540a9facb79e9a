"""The `lorad` command line as a user meets it: clean one-line errors, JSON errors with --json, quiet broken
pipes, rejected inbox files in `status`, ambiguous names refused, and tidy tables.

The daemon here is the real socket server and handlers over a real store and intake, in this process and
without a supervisor (nothing trains), so every CLI verb runs end to end in well under a second.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from daemon.client.cli import main as lorad
from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.service.handlers import Context, dispatch
from daemon.service.server import SocketServer
from daemon.store.db import Store
from tests.helpers.jobs import QUICKSTART_DATA
from tests.helpers.processes import REPO


def job_yaml(name: str = "short", **over) -> str:
    d = {"name": name, "model": {"path": "builtin:tiny-llama", "dtype": "float32"},
         "data": {"path": str(QUICKSTART_DATA), "seq_len": 32}, "train": {"steps": 5}}
    d.update(over)
    return yaml.safe_dump(d)


class NoLog:
    def __getattr__(self, level):
        return lambda event, **kw: None


class LiveDaemon:
    """The socket API of `lorad serve` without its supervisor: requests are answered, no job ever starts."""

    def __init__(self, home: Path, roots: list[str]):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.store = Store(home / "state.db")
        self.intake = Intake(home, DaemonConfig(allowed_roots=["{home}", *roots]), self.store, NoLog())
        ctx = Context(home=home, store=self.store, intake=self.intake, supervisor=None, started_at=time.time(),
                      socket_path=home / "lorad.sock")
        self.server = SocketServer(home / "lorad.sock", lambda req: dispatch(ctx, req), NoLog())
        self.server.start()

    def submit(self, name: str = "short") -> str:
        return self.intake.submit_text(f"{name}.yaml", job_yaml(name)).job_id

    def close(self) -> None:
        self.server.close()
        self.store.close()


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAD_SOCKET", raising=False)
    d = LiveDaemon(tmp_path / "home", [str(tmp_path), str(REPO)])
    yield d
    d.close()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`lorad ARGV` in this process: (exit status, stdout, stderr). Parser errors exit through SystemExit."""
    try:
        code = lorad(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ================================================================ 1. arguments are checked before anything is sent
@pytest.mark.parametrize("argv, words", [
    (["priority", "short", "5000"], "priority: must be an integer between -1000 and 1000"),
    (["priority", "short", "-1001"], "priority: must be an integer between -1000 and 1000"),
    (["priority", "short", "high"], "priority: must be an integer between -1000 and 1000"),
    (["logs", "-n", "100000", "short"], "-n/--lines: must be an integer between 0 and 10000"),
    (["logs", "-n", "-1", "short"], "-n/--lines: must be an integer between 0 and 10000"),
    (["power", "--limit", "5000"], "--limit: must be a number of watts between 1 and 2000"),
    (["power", "--limit", "nan"], "--limit: must be a number of watts between 1 and 2000"),
    (["power", "--gpu", "-1", "--limit", "200"], "--gpu: must be an integer between 0 and 63"),
    (["power", "--watch", "--interval", "0"], "--interval: must be a number of seconds above 0"),
    (["status", "x" * 201], "job: a job id or name is 1 to 200 characters"),
    (["cancel", ""], "job: a job id or name is 1 to 200 characters"),
])
def test_an_out_of_range_argument_is_one_line_and_exit_2_before_anything_is_sent(capsys, tmp_path, argv, words):
    # No daemon at all: the argument is refused before the CLI even looks for the socket.
    code, out, err = run(capsys, *argv, "--home", str(tmp_path))
    assert code == 2
    assert err == f"lorad: {words}\n" or (err.startswith(f"lorad: {words}") and err.count("\n") == 1), err
    assert "Traceback" not in err and "pydantic" not in err and out == ""


def test_a_file_name_too_long_for_the_protocol_is_refused_in_one_line(capsys, tmp_path):
    long = tmp_path / ("j" * 210 + ".yaml")
    long.write_text(job_yaml())
    code, out, err = run(capsys, "submit", str(long), "--home", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "file name" in err and "Traceback" not in err


def test_boundary_values_are_accepted(capsys, daemon):
    jid = daemon.submit()
    assert run(capsys, "priority", jid, "1000", "--home", str(daemon.home))[:2] == (
        0, f"{jid}: priority 1000 (takes effect when the next job is picked)\n")
    assert run(capsys, "priority", jid, "-1000", "--home", str(daemon.home))[0] == 0
    assert run(capsys, "logs", "-n", "10000", jid, "--home", str(daemon.home))[0] == 0


@pytest.mark.parametrize("content", [
    os.urandom(256) + b"\x00junk",  # binary junk
    job_yaml(data={"path": "/etc/passwd", "seq_len": 32}).encode(),  # outside the allowed roots
], ids=["binary", "etc-passwd"])
def test_submit_and_the_inbox_refuse_the_same_bad_file_for_the_same_reason_with_exit_65(capsys, daemon, tmp_path,
                                                                                         content):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    code, out, err = run(capsys, "submit", str(bad), "--home", str(daemon.home))
    (daemon.home / "inbox" / "bad.yaml").write_bytes(content)
    reason = daemon.intake.take(daemon.home / "inbox" / "bad.yaml").error
    assert code == 65 and out == ""
    assert err == f"lorad: invalid job: {reason}\n"


def test_logs_print_numbers_compactly_while_the_events_file_keeps_them_whole(capsys, daemon):
    jid = daemon.submit()
    events = daemon.home / "jobs" / jid / "events.jsonl"
    with open(events, "a") as f:
        f.write(json.dumps({"event": "step", "level": "info", "ts": "2026-01-01T00:00:00Z", "step": 7,
                            "loss": 1.23456789, "lr": 0.0029999119841746698}) + "\n")
    code, out, _ = run(capsys, "logs", jid, "--home", str(daemon.home))
    step_line = next(ln for ln in out.splitlines() if " step " in ln)
    assert code == 0 and step_line.endswith("step=7 loss=1.235 lr=0.003")
    assert "0.0029999119841746698" in events.read_text()


# ================================================================ 2. rejected inbox files show in `lorad status`
def reject(d: LiveDaemon, name: str, content: str, age_s: float = 0) -> None:
    (d.home / "inbox" / name).write_text(content)
    out = d.intake.take(d.home / "inbox" / name)
    assert out.error, out
    if age_s:
        t = time.time() - age_s
        os.utime(out.rejected_path.with_name(out.rejected_path.name + ".error.txt"), (t, t))


def test_status_lists_the_newest_rejections_with_when_and_why_newest_first(capsys, daemon):
    reject(daemon, "old.yaml", "name: [unclosed\n", age_s=25 * 3600)  # older than a day: not shown
    reject(daemon, "broken.yaml", "name: [unclosed\n", age_s=60)
    reject(daemon, "steps.yaml", job_yaml(train={"steps": "many"}))
    daemon.submit("fine")

    code, out, _ = run(capsys, "status", "--home", str(daemon.home))
    assert code == 0
    lines = out.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith("rejected inbox files"))
    assert lines[i] == "rejected inbox files (last 24 h, newest first):"
    steps, broken = lines[i + 1], lines[i + 2]
    assert lines[i + 3:] == [f"  (each reason in full: {daemon.home / 'rejected'}/NAME.error.txt)"]
    assert steps.split()[0] == "steps.yaml" and "train.steps" in steps
    assert broken.split()[0] == "broken.yaml" and "not valid YAML at line 2" in broken
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() - 60)) in broken  # when
    assert not broken.split("  ")[-1].startswith("broken.yaml:")  # the file name is not said twice
    assert "old.yaml" not in out

    reply = json.loads(run(capsys, "status", "--json", "--home", str(daemon.home))[1])
    assert [r["file"] for r in reply["rejected"]] == ["steps.yaml", "broken.yaml"]
    assert set(reply["rejected"][0]) == {"file", "at", "reason", "error_file"}
    assert "\n" not in reply["rejected"][0]["reason"] and reply["rejected_total"] == 2


def test_rejections_survive_a_daemon_restart_and_only_the_newest_five_are_listed(capsys, daemon, tmp_path):
    for n in range(7):
        reject(daemon, f"bad{n}.yaml", "- a list\n", age_s=100 - n)
    daemon.close()
    again = LiveDaemon(daemon.home, [str(tmp_path), str(REPO)])  # a new daemon on the same home
    try:
        code, out, _ = run(capsys, "status", "--home", str(again.home))
    finally:
        again.close()
    assert "no jobs" in out
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  bad")]
    assert listed == ["bad6.yaml", "bad5.yaml", "bad4.yaml", "bad3.yaml", "bad2.yaml"]
    assert out.splitlines()[-1] == f"  (… and 2 more; each reason in full: {daemon.home / 'rejected'}/NAME.error.txt)"


def test_only_the_daemons_own_error_files_are_read_and_never_through_a_symlink(capsys, daemon, tmp_path):
    reject(daemon, "notes.error.txt", "lorad rejected nothing, honest\n")  # a rejected file with that suffix
    secret = tmp_path / "secret.txt"
    secret.write_text("lorad rejected x:\nthe secret\n")
    (daemon.home / "rejected" / "link.yaml.error.txt").symlink_to(secret)
    reply = json.loads(run(capsys, "status", "--json", "--home", str(daemon.home))[1])
    assert [r["file"] for r in reply["rejected"]] == ["notes.error.txt"]
    assert "must end in .yaml" in reply["rejected"][0]["reason"]


# ================================================================ 7. tidy tables: one line per job, `-` for nothing
LONG_ERROR = ("trainer exited 1: OSError: [Errno 28] No space left on device while writing\n"
              "/srv/lorad/jobs/big-1a2b/checkpoints/step-00000400.tmp-123-abcd/optimizer.safetensors "
              "(free: 0 bytes; the previous checkpoint step-00000300 is intact)")


def test_the_note_is_cut_at_a_word_with_an_ellipsis_on_one_line_without_trailing_spaces(capsys, daemon,
                                                                                         monkeypatch):
    jid = daemon.submit("big")
    daemon.store.update(jid, last_error=LONG_ERROR)
    ok = daemon.submit("ok")
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(capsys, "status", "--home", str(daemon.home))
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["ID", "NAME", "STATE", "PRIO", "STEP", "LOSS", "S/STEP", "ETA", "NOTE"]
    assert [ln.split()[0] for ln in lines[1:3]] == [jid, ok] and len(lines) == 3  # one line per job
    assert all(len(ln) <= 100 and ln == ln.rstrip() for ln in lines)
    note = lines[1][lines[0].index("NOTE"):]
    assert note.endswith("…") and note.startswith("trainer exited 1: OSError: [Errno 28]")  # not markup
    flat = " ".join(LONG_ERROR.split())
    kept = note[:-1]
    assert flat.startswith(kept) and flat[len(kept)] == " "  # cut where a word ends
    assert lines[2].endswith("-")  # no note, no padding after the last column


def test_shorten_keeps_short_text_and_cuts_long_text_at_a_word():
    from daemon.client.render import shorten

    assert shorten("disk full", 20) == "disk full"
    assert shorten("one two\nthree", 20) == "one two three"
    assert shorten("the quick brown fox jumps", 16) == "the quick brown…"
    assert shorten("/a/very/long/path/without/spaces", 12) == "/a/very/lon…"  # no word to cut at: cut anyway


def test_the_detail_view_shows_a_dash_where_there_is_no_value(capsys, daemon):
    jid = daemon.submit()
    daemon.store.begin_attempt(jid, 0)  # queued → running, attempt 1 (no pid yet)
    code, out, _ = run(capsys, "status", jid, "--home", str(daemon.home))
    rows = dict(ln.split(": ", 1) for ln in out.splitlines() if ": " in ln and not ln.startswith("  #"))
    assert code == 0 and rows["             loss"] == "-" and rows["           s/step"] == "-"
    assert "None" not in out
    attempt = next(ln for ln in out.splitlines() if ln.startswith("  #1"))
    assert "pid -" in attempt and "exit -" in attempt


# ================================================================ 3. a name shared by several jobs is not a guess
def test_a_second_submit_of_a_name_in_use_says_so_and_the_name_then_needs_an_id(capsys, daemon, tmp_path):
    job = tmp_path / "short.yaml"
    job.write_text(job_yaml())
    home = ("--home", str(daemon.home))
    code, first, err = run(capsys, "submit", str(job), *home)
    first = first.strip()
    assert code == 0 and err == ""
    code, second, err = run(capsys, "submit", str(job), *home)
    second = second.strip()
    assert code == 0 and second.startswith("short-") and second != first  # stdout: still just the id, for scripts
    assert err == f"lorad: note: 'short' is also the name of {first} (queued); refer to these jobs by id\n"
    code, out, _ = run(capsys, "submit", str(job), "--json", *home)
    reply = json.loads(out)
    third = reply["job"]
    assert reply["same_name"] == [{"id": second, "state": "queued"}, {"id": first, "state": "queued"}]

    for argv in (["cancel", "short"], ["pause", "short"], ["resume", "short"], ["status", "short"],
                 ["logs", "short"], ["priority", "short", "5"]):
        code, out, err = run(capsys, *argv, *home)
        assert code == 1 and out == "", argv
        assert err == (f"lorad: 'short' matches 3 jobs: {third} (queued), {second} (queued), {first} (queued); "
                       "use the id\n"), err
    assert {j["state"] for j in daemon.store.jobs()} == {"queued"}  # nothing was touched

    assert run(capsys, "cancel", first, *home)[:2] == (0, f"{first}: cancelled\n")  # an id is always exact
    assert run(capsys, "cancel", third, *home)[0] == 0
    # One of them is not finished: the name means that one (docs/service-and-cli.md: "Job names and ids").
    assert run(capsys, "pause", "short", *home)[:2] == (0, f"{second}: paused\n")


# ================================================================ 4. with --json, errors are JSON too
JSON_VERBS = [["ping"], ["status"], ["status", "short"], ["logs", "short"], ["pause", "short"],
              ["resume", "short"], ["cancel", "short"], ["priority", "short", "3"], ["drain"], ["power"]]


@pytest.mark.parametrize("argv", JSON_VERBS + [["submit", "JOB"]], ids=lambda a: " ".join(a))
def test_with_json_a_daemon_that_is_down_is_a_json_error_on_stdout_and_exit_69(capsys, tmp_path, argv):
    job = tmp_path / "short.yaml"
    job.write_text(job_yaml())
    argv = [str(job) if a == "JOB" else a for a in argv]
    code, out, err = run(capsys, *argv, "--json", "--home", str(tmp_path))
    assert code == 69
    reply = json.loads(out)
    sock = tmp_path / "lorad.sock"
    assert reply == {"ok": False, "error": "unavailable", "exit": 69,
                     "message": f"the daemon is not running (no socket at {sock})"}
    assert err == f"lorad: the daemon is not running (no socket at {sock})\n"  # people still read stderr


def test_without_json_a_daemon_that_is_down_is_one_line_on_stderr(capsys, tmp_path):
    assert run(capsys, "status", "--home", str(tmp_path)) == (
        69, "", f"lorad: the daemon is not running (no socket at {tmp_path / 'lorad.sock'})\n")


def test_with_json_refusals_invalid_jobs_and_usage_errors_are_json_with_their_exit_status(capsys, daemon, tmp_path):
    code, out, err = run(capsys, "cancel", "nope", "--json", "--home", str(daemon.home))
    assert code == 1 and json.loads(out) == {"ok": False, "error": "not_found", "message": "no job 'nope'", "exit": 1}
    assert err == "lorad: no job 'nope'\n"

    bad = tmp_path / "bad.yaml"
    bad.write_text(job_yaml(train={"steps": "many"}))
    code, out, err = run(capsys, "submit", str(bad), "--json", "--home", str(daemon.home))
    reply = json.loads(out)
    assert code == 65 and reply["error"] == "invalid_job" and reply["exit"] == 65 and "train.steps" in reply["message"]

    code, out, err = run(capsys, "priority", "short", "5000", "--json", "--home", str(daemon.home))
    reply = json.loads(out)
    assert code == 2 and reply["error"] == "usage" and reply["exit"] == 2 and "between -1000 and 1000" in reply["message"]
    assert err.startswith("lorad: priority: must be")


# ================================================================ 5. a closed stdout ends the command quietly
def _many_events(workdir: Path, n: int) -> None:
    with open(workdir / "events.jsonl", "a") as f:
        for i in range(n):
            f.write(json.dumps({"event": "step", "level": "info", "ts": "2025-01-01T00:00:00Z", "step": i,
                                "loss": 1.0 / (i + 1), "padding": "x" * 60}) + "\n")


@pytest.mark.parametrize("argv", [["logs", "-n", "10000", "--json", "JOB"], ["logs", "JOB", "-n", "5000"],
                                  ["status"], ["status", "--json"]], ids=lambda a: " ".join(a))
def test_a_reader_that_stops_early_ends_the_command_quietly(daemon, argv):
    import subprocess
    import sys

    from tests.helpers.processes import child_env

    jid = daemon.submit()
    # The fillers need no power-cut safety: 1500 commits at synchronous=FULL (an fsync each) took ~4 s a run.
    daemon.store.db.execute("PRAGMA synchronous=OFF")
    for i in range(1500):  # a status table far longer than a pipe's buffer (64 KiB)
        daemon.store.add_job(f"filler-{i:04d}", "filler", daemon.home / "jobs" / f"filler-{i:04d}", 0, 5, "test")
    daemon.store.set_meta("drain", "1")  # a line after the table: a second write after the reader is gone
    _many_events(Path(daemon.store.get(jid)["workdir"]), 10000)
    argv = [jid if a == "JOB" else a for a in argv]
    # `lorad ... | head -1`: head reads one line and closes the pipe.
    proc = subprocess.Popen([sys.executable, "-m", "daemon.client.cli", *argv, "--home", str(daemon.home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=str(REPO))
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(60)
    assert first.strip()
    # 141 (128 + SIGPIPE) like any Unix tool; 0 where the kernel took a partial write and Python let it be.
    assert code in (0, 141), err
    assert err == ""  # no traceback, no "Exception ignored" at exit
