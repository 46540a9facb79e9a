"""The training loop over two attempts of one tiny job whose `train.steps` grows in between: host reads of
the loss, the learning-rate plan across the change, and heartbeats while the output is exported.

Reading a CUDA tensor on the host (`float(t)`, `t.item()`) waits for every kernel queued so far, so a read
after each micro-batch would stall the batch prefetcher and the next micro-batch's kernel launches. On the
CPU a read costs nothing, so the reads are counted instead: a tensor subclass that the family's loss
returns counts every host read of itself and of anything computed from it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.recipe import train
from tests.helpers.jobs import read_events, tiny_job


class CountedReads(torch.Tensor):
    reads = 0

    def __float__(self):
        CountedReads.reads += 1
        return super().__float__()

    def item(self):
        CountedReads.reads += 1
        return super().item()


@pytest.fixture(scope="module")
def two_attempts(micro_model, tmp_path_factory):
    """Attempt 1: steps 4, stopped after step 2. Attempt 2: steps raised to 8, run to the end. Host reads of
    the loss per attempt, and each attempt's events."""
    from engine.families.causal_lm import CausalLM
    from engine.training.stop import StopFlag

    tmp = tmp_path_factory.mktemp("two-attempts")
    wd, real, out = tmp / "w", CausalLM.loss, {}
    train_over = {"grad_accum": 2, "warmup_steps": 1, "schedule": "cosine"}
    with pytest.MonkeyPatch.context() as mp:
        stop, calls = StopFlag(), []

        def loss(self, *a):
            calls.append(1)
            if len(calls) == 4:  # during step 2's second micro-batch
                stop.request("test")
            return real(self, *a).as_subclass(CountedReads)

        mp.setattr(CausalLM, "loss", loss)
        for attempt, steps, flag in ((1, 4, stop), (2, 8, None)):
            CountedReads.reads = 0
            before = len(read_events(wd)) if wd.exists() else 0
            cfg = tiny_job(micro_model, tmp, train={"steps": steps, **train_over}, checkpoint={"every_steps": 10})
            rc = train(cfg, wd, progress="none", stop=flag)
            out[attempt] = {"rc": rc, "reads": CountedReads.reads, "events": read_events(wd)[before:], "cfg": cfg}
    return out


def test_the_loss_is_read_on_the_host_once_per_optimizer_step_not_per_micro_batch(two_attempts):
    first, second = two_attempts[1], two_attempts[2]
    assert (first["rc"], second["rc"]) == (75, 0)
    assert first["reads"] == 2 and second["reads"] == 6  # optimizer steps run, of 2 micro-batches each
    losses = [e["loss"] for e in first["events"] + second["events"] if e["event"] == "step"]
    assert len(losses) == 8 and all(isinstance(x, float) and x > 0 for x in losses)


def test_raising_steps_between_attempts_continues_the_decay_without_a_jump_and_says_so(two_attempts):
    lr = two_attempts[1]["cfg"].train.lr
    assert [e["lr"] for e in two_attempts[1]["events"] if e["event"] == "step"] == [lr, lr]  # warm-up, decay start
    # cosine after one warm-up step: step 2 (0-based) of 4 is a third of the decay
    lrs = [e["lr"] for e in two_attempts[2]["events"] if e["event"] == "step"]
    assert lrs[0] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi / 3)))  # not lr·½(1 + cos π/7) from 8
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False)) and lrs[-1] > 0
    [said] = [e for e in two_attempts[2]["events"] if e["event"] == "lr_replanned"]
    assert "train.steps changed 4 → 8" in said["message"] and f"{lrs[0]:.4g}" in said["message"]


def test_the_export_sends_a_heartbeat_per_file(two_attempts):
    events = two_attempts[2]["events"]
    kinds = [e["event"] for e in events]
    beats = [e for e in events if e["event"] == "heartbeat" and e.get("phase") == "export"]
    done = events[kinds.index("done")]
    files = sorted(p.name for p in Path(done["output"]).iterdir())
    assert sorted(b["file"] for b in beats) == files
    assert kinds.index("checkpoint_committed") < kinds.index("heartbeat") < kinds.index("done")
