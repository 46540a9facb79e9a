"""bench/soak_oracle.py: the soak's rule for committed work, replayed on recorded stories (no processes).

A checkpoint a trainer reported committed is never lost: every later trainer of the job resumes from it or a newer
one, except when the soak itself corrupted it (then the newest one before it that the store still keeps)."""

from __future__ import annotations

from bench.soak_oracle import check, story

CUT = {"n": 4, "kind": "power_cut", "kills": True}
CORRUPT = {"n": 7, "kind": "corrupt_checkpoint", "kills": True}


def events(*evs: tuple) -> list:
    """A Tail.fresh: (time seen, event), one a second."""
    out = []
    for i, (what, step) in enumerate(evs):
        key = {"resumed": "from_step"}.get(what, "step")
        out.append((float(i), {"event": what, **({key: step} if step is not None else {})}))
    return out


def committed(*steps: int) -> list[tuple]:
    return [("start", None), *(e for s in steps for e in (("step", s), ("checkpoint_committed", s)))]


def run(evs: list, faults: list[tuple[float, dict]] = (), corrupted: list[tuple[float, int]] = (), keep: int = 2):
    return check("lm-r1-ab12", story(events(*evs), corrupted, faults), keep)


def test_a_resume_from_the_newest_committed_step_keeps_the_promise():
    assert run([*committed(4, 8), ("start", None), ("resumed", 8), ("step", 9)], [(4.5, CUT)]) == (8, None)


def test_a_resume_from_an_older_step_after_a_power_cut_names_the_step_the_fault_and_the_resume():
    promised, broken = run([*committed(4, 8), ("start", None), ("resumed", 4)], [(4.5, CUT)])
    assert broken == ("job lm-r1-ab12: step 8 was reported committed before fault #4 (power_cut) but the trainer "
                      "resumed from step 4")


def test_a_trainer_that_starts_from_nothing_resumed_from_step_0():
    _, broken = run([*committed(4), ("start", None), ("step", 1)], [(2.5, CUT)])
    assert broken and broken.endswith("resumed from step 0")


def test_a_lost_resumed_line_is_read_from_the_first_step():
    """A full disk drops the trainer's log lines: the first step says where it went on from."""
    assert run([*committed(4, 8), ("start", None), ("step", 9)], [(4.5, CUT)])[1] is None
    assert run([*committed(4, 8), ("start", None), ("step", 5)], [(4.5, CUT)])[1] is not None


def test_a_corrupted_newest_checkpoint_allows_the_previous_one_but_no_older():
    evs = [*committed(4, 8), ("start", None), ("resumed", 4)]
    assert run(evs, [(4.6, CORRUPT)], corrupted=[(4.5, 8)])[1] is None
    evs = [*committed(4, 8), ("start", None), ("resumed", 0)]
    assert "step 4 was reported committed" in run(evs, [(4.6, CORRUPT)], corrupted=[(4.5, 8)])[1]


def test_checkpoints_the_store_pruned_are_no_promise_but_kept_ones_are():
    """keep 2: commits 4, 8, 12 leave 8 and 12; with 12 and then 8 corrupted nothing is left to resume from. With
    every checkpoint kept, 4 still is."""
    evs = [*committed(4, 8, 12), ("start", None), ("resumed", 8), ("start", None), ("step", 1)]
    corrupted = [(6.5, 12), (8.5, 8)]
    assert run(evs, corrupted=corrupted, keep=2)[1] is None
    assert "step 4 was reported committed" in run(evs, corrupted=corrupted, keep=1000)[1]


def test_the_corrupted_checkpoints_own_commit_seen_late_is_no_new_promise():
    """The soak corrupted step 8 before it read the trainer's line for it; the next trainer's commit of 8 is."""
    evs = [("start", None), ("checkpoint_committed", 4), ("checkpoint_committed", 8), ("start", None),
           ("resumed", 4), ("checkpoint_committed", 8), ("start", None), ("resumed", 4)]
    assert run(evs[:6], corrupted=[(1.5, 8)])[1] is None
    assert "step 8 was reported committed (no fault since)" in run(evs, corrupted=[(1.5, 8)])[1]
