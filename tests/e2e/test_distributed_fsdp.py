"""train.sharding: fsdp on two CPU processes (FSDP2 over gloo): sharded checkpoints that a kill cannot tear, resumed
bit-exactly on 2 processes and with the same data order on 1.

Four launches in all (each starts Python processes that import torch): the uninterrupted run, a run killed inside
a save, its resume, and a resume on one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.e2e.test_distributed_train import (  # noqa: F401 — no_leftovers: the same clean-up of launchers
    ATOL,
    finish,
    kill_launcher,
    launch,
    losses,
    no_leftovers,
    sample_ids_by_step,
)
from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, tiny_job_dict

STEPS = 12


def fsdp_job(dest: Path, model: Path) -> Path:
    d = deep_update(tiny_job_dict(model, QUICKSTART_DATA), {
        "train": {"steps": STEPS, "grad_accum": 1, "optimizer": "adamw", "sharding": "fsdp"},
        "resources": {"gpus": 2},  # global batch 4, as test_distributed_train's
        "checkpoint": {"every_steps": 4, "keep": 20},
    })
    dest.write_text(yaml.safe_dump(d))
    return dest


def committed(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / "checkpoints").iterdir() if "." not in p.name)


def test_a_sharded_job_killed_inside_a_save_never_loads_the_torn_save_and_resumes_exactly_on_2_or_1_processes(
        micro_model, tmp_path):
    job = fsdp_job(tmp_path / "job.yaml", micro_model)
    ref_dir, torn_dir, one_dir = tmp_path / "ref", tmp_path / "torn", tmp_path / "one"
    ref = launch(job, ref_dir, 2)
    # Killed while rank 0 writes the second checkpoint (slowed down): both ranks' shards are in its temporary
    # directory, its manifest is not.
    torn = launch(job, torn_dir, 2, LORAD_DEBUG_CKPT_WRITE_DELAY_S="1")
    ckpts = torn_dir / "checkpoints"
    torn.wait_for(lambda: ckpts.is_dir() and any(
        ".tmp-" in p.name and (p / "shards" / ".metadata").is_file() and p.name[:13] > "step-00000004"
        for p in ckpts.iterdir()), timeout=300)
    kill_launcher(torn)
    [tmp] = [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert sorted(f.name for f in (tmp / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (tmp / "manifest.json").exists()
    at = max(int(n.split("-")[1]) for n in committed(torn_dir))

    finish(ref)
    assert [e["blocks"] for e in ref.named("sharded")] == [2]  # the micro Llama's 2 decoder layers, then the whole
    assert [p.name for p in (ref_dir / "checkpoints" / "step-00000004").iterdir() if p.is_dir()] == ["shards"]
    # Resumed on 1 process from the first checkpoint the 2 ranks wrote (DCP reshards it), beside the 2-process retry.
    shutil.copytree(ref_dir / "checkpoints" / "step-00000004", one_dir / "checkpoints" / "step-00000004")
    one = launch(job, one_dir, 1)
    resumed = finish(launch(job, torn_dir, 2))
    finish(one)

    # The retry resumed from the last committed checkpoint, before the torn one, which nobody loaded.
    assert [e["from_step"] for e in resumed.named("resumed")] == [at] and at < int(tmp.name[5:13])
    assert not resumed.named("checkpoint_skipped")
    assert adapter_bytes(torn_dir) == adapter_bytes(ref_dir)
    assert sample_ids_by_step(torn_dir) == sample_ids_by_step(ref_dir)
    assert not list(ckpts.glob("*.tmp-*"))  # the torn save was cleared at the next commit

    assert [e["from_step"] for e in one.named("resumed")] == [4]
    assert [e["grad_accum"] for e in one.named("start")] == [2]
    assert sample_ids_by_step(one_dir) == {s: ids for s, ids in sample_ids_by_step(ref_dir).items() if s > 4}
    assert losses(one) == pytest.approx({s: v for s, v in losses(ref).items() if s > 4}, abs=ATOL)
    # The output holds the whole adapter (gathered from the shards), not rank 0's half.
    a, b = load_file(str(ref_dir / "output" / "adapter_model.safetensors")), load_file(
        str(one_dir / "output" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=0)
