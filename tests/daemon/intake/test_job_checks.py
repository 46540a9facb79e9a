"""What a job names is checked without ever blocking the caller: special files refused unopened, reads linear and
capped, a check that runs out of time refused naming its path, and the service loop never waiting on one
(engine/config/bounded.py, daemon/intake/checks.py). Also: policy switches on the parsed job, echoes cut."""

from __future__ import annotations

import os
import threading
import time

import pytest
import yaml

from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.intake.checks import MAX_RUNNING, PENDING, Checks
from daemon.intake.rejections import MAX_REASON_CHARS
from daemon.store.db import Store
from daemon.system.log import setup
from engine.config import bounded
from engine.config.job import load_job
from engine.config.policy import JobPolicy
from engine.config.sources import check_text_source, first_text
from engine.errors import JobInvalid
from tests.helpers.daemon import wait_until
from tests.helpers.hostile import alias_bomb
from tests.helpers.jobs import QUICKSTART_DATA, good_job
from tests.helpers.processes import REPO


@pytest.fixture
def intake(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "allowed").mkdir()
    store = Store(home / "state.db")
    cfg = DaemonConfig(allowed_roots=["{home}", str(tmp_path / "allowed"), str(REPO)], intake_check_s=2.0)
    yield Intake(home, cfg, store, setup())
    store.close()


