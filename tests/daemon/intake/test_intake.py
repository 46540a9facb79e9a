"""Job intake: which inbox files are complete, and how every kind of bad job file is rejected with a reason."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
import yaml

from daemon.config.daemon import DaemonConfig
from daemon.intake import accept as intake_mod
from daemon.intake.accept import Intake
from daemon.intake.inbox import InboxWatcher
from daemon.store.db import Store
from daemon.system.log import setup
from engine.config.job import load_job
from tests.helpers.daemon import wait_until
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import QUICKSTART_DATA, good_job
from tests.helpers.processes import REPO


# ---------------------------------------------------------------- the watcher: only complete files
@pytest.fixture
def watcher(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    w = InboxWatcher(inbox, settle_s=0.5, rescan_s=0.2)
    w.start()
    yield w
    w.stop()


def collect(w: InboxWatcher, seconds: float) -> list[str]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out += [p.name for p in w.poll()]
        time.sleep(0.05)
    return out


def test_a_file_being_written_is_not_taken_until_it_is_closed(watcher):
    f = open(watcher.inbox / "job.yaml", "w")
    f.write("name: half")
    f.flush()
    assert "job.yaml" not in collect(watcher, 1.5)  # open for writing: not the watcher, not the rescan
    f.write("\n")
    f.close()
    assert "job.yaml" in wait_until(lambda: [p.name for p in watcher.poll()], 5, "the closed file")


def test_a_file_renamed_in_is_taken(watcher, tmp_path):
    src = tmp_path / "elsewhere.yaml"
    src.write_text("name: x\n")
    os.rename(src, watcher.inbox / "moved.yaml")
    assert "moved.yaml" in wait_until(lambda: [p.name for p in watcher.poll()], 5, "the renamed file")


def test_files_present_before_start_are_picked_up_and_hidden_or_partial_names_are_left_alone(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for n in ("early.yaml", ".hidden.yaml", "copying.yaml.part", "editor.yaml~"):
        (inbox / n).write_text("name: x\n")
        os.utime(inbox / n, (time.time() - 10, time.time() - 10))
    w = InboxWatcher(inbox, settle_s=0.5, rescan_s=30)
    assert [p.name for p in w.poll()] == ["early.yaml"]


# ---------------------------------------------------------------- intake: accept or reject with a reason
@pytest.fixture
def intake(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    cfg = DaemonConfig(allowed_roots=["{home}", str(tmp_path / "allowed"), str(REPO)], max_job_file_bytes=8192)
    (tmp_path / "allowed").mkdir()
    it = Intake(home, cfg, store, setup())
    yield it
    store.close()


def drop(intake: Intake, name: str, content: bytes | str) -> Path:
    p = intake.inbox / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def bomb() -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nname: bomb\n"


BAD = {
    # file name: (content, words the reason must contain)
    "garbage.yaml": (os.urandom(512) + b"\x00", "binary"),
    "bomb.yaml": (bomb(), "YAML bomb"),
    "huge.yaml": ("# padding\n" * 2000, "larger than"),
    "types.yaml": (yaml.safe_dump(good_job(train={"steps": "many"})), "train.steps"),
    "unknown.yaml": (yaml.safe_dump({**good_job(), "trian": {"steps": 3}}), "trian: unknown key"),
    "traversal.yaml": (yaml.safe_dump(good_job(name="../../etc/cron.d/evil")), "name"),
    "missing.yaml": (yaml.safe_dump(good_job(data={"path": "/nonexistent/data.jsonl"})), "does not exist"),
    "remote.yaml": (yaml.safe_dump(good_job(model={"path": "builtin:tiny-llama", "trust_remote_code": True})),
                    "trust_remote_code"),
    "notamap.yaml": ("- just\n- a list\n", "mapping"),
    "broken.yaml": ("name: [unclosed\n", "not valid YAML at line"),
    "bad name;rm -rf.yaml": (yaml.safe_dump(good_job()), "file name"),
    "notes.txt": ("hello", "must end in .yaml"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_job_files_land_in_rejected_with_a_readable_reason(intake, name):
    content, words = BAD[name]
    out = intake.take(drop(intake, name, content))
    assert out is not None and out.job_id is None, out
    assert words in out.error, out.error
    err = out.rejected_path.with_name(out.rejected_path.name + ".error.txt").read_text()
    assert words in err and err.startswith("lorad rejected")
    assert out.rejected_path.exists() and not (intake.inbox / name).exists()
    assert "/" not in out.rejected_path.name and ";" not in out.rejected_path.name
    assert intake.store.jobs() == []


def test_a_symlink_out_of_the_allowed_roots_is_not_even_read(intake):
    (intake.inbox / "passwd.yaml").symlink_to("/etc/passwd")
    out = intake.take(intake.inbox / "passwd.yaml")
    assert "outside the allowed roots" in out.error and "root:" not in out.error
    assert "root:" not in out.rejected_path.with_name(out.rejected_path.name + ".error.txt").read_text()


def test_a_data_path_that_escapes_through_a_symlink_is_rejected(intake, tmp_path):
    link = tmp_path / "allowed" / "data.jsonl"
    link.symlink_to("/etc/hostname")
    out = intake.take(drop(intake, "escape.yaml", yaml.safe_dump(good_job(data={"path": str(link)}))))
    assert "data.path" in out.error and "outside the allowed roots" in out.error


def test_a_fifo_is_rejected_without_blocking(intake):
    os.mkfifo(intake.inbox / "fifo.yaml")
    out = intake.take(intake.inbox / "fifo.yaml")
    assert "not a regular file" in out.error


def test_a_symlink_to_a_fifo_or_to_a_good_file_inside_the_roots(intake, tmp_path):
    os.mkfifo(tmp_path / "allowed" / "fifo.yaml")
    (intake.inbox / "to-fifo.yaml").symlink_to(tmp_path / "allowed" / "fifo.yaml")
    assert "not a regular file" in intake.take(intake.inbox / "to-fifo.yaml").error  # never opened: no wait
    (tmp_path / "allowed" / "mine.yaml").write_text(yaml.safe_dump(good_job("linked")))
    (intake.inbox / "linked.yaml").symlink_to(tmp_path / "allowed" / "mine.yaml")
    out = intake.take(intake.inbox / "linked.yaml")
    assert out.error is None and intake.store.get(out.job_id)["name"] == "linked"


def test_a_good_file_becomes_a_queued_job_with_a_normalised_job_yaml(intake):
    out = intake.take(drop(intake, "good.yaml", yaml.safe_dump(good_job(data={"path": "data.jsonl", "seq_len": 32}))
                           .replace("data.jsonl", os.path.relpath(QUICKSTART_DATA, intake.inbox))))
    assert out.error is None, out.error
    job = intake.store.get(out.job_id)
    assert out.job_id.startswith("good-") and job["state"] == "queued"
    cfg = load_job(Path(job["workdir"]) / "job.yaml")  # loads back as the trainer will load it
    assert cfg.data.path == str(QUICKSTART_DATA)  # relative paths resolved against the inbox
    assert (Path(job["workdir"]) / "submitted.yaml").exists() and not (intake.inbox / "good.yaml").exists()


def test_same_name_rejections_do_not_overwrite_each_other(intake):
    a = intake.take(drop(intake, "x.yaml", "- a"))
    b = intake.take(drop(intake, "x.yaml", "- b"))
    assert a.rejected_path != b.rejected_path and a.rejected_path.read_text() == "- a"


def test_a_claimed_file_left_by_a_crash_is_finished_once(intake):
    # Crash after the claim, before validation: the file waits in incoming/ and is accepted at start-up.
    (intake.incoming / "1-late.yaml").write_text(yaml.safe_dump(good_job("late")))
    # Crash after the job row was written, before the claimed copy was removed: not accepted twice.
    first = intake.take(drop(intake, "dup.yaml", yaml.safe_dump(good_job("dup"))))
    source = intake.store.get(first.job_id)["source"]
    (intake.incoming / source).write_text(yaml.safe_dump(good_job("dup")))
    outs = intake.recover()
    assert [o.name for o in outs] == ["late.yaml"] and outs[0].job_id
    assert sorted(j["name"] for j in intake.store.jobs()) == ["dup", "late"]
    assert list(intake.incoming.iterdir()) == []


def test_submit_over_the_socket_is_validated_by_the_daemon_too(intake):
    from engine.errors import JobInvalid

    with pytest.raises(JobInvalid, match="file name"):
        intake.submit_text("../../x.yaml", yaml.safe_dump(good_job()))
    with pytest.raises(JobInvalid, match="trust_remote_code"):
        intake.submit_text("x.yaml", yaml.safe_dump(good_job(model={"path": "builtin:tiny-llama",
                                                                    "trust_remote_code": True})))
    assert intake.submit_text("x.yaml", yaml.safe_dump(good_job())).job_id.startswith("good-")


# ---------------------------------------------------------------- a full disk is not a verdict on the file
def disk_full_for(monkeypatch, *names: str) -> None:
    """write_durable fails with ENOSPC for files of these names (all files if none is given)."""
    real = intake_mod.write_durable

    def write(path, data, mode):
        if not names or Path(path).name in names:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data, mode)

    monkeypatch.setattr(intake_mod, "write_durable", write)


@pytest.fixture
def quiet_intake(intake):
    intake.log = RecLog()
    return intake


def test_disk_full_while_accepting_keeps_the_file_in_incoming_says_so_once_and_takes_it_later(quiet_intake,
                                                                                             monkeypatch):
    it = quiet_intake
    disk_full_for(monkeypatch, "job.yaml")  # submitted.yaml fits, job.yaml does not: a half-made jobs/ID/
    out = it.take(drop(it, "full.yaml", yaml.safe_dump(good_job("full"))))
    assert out.stuck and out.job_id is None and "No space left on device" in out.error
    (claimed,) = it.incoming.iterdir()  # safe, unchanged, not rejected
    assert yaml.safe_load(claimed.read_text())["name"] == "full" and list(it.rejected.iterdir()) == []
    assert list((it.home / "jobs").iterdir()) == [] and it.store.jobs() == []  # the partial jobs/ID/ is gone
    (stuck,) = it.stuck
    assert stuck["file"] == "full.yaml" and stuck["error"] == "OSError: [Errno 28] No space left on device"
    it.recover()
    it.recover()  # still full: tried again, said once
    assert len(it.log.named("intake_stuck")) == 1 and it.stuck[0]["tries"] == 3
    monkeypatch.undo()
    (done,) = it.recover()
    assert done.job_id and not done.stuck and it.stuck == [] and list(it.incoming.iterdir()) == []
    assert it.store.get(done.job_id)["state"] == "queued" and len(it.log.named("intake_unstuck")) == 1


def test_disk_full_while_rejecting_keeps_the_file_and_leaves_nothing_in_rejected(quiet_intake, monkeypatch):
    it = quiet_intake
    disk_full_for(monkeypatch)
    out = it.take(drop(it, "broken.yaml", "name: [unclosed\n"))
    assert out.stuck and len(list(it.incoming.iterdir())) == 1 and list(it.rejected.iterdir()) == []
    monkeypatch.undo()
    (done,) = it.recover()
    assert "not valid YAML" in done.error and not done.stuck and list(it.incoming.iterdir()) == []
    assert (it.rejected / "broken.yaml.error.txt").exists()


class ListInbox:
    def __init__(self, paths):
        self.paths = list(paths)

    def poll(self):
        out, self.paths = self.paths, []
        return out


def test_the_service_loop_retries_a_stuck_file_and_stays_healthy_and_status_says_why(intake, monkeypatch, capsys):
    from daemon import protocol as p
    from daemon.client.render import print_stuck
    from daemon.service.handlers import Context, dispatch
    from daemon.supervisor.loop import Supervisor

    cfg = intake.cfg.model_copy(update={"inbox_rescan_s": 0.2})
    intake.cfg = cfg
    sup = Supervisor(intake.home, cfg, intake.store, [None], setup(), intake=intake,
                     inbox=ListInbox([drop(intake, "full.yaml", yaml.safe_dump(good_job("full")))]))
    sup.may_start = False
    sup._spawn = lambda: None  # this test is about the inbox only
    disk_full_for(monkeypatch)
    sup.tick()
    assert sup.healthy and sup.intake.stuck and "inbox stuck (1 file(s)" in sup.status_line()
    ctx = Context(home=intake.home, store=intake.store, intake=intake, supervisor=sup, started_at=0,
                  socket_path=intake.home / "s")
    data = json.loads(dispatch(ctx, p.Status()))["data"]
    assert [s["file"] for s in data["inbox_stuck"]] == ["full.yaml"] and data["inbox_retry_s"] == 0.2
    print_stuck(data, 100)
    shown = capsys.readouterr().out
    assert "inbox stuck: 1 file(s) not taken yet" in shown and "No space left on device" in shown
    assert str(intake.incoming) in shown
    monkeypatch.undo()
    wait_until(lambda: (sup.tick(), intake.store.jobs())[1], 5, "the file to be taken on a later tick")
    assert sup.healthy and intake.stuck == [] and "inbox stuck" not in sup.status_line()


class RescanningInbox:
    """Every file on the first poll, then (as the real inbox's rescans do) whatever is still in the inbox."""

    def __init__(self, folder):
        self.folder, self.polls = folder, 0

    def poll(self):
        self.polls += 1
        return sorted(p for p in self.folder.iterdir() if not p.name.startswith("."))


def test_a_flood_of_inbox_files_is_taken_a_batch_per_tick_and_each_exactly_once(quiet_intake, monkeypatch):
    from daemon.supervisor import loop
    from daemon.supervisor.loop import Supervisor

    # The count cap alone decides the batches here: under load a file can take more than INTAKE_BUDGET_S / 50
    # (seen: 12-17 files per 0.5 s at load 5), and the time cap would cut a batch short (bench/inbox_flood.py
    # measures that cap against the watchdog).
    monkeypatch.setattr(loop, "INTAKE_BUDGET_S", 60.0)
    it = quiet_intake
    for i in range(120):  # good and bad files: accepts and rejections both cost a tick's budget
        drop(it, f"job-{i:03d}.yaml", yaml.safe_dump(good_job(f"flood{i}")) if i % 3 else "name: [unclosed\n")
    sup = Supervisor(it.home, it.cfg, it.store, [None], setup(), intake=it, inbox=RescanningInbox(it.inbox))
    sup.may_start = False
    sup._spawn = lambda: None  # this test is about the inbox only
    taken = []
    real_take = it.take
    it.take = lambda path: (taken.append(path.name), real_take(path))[1]
    per_tick = []
    while True:
        before = len(taken)
        sup.tick()
        per_tick.append(len(taken) - before)
        assert sup.healthy
        if not sup._backlog and not any(it.inbox.iterdir()):
            break
        assert sup.wake.is_set()  # a backlog asks for the next tick at once
        sup.wake.clear()
    assert per_tick == [loop.INTAKE_PER_TICK, loop.INTAKE_PER_TICK, 20]
    assert sorted(taken) == [f"job-{i:03d}.yaml" for i in range(120)]  # each once, though rescans found it again
    assert len(it.store.jobs()) == 80 and len(list(it.rejected.glob("*.error.txt"))) == 40


def test_while_a_trainer_runs_a_flood_is_taken_in_batches_that_rest_three_times_as_long(quiet_intake, monkeypatch):
    """A back-to-back flood cost a training job 20% of its step time on 2 cores (bench/inbox_flood.py): while
    trainers run, intake keeps to INTAKE_SHARE_WHILE_TRAINING of the loop's time."""
    import time

    from daemon.supervisor import loop
    from daemon.supervisor.loop import Supervisor

    monkeypatch.setattr(loop, "INTAKE_BUDGET_S", 60.0)  # the count cap alone decides a batch (see above)
    it = quiet_intake
    for i in range(120):
        drop(it, f"job-{i:03d}.yaml", yaml.safe_dump(good_job(f"rest{i}")))
    sup = Supervisor(it.home, it.cfg, it.store, [None], setup(), intake=it, inbox=RescanningInbox(it.inbox))
    sup.children["running"] = object()  # a trainer is running: _inbox only asks whether there is one
    stamps = []
    real_take = it.take
    it.take = lambda path: (stamps.append(time.monotonic()), real_take(path), stamps.append(time.monotonic()))[1]
    t0 = time.monotonic()
    sup._inbox()
    spent = time.monotonic() - t0
    assert len(it.store.jobs()) == loop.INTAKE_PER_TICK and not sup.wake.is_set()  # no tick at once
    taking = stamps[-1] - stamps[0]  # at most what the batch measured itself
    assert stamps[-1] + 3 * taking <= sup._intake_rest_until <= time.monotonic() + 3 * spent
    sup._inbox()  # resting: a heartbeat's tick takes nothing
    assert len(it.store.jobs()) == loop.INTAKE_PER_TICK
    sup._intake_rest_until = 0.0
    sup._inbox()
    assert len(it.store.jobs()) == 2 * loop.INTAKE_PER_TICK
    sup.children.clear()  # no trainer: the rest goes back to back
    sup._intake_rest_until = 0.0
    sup._inbox()
    assert len(it.store.jobs()) == 120 and sup._intake_rest_until == 0.0


# ---------------------------------------------------------------- directories others can write (issue 23, finding 1)
def test_a_symlink_planted_at_the_rejection_temp_name_is_never_written_through(intake, tmp_path):
    victim = tmp_path / "state.db"  # what the attack replaced: the daemon's own database
    victim.write_bytes(b"SQLite format 3\x00 precious")
    # The temp name an older lorad used (its pid comes from `lorad ping`), and guesses at any other.
    for guess in (f".broken.yaml.error.txt.tmp-{os.getpid()}", ".broken.yaml.error.txt.tmp"):
        (intake.rejected / guess).symlink_to(victim)
    out = intake.take(drop(intake, "broken.yaml", "name: [unclosed\n"))
    assert victim.read_bytes() == b"SQLite format 3\x00 precious"
    assert "not valid YAML" in out.error  # rejected all the same, with its reason: nothing lost
    assert (intake.rejected / "broken.yaml.error.txt").read_text().startswith(intake_mod.REJECTED_HEADER)
    assert (intake.rejected / "broken.yaml").read_text() == "name: [unclosed\n"


def test_only_the_daemon_writes_in_incoming_and_rejected_and_the_shared_inbox_is_sticky(tmp_path):
    old = os.umask(0o007)  # the unit's UMask: group-writable directories unless the daemon sets modes itself
    try:
        it = Intake(tmp_path, DaemonConfig(), Store(tmp_path / "state.db"), RecLog())
    finally:
        os.umask(old)

    def mode(p: Path) -> int:
        return os.stat(p).st_mode & 0o7777

    assert mode(it.inbox) == 0o1770  # the socket group drops files; none may rename or remove another's
    assert mode(it.incoming) == 0o750 and mode(it.rejected) == 0o750
