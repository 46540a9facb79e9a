"""The job state machine (one table) and the SQLite store that enforces it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import pytest

from daemon.store import states
from daemon.store.db import Store
from daemon.store.errors import AmbiguousJob, StoreUnusable, UnknownJob


def add(store: Store, name: str = "j", priority: int = 0) -> str:
    jid = store.new_id(name)
    store.add_job(jid, name, store.path.parent / "jobs" / jid, priority, 10, "test")
    return jid


def test_the_lifecycle_of_design_md_is_in_the_table():
    t = states.TRANSITIONS
    for edge in [(states.QUEUED, states.RUNNING), (states.RUNNING, states.SUCCEEDED),
                 (states.RUNNING, states.INTERRUPTED), (states.INTERRUPTED, states.QUEUED),
                 (states.RUNNING, states.PAUSED), (states.PAUSED, states.QUEUED), (states.RUNNING, states.FAILED)]:
        assert edge in t
    for s in states.STATES:
        if s not in states.FINAL:
            assert (s, states.CANCELLED) in t, f"{s} must be cancellable"


def test_final_states_have_no_way_out_but_a_retry_asked_for_by_a_person():
    for edge in states.TRANSITIONS:
        assert edge[0] not in states.FINAL or edge in states.REOPEN
    assert states.REOPEN == {(states.FAILED, states.QUEUED), (states.FAILED, states.FETCHING)}


def test_every_pair_outside_the_table_is_refused_and_leaves_the_row_alone(store):
    """Walk all 49 (from, to) pairs: the table's edges succeed, all others raise and change nothing."""
    for src in states.STATES:
        for dst in states.STATES:
            jid = add(store)
            # Put the job into `src` through the store's own columns (setup only; not a transition).
            store.db.execute("UPDATE jobs SET state=? WHERE id=?", (src, jid))
            if (src, dst) in states.TRANSITIONS:
                store.transition(jid, src, dst, "walk")
                assert store.get(jid)["state"] == dst
            else:
                with pytest.raises(states.IllegalTransition):
                    store.transition(jid, src, dst, "walk")
                assert store.get(jid)["state"] == src


def test_transition_checks_the_current_state_not_the_callers_belief(store):
    jid = add(store)
    store.transition(jid, states.QUEUED, states.RUNNING)
    with pytest.raises(states.IllegalTransition):
        store.transition(jid, states.QUEUED, states.RUNNING)  # someone else already started it
    assert [e["data"]["to"] for e in store.events(jid) if e["kind"] == "transition"] == ["running"]


def fail_event_writes(store: Store, when: str = "1") -> None:
    """From now on, writing an event (the last write of a transition) fails when `when` holds for it."""
    store.db.execute(f"CREATE TEMP TRIGGER fail_events BEFORE INSERT ON events WHEN {when} "
                     "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")


def test_a_transition_and_its_fields_are_one_transaction(store):
    jid = add(store)
    fail_event_writes(store)  # the state and its fields are written first, then the event: that write fails
    with pytest.raises(sqlite3.DatabaseError):
        store.transition(jid, states.QUEUED, states.RUNNING, pid=1)
    row = store.get(jid)
    assert row["state"] == states.QUEUED and row["pid"] is None
    assert [e for e in store.events(jid) if e["kind"] == "transition"] == []