def in_thread(fn, seconds: float):
    """fn() in a thread, joined for at most `seconds`: (finished, its result). Today's code blocked for ever."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), box.get("out")


def test_a_fifo_named_as_data_is_rejected_at_once_naming_it_never_opened_for_a_blocking_read(intake, tmp_path):
    fifo = tmp_path / "allowed" / "data.jsonl"
    os.mkfifo(fifo)
    (intake.inbox / "fifo.yaml").write_text(yaml.safe_dump(good_job(data={"path": str(fifo)})))
    try:
        done, out = in_thread(lambda: intake.take(intake.inbox / "fifo.yaml"), 5)
        assert done, "intake blocked on the FIFO"
        assert out.job_id is None and f"data.path: {fifo} is not a regular file" in out.error
        text = yaml.safe_dump(good_job(data={"path": str(fifo)}))  # `lorad submit`, the dashboard's form
        done, out = in_thread(lambda: pytest.raises(JobInvalid, intake.submit_text, "fifo.yaml", text), 5)
        assert done and f"data.path: {fifo} is not a regular file" in str(out.value)
    finally:
        try:  # release a reader blocked in open() (today's code), so no thread is left behind
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_every_reader_of_a_named_file_refuses_a_fifo_without_blocking(tmp_path):
    """model_index.json (pipeline_class), an image (upright_size, PIL) and a clip (probe, PyAV)."""
    from engine.config.clips import ClipUnreadable, probe
    from engine.config.controls import pipeline_class, upright_size

    model = tmp_path / "model"
    model.mkdir()
    fifos = [model / "model_index.json", tmp_path / "control.png", tmp_path / "clip.mp4"]
    for f in fifos:
        os.mkfifo(f)

    def refused(fn, exc) -> str:
        with pytest.raises(exc) as e:
            fn()
        return str(e.value)

    try:
        for fn, exc, words in [(lambda: pipeline_class(model), JobInvalid, "model_index.json is not a regular file"),
                               (lambda: upright_size(fifos[1], key="sample.prompts[0].control"), JobInvalid,
                                "control.png is not a readable image (is not a regular file)"),
                               (lambda: probe(fifos[2], 8.0), ClipUnreadable, "not a regular file")]:
            done, said = in_thread(lambda fn=fn, exc=exc: refused(fn, exc), 5)
            assert done and words in said, said
    finally:
        for f in fifos:  # release a reader blocked in open() (today's code)
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_the_first_line_is_found_in_linear_time_and_a_file_of_blanks_is_refused_by_its_byte_cap(tmp_path):
    spaces = tmp_path / "spaces.jsonl"
    with open(spaces, "wb") as f:
        f.write(b" " * (16 << 20) + b'{"text": "hi"}\n')
    t = time.monotonic()
    assert first_text(spaces, most=32 << 20) == b'{"text": "hi"}\n'
    assert time.monotonic() - t < 0.5  # was quadratic: 1.5 s for 16 MB, 7.4 s for 32 MB
    with pytest.raises(JobInvalid, match=f"data.path: {spaces} holds no text in its first {8 << 20} bytes"):
        first_text(spaces, most=8 << 20)


def test_a_spent_time_budget_stops_a_folder_walk_naming_the_key_and_where_it_was(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text("some text\n")
    check_text_source(folder, "text")  # no budget: checked in full
    with bounded.budget(0), pytest.raises(bounded.CheckTimedOut, match=f"{folder}.*took longer than 0 s"):
        check_text_source(folder, "text")


def test_a_check_blocked_in_a_syscall_is_given_up_at_its_deadline_naming_the_path():
    release = threading.Event()

    def slow():
        bounded.tick("data.path", "/mnt/hung/data.jsonl")
        release.wait(30)  # a read on a hung mount: nothing Python can interrupt
        return "late"

    checks = Checks(0.3)
    try:
        assert checks.verdict("job", slow, wait=0) is PENDING  # the loop moves on at once
        t = time.monotonic()
        with pytest.raises(bounded.CheckTimedOut, match="data.path: /mnt/hung/data.jsonl: checking took longer"):
            checks.run(slow)
        assert time.monotonic() - t < 2
        time.sleep(0.5)
        with pytest.raises(bounded.CheckTimedOut):  # past its deadline, the pending one is refused too
            checks.verdict("job", slow, wait=0)
    finally:
        release.set()


@pytest.fixture
def texts(tmp_path):
    """A data folder that takes a while to walk."""
    texts = tmp_path / "allowed" / "texts"
    texts.mkdir()
    for i in range(3000):
        (texts / f"{i}.txt").write_text("some text\n")
    return texts


def test_a_job_whose_check_runs_out_of_time_is_rejected_naming_the_path(intake, texts, monkeypatch):
    # Each entry of the data folder takes 5 ms to look at (a slow mount): its 3000 files cannot be walked in the
    # 0.5 s budget, however loaded the machine, while the checks before it take a few milliseconds.
    real_tick = bounded.tick

    def slow_tick(key, path):
        if str(path).startswith(f"{texts}/"):
            time.sleep(0.005)
        real_tick(key, path)

    monkeypatch.setattr(bounded, "tick", slow_tick)
    intake.checks.seconds = 0.5  # intake_check_s: 0.5
    (intake.inbox / "slow.yaml").write_text(yaml.safe_dump(good_job("slow", data={"path": str(texts)})))
    out = intake.take(intake.inbox / "slow.yaml")
    assert out.job_id is None and f"slow.yaml: data.path: {texts}/" in out.error
    assert "checking took longer than 0.5 s; refused" in out.error


def test_the_loop_runs_a_bounded_number_of_checks_at_once_the_rest_wait_their_turn():
    release, started = threading.Event(), []

    def slow(i):
        started.append(i)
        release.wait(30)
        return i

    checks = Checks(30)
    try:
        assert [checks.verdict(f"job{i}", lambda i=i: slow(i), wait=0) for i in range(MAX_RUNNING + 2)] == \
            [PENDING] * (MAX_RUNNING + 2)
        time.sleep(0.2)
        assert sorted(started) == list(range(MAX_RUNNING))  # the others not started yet
        release.set()
        wait_until(lambda: all(checks.verdict(f"job{i}", lambda: None, wait=0) == i for i in range(MAX_RUNNING)), 5,
                   "the first checks' verdicts")
        assert checks.verdict("job5", lambda: slow(5), wait=5) == 5  # its turn came
    finally:
        release.set()


def test_the_loop_does_not_wait_for_a_check_it_collects_the_verdict_on_a_later_tick(intake, texts):
    intake.check_wait_s = 0.0  # as the service loop: never wait
    (intake.inbox / "later.yaml").write_text(yaml.safe_dump(good_job("later", data={"path": str(texts)})))
    first = intake.take(intake.inbox / "later.yaml")
    assert first.pending and first.job_id is None and list(intake.incoming.iterdir())
    deadline = time.monotonic() + 10
    while not (outs := [o for o in intake.poll_pending() if not o.pending]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert outs and outs[0].job_id and [j["name"] for j in intake.store.jobs()] == ["later"]
    assert list(intake.incoming.iterdir()) == [] and intake.poll_pending() == []


@pytest.mark.parametrize("spelling", ["'true'", "1", "yes", "on"])
def test_trust_remote_code_is_refused_however_it_is_spelt(intake, tmp_path, spelling):
    text = yaml.safe_dump(good_job()).replace("model:\n", f"model:\n  trust_remote_code: {spelling}\n")
    (intake.inbox / "remote.yaml").write_text(text)
    out = intake.take(intake.inbox / "remote.yaml")
    assert out.job_id is None and "model.trust_remote_code: true is not allowed" in out.error
    with pytest.raises(JobInvalid, match="trust_remote_code"):
        intake.submit_text("remote.yaml", text)
    job = tmp_path / "allowed" / "job.yaml"  # the trainer's own check, on a job.yaml edited after intake
    job.write_text(text)
    with pytest.raises(JobInvalid, match="model.trust_remote_code"):
        load_job(job, policy=JobPolicy(allow_trust_remote_code=False, roots=(tmp_path.resolve(), REPO.resolve())))


def test_echoed_values_are_cut_and_a_stored_reason_is_capped(intake):
    (intake.inbox / "echo.yaml").write_text(alias_bomb(str(QUICKSTART_DATA)))
    out = intake.take(intake.inbox / "echo.yaml")
    assert out.job_id is None and "lora.targets" in out.error and "more)" in out.error
    assert len(out.error) <= MAX_REASON_CHARS + 40  # was 20 MB: every error echoed the whole expanded value
    error_file = out.rejected_path.with_name(out.rejected_path.name + ".error.txt")
    assert error_file.stat().st_size < 8192


def test_rejection_events_in_the_store_are_pruned_to_the_newest_and_by_age(tmp_path):
    from daemon.intake.prune import RejectedPruner

    store = Store(tmp_path / "state.db")
    (tmp_path / "rejected").mkdir()
    try:
        for i in range(5):
            store.event(None, "rejected", source=f"f{i}.yaml", reason="bad")
        store.event("some-job", "accepted")
        RejectedPruner(tmp_path / "rejected", keep_days=30, keep=2, log=setup(), store=store)(time.monotonic())
        rows = store.db.execute("SELECT job_id, data FROM events ORDER BY id").fetchall()
        assert [(r["job_id"], r["data"]) for r in rows] == [
            (None, '{"source": "f3.yaml", "reason": "bad"}'), (None, '{"source": "f4.yaml", "reason": "bad"}'),
            ("some-job", "{}")]
        assert store.prune_jobless_events(time.time() + 1, keep=100) == 2  # older than the age: gone too
    finally:
        store.close()
