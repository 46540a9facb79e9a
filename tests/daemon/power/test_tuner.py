"""The auto-tuned power limit, on the simulated device: the right pick, a bounded cost, no re-profiling."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config.power import PowerSettings, TunerSettings
from daemon.power import simulated as sim
from daemon.power.policy import PowerPolicy
from daemon.power.run_policy import RunningJob
from daemon.power.simulated import SimulatedDevice
from daemon.power.tuner import Point, candidate_limits, choose, profiling_steps
from tests.helpers.fakes import Clock, RecLog


def test_profiling_costs_at_most_two_percent_of_a_2000_step_job():
    t = TunerSettings()
    cands = candidate_limits(sim.MIN_W, sim.MAX_W, 2000, t.warmup_steps, t.measure_steps, t.max_candidates,
                             t.budget_fraction, t.round_w)
    # min(8 candidates, floor(0.02 * 2000) // (2 warm-up + 3 measured)) = min(8, 40 // 5) = 8 candidates
    assert len(cands) == 8
    cost = profiling_steps(len(cands), t.warmup_steps, t.measure_steps)
    assert cost == 8 * (2 + 3) == 40
    assert cost / 2000 <= 0.02
    # from the maximum down to the minimum constraint
    assert cands[0] == sim.MAX_W and cands[-1] == sim.MIN_W and cands == sorted(cands, reverse=True)


def test_a_short_job_gets_fewer_candidates_and_a_tiny_one_is_not_tuned():
    t = TunerSettings()
    args = (t.warmup_steps, t.measure_steps, t.max_candidates, t.budget_fraction, t.round_w)
    assert len(candidate_limits(sim.MIN_W, sim.MAX_W, 1000, *args)) == 4  # 20 steps / 5
    assert candidate_limits(sim.MIN_W, sim.MAX_W, 300, *args) == []  # 6 steps: not even 2 candidates


def test_choose_takes_lowest_energy_inside_the_slowdown_bound_only():
    pts = [Point(400, 1.00, 400), Point(300, 1.08, 330), Point(200, 1.30, 280)]
    assert choose(pts, 0.10).limit_w == 300
    assert choose(pts, 0.50).limit_w == 200
    assert choose(pts, 0.01).limit_w == 400


def _job(total=2000, limit="auto", slowdown=0.10):
    return RunningJob(job_id="j1", name="j1", pid=1, gpu=None, started_at=0.0, total=total,
                      power={"limit_w": limit, "max_slowdown": slowdown})


def _policy(tmp_path: Path, clock: Clock, dev: SimulatedDevice, log: RecLog) -> PowerPolicy:
    """A power policy over `dev` with the default settings, its store in tmp_path, no background threads."""
    return PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", log, clock=clock, device=dev,
                       start_threads=False)


def _train(policy: PowerPolicy, dev: SimulatedDevice, clock: Clock, steps: int, start: int = 0) -> list[float]:
    """A simulated trainer: each step takes the model's step time at the GPU's current limit."""
    limits = []
    for step in range(start + 1, start + steps + 1):
        limits.append(dev.limit_w(0))
        clock.t += dev.step_time_s(0)
        policy.on_heartbeat("j1", {"event": "step", "step": step, "total": 2000})
    return limits


def _expected(cands: list[float], slowdown: float) -> float:
    """Brute force over the model itself: lowest J/step among candidates within the bound (descending, stops
    at the first too-slow one, as the tuner does)."""
    base = sim.step_time_s(cands[0])
    ok = [w for w in cands if sim.step_time_s(w) <= base * (1 + slowdown)]
    return min(ok, key=sim.joules_per_step)


@pytest.mark.parametrize("slowdown", [0.10, 1.0])
def test_tuner_on_simulated_device_picks_lowest_joules_per_step_within_bound(tmp_path: Path, slowdown):
    clock, log = Clock(), RecLog()
    dev = SimulatedDevice(1, clock=clock)
    pol = _policy(tmp_path, clock, dev, log)
    pol.on_job_start(_job(slowdown=slowdown))
    limits = _train(pol, dev, clock, 60)
    tuner = pol.jobs["j1"].tuner
    assert tuner is not None and tuner.done
    want = _expected(tuner.candidates, slowdown)
    assert tuner.limit_w == want
    if slowdown == 0.10:
        assert want == 330  # 295 W is 12.5% slower; 330 W is 7.4% slower and 11% fewer J/step than 400 W
    else:
        assert want == 185  # the bottom of the U, not the lowest limit (150 W costs more J/step)
    # measured J/step agrees with the model it was measured on (energy from the counter, exact integration)
    for p in tuner.points:
        assert p.j_per_step == pytest.approx(sim.joules_per_step(p.limit_w), rel=1e-9)
    # the cost: steps spent away from the chosen limit stay within 2% of the 2000-step job
    assert sum(1 for w in limits if w != want) <= 40
    assert dev.limit_w(0) == want and limits[-1] == want
    assert log.named("power tuned")[0]["simulated"] is True
    pol.close()


def test_a_restart_reuses_the_persisted_profile_instead_of_profiling_again(tmp_path: Path):
    clock = Clock()
    dev = SimulatedDevice(1, clock=clock)
    pol = _policy(tmp_path, clock, dev, RecLog())
    pol.on_job_start(_job())
    _train(pol, dev, clock, 30)  # killed in the middle of the job, after profiling
    chosen = pol.jobs["j1"].tuner.limit_w
    pol.close()  # the daemon goes down: the limit goes back to the driver's default
    assert dev.limit_w(0) == sim.DEFAULT_W

    log2 = RecLog()
    pol2 = _policy(tmp_path, clock, dev, log2)
    pol2.on_job_start(_job())  # the job resumes under a new daemon
    assert dev.limit_w(0) == chosen  # at the tuned limit from the first step
    limits = _train(pol2, dev, clock, 40, start=30)
    assert set(limits) == {chosen}
    assert log2.named("power profiling") == [] and len(log2.named("power profile reused")) == 1
    pol2.on_job_end("j1", 0)
    assert dev.limit_w(0) == sim.DEFAULT_W  # the job's cap ends with the job
    pol2.close()


def test_a_fixed_per_job_limit_is_applied_and_restored_at_job_end(tmp_path: Path):
    clock = Clock()
    dev = SimulatedDevice(1, clock=clock)
    pol = _policy(tmp_path, clock, dev, RecLog())
    pol.on_job_start(_job(limit=250))
    assert dev.limit_w(0) == 250
    pol.on_job_end("j1", 0)
    assert dev.limit_w(0) == sim.DEFAULT_W
    pol.close()


def test_heartbeats_read_up_to_a_tick_late_still_measure_exact_joules_per_step(tmp_path: Path):
    """The supervisor reads heartbeats once per 0.25 s tick and the limit changes only then. Steps run back
    to back at the rate of the limit in force; the tuner must measure from the steps' own timestamps."""
    from datetime import datetime, timezone

    clock = Clock(1_700_000_000.0)
    dev = SimulatedDevice(1, clock=clock)
    pol = _policy(tmp_path, clock, dev, RecLog())
    pol.on_job_start(_job())
    tick, progress, step, pending = 0.25, 0.0, 0, []
    while not pol.jobs["j1"].tuner.done:
        # training between two ticks at the current limit: record when each step ends
        rate, t0 = 1.0 / dev.step_time_s(0), clock.t
        while progress + rate * (t0 + tick - clock.t) >= 1.0:
            clock.t += (1.0 - progress) / rate
            progress, step = 0.0, step + 1
            pending.append((step, clock.t))
        progress += rate * (t0 + tick - clock.t)
        clock.t = t0 + tick
        for s, t in pending:  # the tick: heartbeats, then the policy
            ts = datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
            pol.on_heartbeat("j1", {"event": "step", "step": s, "total": 2000, "ts": ts})
        pending = []
        pol.tick(datetime.fromtimestamp(clock.t, timezone.utc), [_job()])
    tuner = pol.jobs["j1"].tuner
    for p in tuner.points:
        assert p.s_per_step == pytest.approx(sim.step_time_s(p.limit_w), rel=1e-6)
        assert p.j_per_step == pytest.approx(sim.joules_per_step(p.limit_w), rel=1e-6)
    assert tuner.limit_w == 330
    pol.close()


def test_a_restart_in_the_middle_of_profiling_measures_only_the_remaining_limits(tmp_path: Path):
    clock = Clock()
    dev = SimulatedDevice(1, clock=clock)
    pol = _policy(tmp_path, clock, dev, RecLog())
    pol.on_job_start(_job())
    first = _train(pol, dev, clock, 12)  # 400 W and 365 W measured (5 steps each), killed at the third
    assert [p.limit_w for p in pol.jobs["j1"].tuner.points] == [400, 365]
    pol.close()

    log2 = RecLog()
    pol2 = _policy(tmp_path, clock, dev, log2)
    pol2.on_job_start(_job())
    assert dev.limit_w(0) == 330  # straight to the first limit not yet measured
    second = _train(pol2, dev, clock, 40, start=12)
    tuner = pol2.jobs["j1"].tuner
    assert tuner.done and tuner.limit_w == 330
    assert [p.limit_w for p in tuner.points] == [400, 365, 330, 295]
    assert log2.named("power profiling")[0]["already_measured_w"] == [400, 365]
    # the whole profile, over both runs, stayed within the 2% budget
    assert sum(1 for w in first + second if w != 330) <= 40
    pol2.close()