def test_starting_an_attempt_is_the_transition_and_the_attempt_row_or_neither(store):
    jid = add(store)
    store.db.execute("CREATE TEMP TRIGGER fail_attempts BEFORE INSERT ON attempts "
                     "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    with pytest.raises(sqlite3.DatabaseError):
        store.begin_attempt(jid, 0, gpu=1)
    assert store.get(jid)["state"] == states.QUEUED and store.get(jid)["gpu"] is None  # still first in line
    store.db.execute("DROP TRIGGER fail_attempts")
    assert store.begin_attempt(jid, 0, gpu=1) == 1
    assert store.get(jid)["state"] == states.RUNNING and len(store.attempts(jid)) == 1


def test_ending_a_run_closes_the_attempt_and_makes_every_move_in_one_transaction(store):
    jid = add(store)
    store.begin_attempt(jid, 0)
    fail_event_writes(store, "NEW.data LIKE '%\"to\": \"queued\"%'")  # the second move (interrupted → queued) fails
    plan = lambda job: ([(states.INTERRUPTED, "drain", {"pid": None}), (states.QUEUED, "requeued", {})], job["state"])  # noqa: E731
    with pytest.raises(sqlite3.DatabaseError):
        store.end_run(jid, 75, 3, None, plan)
    assert store.get(jid)["state"] == states.RUNNING and store.attempts(jid)[-1]["ended_at"] is None
    store.db.execute("DROP TRIGGER fail_events")
    assert store.end_run(jid, 75, 3, None, plan) == states.RUNNING  # plan saw the row inside the transaction
    assert store.get(jid)["state"] == states.QUEUED and store.attempts(jid)[-1]["exit_code"] == 75


def test_a_write_that_fails_leaves_the_store_usable_from_every_thread(tmp_path):
    store = Store(tmp_path / "state.db", timeout_s=0.2)
    jid = add(store)
    other = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # someone else holds the write lock for longer than the busy timeout
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store.update(jid, priority=3)
    other.execute("ROLLBACK")
    done = []
    t = threading.Thread(target=lambda: (store.update(jid, priority=4), done.append(1)))
    t.start()
    t.join(5)
    assert done == [1] and store.get(jid)["priority"] == 4  # the store's own lock was not left held
    store.close()


def test_a_corrupt_database_is_refused_in_one_line_that_says_what_to_do(tmp_path):
    db = tmp_path / "state.db"
    db.write_bytes(b"this is not an SQLite file " * 200)
    with pytest.raises(StoreUnusable) as e:
        Store(db)
    assert str(e.value) == (f"{db} is not a lorad database (corrupt?): move it aside to start fresh "
                            "— job directories under jobs/ are not touched")


LOCKER = ("import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
          "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)")


@pytest.mark.parametrize("wal_already", [False, True])
def test_a_database_locked_by_another_process_is_refused_naming_it(tmp_path, wal_already):
    db = tmp_path / "state.db"
    if wal_already:
        Store(db).close()  # a lorad database: opening it needs no lock until the first write
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        with pytest.raises(StoreUnusable) as e:
            Store(db, timeout_s=0.3)
        assert str(e.value) == f"{db} is locked by another process (pid {locker.pid}): stop it, then start lorad again"
    finally:
        locker.kill()
        locker.wait()
    Store(db, timeout_s=0.3).close()  # free again: it opens


def test_unknown_job(store):
    with pytest.raises(UnknownJob):
        store.transition("nope", states.QUEUED, states.RUNNING)


def test_queue_order_is_priority_then_arrival_and_respects_backoff(store):
    a, b, c = add(store, "a"), add(store, "b", priority=5), add(store, "c", priority=5)
    assert store.next_queued(0)["id"] == b
    store.update(b, not_before=1e18)
    assert store.next_queued(1000)["id"] == c
    store.update(c, priority=-1)
    assert store.next_queued(1000)["id"] == a


def test_a_backoff_longer_than_the_longest_wait_began_before_the_clock_was_set_back_and_has_passed(store):
    a = add(store, "a")
    store.update(a, not_before=1000 + 30)  # a 30 s backoff from 1000 on the wall clock
    assert store.next_queued(1010, longest_wait=600) is None  # still waiting
    assert store.next_queued(1030, longest_wait=600)["id"] == a
    # The clock set back a day during the backoff: it would wait a day; no backoff lasts longer than 600 s.
    assert store.next_queued(1010 - 86400) is None
    assert store.next_queued(1010 - 86400, longest_wait=600)["id"] == a


def test_ids_are_readable_and_unique(store):
    ids = {store.new_id("quickstart") for _ in range(50)}
    assert all(i.startswith("quickstart-") for i in ids)
    jid = add(store, "quickstart")
    assert store.find("quickstart")["id"] == jid  # a name finds its newest job


def test_a_name_means_its_one_unfinished_job_and_is_refused_when_it_could_mean_several(store):
    old, new = add(store, "short"), add(store, "short")
    with pytest.raises(AmbiguousJob) as e:
        store.find("short")  # two queued jobs: never a silent pick of the newest
    assert [j["id"] for j in e.value.matches] == [new, old]  # newest first
    store.transition(old, states.QUEUED, states.CANCELLED)
    assert store.find("short")["id"] == new  # the only one not finished is the one meant
    store.transition(new, states.QUEUED, states.CANCELLED)
    with pytest.raises(AmbiguousJob):
        store.find("short")  # all finished: which one is a guess again
    assert store.find(old)["id"] == old and store.find(new)["id"] == new  # an id is always exact
    assert store.unfinished_named("short") == []


def test_an_id_prefix_finds_one_job_or_is_ambiguous(store):
    a, b = add(store, "alpha"), add(store, "alps")
    assert store.find("alph")["id"] == a
    with pytest.raises(AmbiguousJob) as e:
        store.find("al")
    assert {j["id"] for j in e.value.matches} == {a, b}
    with pytest.raises(UnknownJob):
        store.find("al%")  # LIKE wildcards are literal
    with pytest.raises(UnknownJob):
        store.find("zeta")


def test_wal_and_full_sync_survive_reopen(tmp_path):
    s = Store(tmp_path / "state.db")
    jid = add(s)
    s.transition(jid, states.QUEUED, states.RUNNING)
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    s.close()
    raw = sqlite3.connect(tmp_path / "state.db")
    assert raw.execute("SELECT state FROM jobs WHERE id=?", (jid,)).fetchone()[0] == "running"


def test_attempts_record_start_end_exit_and_steps(store):
    jid = add(store)
    n = store.begin_attempt(jid, 0)  # queued → running, as the supervisor starts a trainer
    store.record_trainer(jid, n, 1234, None)
    store.end_run(jid, 1, 7, "boom", lambda job: ([(states.QUEUED, "crashed", {})], None))
    n2 = store.begin_attempt(jid, 4)
    a = store.attempts(jid)
    assert (n, n2) == (1, 2)
    assert a[0]["exit_code"] == 1 and a[0]["end_step"] == 7 and a[0]["error"] == "boom" and a[0]["pid"] == 1234
    assert a[1]["ended_at"] is None and a[1]["start_step"] == 4
