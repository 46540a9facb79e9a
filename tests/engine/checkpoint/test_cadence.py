"""When a checkpoint save starts (engine/checkpoint/cadence.py), driven step by step with a fake clock: no training, no disk."""

from __future__ import annotations

from engine.checkpoint.cadence import Save, SaveCadence


def cadence(every_steps=None, every_seconds=None, last_step=1000, saved_step=0, now=0.0) -> SaveCadence:
    return SaveCadence(every_steps, every_seconds, last_step=last_step, saved_step=saved_step, now=now)


def test_a_step_trigger_fires_every_n_steps_after_the_last_committed_save():
    c = cadence(every_steps=3)
    assert [c.due(s, 0.0, writing=False) for s in (1, 2, 3)] == [None, None, Save.PERIODIC]
    c.started(0.0)
    c.saved(3, 0.5)
    assert [c.due(s, 0.0, writing=False) for s in (4, 5, 6)] == [None, None, Save.PERIODIC]


def test_the_step_trigger_counts_from_the_commit_not_the_start_of_a_save():
    c = cadence(every_steps=3)
    c.started(0.0)  # the save of step 3 is still being written at steps 4 .. 6
    assert [c.due(s, 0.0, writing=True) for s in (4, 5, 6)] == [None, None, None]
    c.saved(3, 9.0)
    assert c.due(6, 0.0, writing=False) is Save.PERIODIC and c.saved_step == 3


def test_a_resumed_run_counts_from_the_step_it_resumed_at():
    c = cadence(every_steps=4, saved_step=8)
    assert c.due(11, 0.0, writing=False) is None
    assert c.due(12, 0.0, writing=False) is Save.PERIODIC


def test_a_time_trigger_fires_every_n_seconds_from_the_start_of_the_last_save():
    c = cadence(every_seconds=10.0, now=100.0)
    assert c.due(1, 109.9, writing=False) is None
    assert c.due(2, 110.0, writing=False) is Save.PERIODIC
    c.started(110.0)
    c.saved(2, 0.0)
    assert c.due(3, 119.9, writing=False) is None
    assert c.due(4, 120.0, writing=False) is Save.PERIODIC


def test_each_timed_save_starts_as_much_earlier_as_the_last_one_took_to_write():
    c = cadence(every_seconds=10.0)
    c.started(10.0)
    c.saved(5, 4.0)  # that save took 4 s to commit: its snapshot was at risk for 4 s longer
    assert c.due(6, 15.9, writing=False) is None
    assert c.due(7, 16.0, writing=False) is Save.PERIODIC  # 6 s after it started, not 10


def test_whichever_trigger_comes_first_wins():
    c = cadence(every_steps=100, every_seconds=5.0)
    assert c.due(2, 5.0, writing=False) is Save.PERIODIC
    c = cadence(every_steps=2, every_seconds=500.0)
    assert c.due(2, 0.1, writing=False) is Save.PERIODIC


def test_no_periodic_save_starts_while_one_is_being_written():
    c = cadence(every_steps=1)
    assert c.due(5, 0.0, writing=True) is None
    assert c.due(5, 0.0, writing=False) is Save.PERIODIC


def test_an_urgent_request_saves_at_the_next_step_even_with_a_save_in_flight_and_only_once():
    c = cadence(every_steps=1000, every_seconds=1000.0)
    c.urgent()
    assert c.due(7, 1.0, writing=True) is Save.URGENT
    assert c.due(8, 1.0, writing=True) is None


def test_nothing_is_started_at_the_last_step_the_final_save_covers_it():
    c = cadence(every_steps=1, last_step=10)
    c.urgent()
    assert c.due(10, 0.0, writing=False) is None
    assert c.due(10, 0.0, writing=False) is None  # the request was taken, not kept for later


def test_a_save_slower_than_every_seconds_is_reported_once_per_save():
    c = cadence(every_seconds=5.0)
    assert c.slow(7, started=0.0, now=5.0) is None
    assert c.slow(7, started=0.0, now=5.5) == 5.5
    assert c.slow(7, started=0.0, now=9.0) is None
    assert c.slow(9, started=10.0, now=15.25) == 5.25  # the next slow save is reported again


def test_no_slow_report_without_a_save_in_flight_or_without_a_time_trigger():
    assert cadence(every_seconds=5.0).slow(None, started=0.0, now=60.0) is None
    assert cadence(every_steps=3).slow(7, started=0.0, now=60.0) is None
