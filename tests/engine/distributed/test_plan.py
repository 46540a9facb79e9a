"""engine.distributed.ddp and engine.launch in one process: how a global batch is shared, kept and refused."""

from __future__ import annotations

import pytest
import torch

from engine.distributed.ddp import World, micro_positions, plan_grad_accum, seed_micro_batch
from engine.errors import JobInvalid
from engine.launch import job_exit_code
from tests.helpers.jobs import tiny_job


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ranks_of_any_world_size_take_every_micro_batch_of_the_global_batch_once(world_size):
    batch, global_batch, consumed = 2, 8, 40
    accum = plan_grad_accum(global_batch, batch, world_size)
    taken = [p for r in range(world_size) for p in micro_positions(consumed, batch, accum, World(r, world_size))]
    # The same micro-batches (same first samples) as on one process: only which rank takes them changes.
    assert sorted(taken) == list(range(consumed, consumed + global_batch, batch))


def test_grad_accum_is_replanned_to_keep_the_global_batch():
    assert [plan_grad_accum(8, 2, w) for w in (1, 2, 4)] == [4, 2, 1]


def test_a_global_batch_the_world_size_cannot_keep_is_refused_naming_the_keys():
    with pytest.raises(JobInvalid) as e:
        plan_grad_accum(4, 2, 3)
    assert "train.batch_size, train.grad_accum, resources.gpus" in str(e.value)


def test_a_micro_batch_draws_the_same_dropout_and_noise_from_its_position_alone():
    def draws(position):
        g = seed_micro_batch(11, 3, position)
        return torch.rand(4), torch.randn(4, generator=g)  # global RNG (dropout) and the family's generator

    torch.manual_seed(999)  # whatever the rank drew before
    a = draws(16)
    torch.rand(100)
    b = draws(16)
    c = draws(18)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])
    assert not torch.equal(a[0], a[1])  # dropout and noise are not the same stream


@pytest.mark.parametrize("codes, first, job", [
    ({0: 0, 1: 0}, None, 0),
    ({0: 75, 1: 75}, 0, 75),
    ({0: 75, 1: 0}, 0, 75),
    ({0: 65, 1: -15}, 0, 65),  # rank 0 found the job invalid; the agent stopped rank 1
    ({0: -15, 1: 74}, 1, 74),
    ({0: -9, 1: 1}, 1, 1),  # rank 1 crashed first
    ({0: -9, 1: -15}, 0, 137),  # rank 0 SIGKILLed (the OOM killer): 128 + 9
])
def test_the_job_exit_code_follows_its_ranks(codes, first, job):
    assert job_exit_code(codes, first) == job


def test_the_global_batch_decides_the_weights_not_how_it_is_split(micro_model, tmp_path):
    two = tiny_job(micro_model, tmp_path, resources={"gpus": 2}, train={"grad_accum": 1})
    one = tiny_job(micro_model, tmp_path, train={"grad_accum": 2})
    assert two.global_batch() == one.global_batch() == 4
    assert two.identity_hash() == one.identity_hash()
    # More GPUs with the same grad_accum is a bigger global batch: another training, refused on resume by name.
    four = tiny_job(micro_model, tmp_path, resources={"gpus": 4}, train={"grad_accum": 1})
    assert four.identity_hash() != two.identity_hash() and four.identity()["train"]["global_batch"] == 8
    # A job at the defaults keeps the identity it had before resources existed.
    assert "global_batch" not in tiny_job(micro_model, tmp_path).identity()["train"]


def test_resources_gpus_is_validated_by_name(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"resources\.gpus"):
        tiny_job(micro_model, tmp_path, resources={"gpus": 0})


def test_a_world_size_that_cannot_keep_the_global_batch_exits_65_before_any_rank_waits(
        micro_model, tmp_path, monkeypatch, capsys):
    from engine.recipe import train

    cfg = tiny_job(micro_model, tmp_path, resources={"gpus": 2})  # global batch 4
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun would give rank 0 of 3 processes
    monkeypatch.setenv("RANK", "0")
    assert train(cfg, tmp_path / "w", progress="none") == 65
    assert "resources.gpus" in capsys.readouterr().err


