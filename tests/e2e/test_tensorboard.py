"""logging.tensorboard: jobs/ID/tb/ holds one value per step, in order, after a SIGKILL and a resume, equal to an
uninterrupted run's (TensorBoard's own purge_step hides what the killed attempt wrote past its checkpoint).
The same run shows it for data.validation's loss, in TensorBoard and in the `validation` events."""

from __future__ import annotations

import pytest
import yaml

from engine.errors import JobInvalid
from engine.recipe import train
from tests.helpers.forked import ForkedTrainer, run_to_end
from tests.helpers.jobs import (
    QUICKSTART_DATA,
    adapter_bytes,
    deep_update,
    read_events,
    tiny_job,
    tiny_job_dict,
)

TAGS = ("train/loss", "train/lr", "train/grad_norm", "perf/s_per_step", "validation/loss")


def _scalars(tb_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))  # TensorBoard's reader, purging as the UI does
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _steps_in_file(path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [ev.step for ev in EventFileLoader(str(path)).Load()
            if ev.HasField("summary") and any(v.tag == tag for v in ev.summary.value)]


def test_a_killed_and_resumed_job_has_each_step_once_with_the_uninterrupted_values(micro_model, tmp_path):
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                    {"train": {"steps": 12}, "checkpoint": {"every_steps": 4},
                     "data": {"validation": {"fraction": 0.05, "every_steps": 2, "batches": 2}}})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    ref = tmp_path / "ref"
    uninterrupted = ForkedTrainer(job, ref)  # beside the killed run, which is a real process killed for real

    wd = tmp_path / "killed"
    # Its periodic saves run at nice 0 and its steps pause 0.1 s (tests only; no value changes): a niced save under
    # load committed first at the final step once, and the trainer finished before the test could kill it.
    t = ForkedTrainer(job, wd, LORAD_CKPT_WRITER_NICE="0", LORAD_DEBUG_STEP_DELAY_S="0.1")
    t.wait_for(lambda: bool(t.named("checkpoint_committed")))
    committed = t.named("checkpoint_committed")[-1]["step"]
    t.wait_step(committed + 4)  # a few steps past the checkpoint, so the killed attempt wrote some of them
    t.kill()
    validated_past = [e["step"] for e in t.named("validation") if e["step"] > committed]
    first = sorted((wd / "tb").glob("events.out.tfevents.*"))
    assert len(first) == 1
    t = run_to_end(job, wd, timeout=600)
    assert uninterrupted.finish(timeout=600) == 0, uninterrupted.events[-5:]
    resumed = t.named("resumed")[0]["from_step"]
    assert max(_steps_in_file(first[0], "train/loss")) > resumed, "nothing to purge: the test would prove nothing"
    assert len(list((wd / "tb").glob("events.out.tfevents.*"))) == 2  # one file per attempt

    for tag in TAGS:
        got, want = _scalars(wd / "tb", tag), _scalars(ref / "tb", tag)
        steps = list(range(2, 13, 2)) if tag == "validation/loss" else list(range(1, 13))
        assert [s for s, _ in got] == steps, tag  # each step once, in order
        if tag != "perf/s_per_step":  # timings differ between runs; the training values do not
            assert got == want, tag
    assert adapter_bytes(wd) == adapter_bytes(ref)

    # events.jsonl: a step the killed attempt evaluated past its checkpoint was evaluated again, to the same value
    want = {e["step"]: e["loss"] for e in read_events(ref) if e["event"] == "validation"}
    logged = [(e["step"], e["loss"]) for e in read_events(wd) if e["event"] == "validation"]
    assert validated_past and sorted({s for s, _ in logged}) == sorted(want) == list(range(2, 13, 2))
    assert all(v == want[s] for s, v in logged), logged


def test_tensorboard_can_be_switched_off_and_its_key_is_validated(micro_model, tmp_path):
    cfg = tiny_job(micro_model, tmp_path, train={"steps": 3}, logging={"tensorboard": False})
    assert train(cfg, tmp_path / "w", progress="none") == 0
    assert not (tmp_path / "w" / "tb").exists()
    with pytest.raises(JobInvalid, match=r"logging\.tensorbord: unknown key"):
        tiny_job(micro_model, tmp_path, logging={"tensorbord": True})
    # not part of what decides the weights: switching it on or off never strands a checkpoint
    assert cfg.identity_hash() == tiny_job(micro_model, tmp_path, train={"steps": 3}).identity_hash()