def test_ranks_with_another_lorad_version_or_another_job_file_are_named():
    from engine.distributed.ddp import ranks_disagree

    same = [{"host": "a", "version": "0.1.0", "config_hash": "h"}, {"host": "b", "version": "0.1.0", "config_hash": "h"}]
    assert ranks_disagree(same) is None
    old = [same[0], {**same[1], "version": "0.0.9"}]
    assert "rank 1 on b: 0.0.9" in ranks_disagree(old) and "lorad version" in ranks_disagree(old)
    edited = [same[0], {**same[1], "config_hash": "h2"}]
    assert "job settings" in ranks_disagree(edited)


def test_gpus_without_nccl_are_named_before_any_process_group_starts(monkeypatch):
    from engine.distributed.ddp import NcclMissing, Ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(NcclMissing, match="no NCCL"):
        Ranks.start(World(0, 2))


# ------------------------------------------------------------------ train.sharding: fsdp
@pytest.mark.parametrize("sections, keys", [
    ({"train": {"optimizer": "adamw8bit"}}, "train.optimizer, train.sharding"),
    ({"train": {"optimizer": "adamw", "ema": {"decay": 0.9}}}, "train.ema, train.sharding"),
    ({"train": {"optimizer": "adamw", "blocks_to_swap": 1}}, "train.blocks_to_swap, train.sharding"),
    ({"train": {"optimizer": "adamw"}, "model": {"base_precision": "nf4"}}, "model.base_precision, train.sharding"),
])
def test_what_cannot_go_with_fsdp_is_refused_naming_the_keys(micro_model, tmp_path, sections, keys):
    sections = {**sections, "train": {**sections["train"], "sharding": "fsdp"}}
    with pytest.raises(JobInvalid, match=keys.replace(".", r"\.")):
        tiny_job(micro_model, tmp_path, **sections)


def test_fsdp_is_part_of_the_jobs_identity_so_a_ddp_checkpoint_is_refused_by_name(micro_model, tmp_path):
    from engine.checkpoint.store import changed_keys

    ddp = tiny_job(micro_model, tmp_path, train={"optimizer": "adamw"})
    fsdp = tiny_job(micro_model, tmp_path, train={"optimizer": "adamw", "sharding": "fsdp"})
    assert "sharding" not in ddp.identity()["train"]  # the default leaves existing jobs' hashes alone
    assert fsdp.identity_hash() != ddp.identity_hash()
    assert "train.sharding (default) → fsdp" in changed_keys(ddp.identity(), fsdp.identity())


def test_a_sharded_checkpoint_is_committed_with_every_shard_checksummed_and_a_corrupt_shard_is_skipped(tmp_path):
    from engine.checkpoint.store import CheckpointStore
    from engine.distributed.fsdp import rng_snapshot

    store = CheckpointStore(tmp_path / "checkpoints", "h", keep=3)
    for step in (4, 8):
        tmp = store.begin(step)  # as rank 0 names it; the ranks write their shards in it
        (tmp / "shards").mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (tmp / "shards" / name).write_bytes(f"{name} of step {step}".encode())
        store.commit(rng_snapshot(step, torch.Generator(), {"step": step}), tmp)
    loaded, skipped = store.load_latest()
    assert (loaded.step, loaded.shards, skipped) == (8, store.root / "step-00000008" / "shards", [])
    shard = store.root / "step-00000008" / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")  # one rank's shard damaged after the commit
    loaded, skipped = store.load_latest()
    assert loaded.step == 4 and loaded.shards is not None
    assert [(s.name, s.reason) for s in skipped] == [("step-00000008", "shards/__1_0.distcp fails its sha256 checksum (corrupted)")]
