"""data.validation: a fixed validation set, its loss reported every N steps, that never changes training."""

from __future__ import annotations

import pytest
import torch
import yaml

from engine.config.job import parse_job
from engine.errors import JobInvalid
from engine.families.causal_lm import CausalLM
from engine.recipe import train
from engine.training.heldout import holdout, sample_generator
from tests.helpers.fakes import RecLog
from tests.helpers.images import flux_job_dict, make_images, tiny_flux  # noqa: F401
from tests.helpers.jobs import (
    QUICKSTART_DATA,
    adapter_bytes,
    deep_update,
    read_events,
    tiny_job,
    tiny_job_dict,
)
from tests.helpers.processes import trainer_main as main

EVERY_2 = {"path": str(QUICKSTART_DATA), "every_steps": 2, "batches": 2}


def _validations(workdir) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in read_events(workdir) if e["event"] == "validation"]


def test_the_held_out_fraction_depends_on_the_seed_alone_and_leaves_samples_to_train_on():
    train, held = holdout(100, 0.05, seed=3)
    assert len(held) == 5 and sorted(train + held) == list(range(100)) and not set(train) & set(held)
    assert holdout(100, 0.05, seed=3) == (train, held)
    assert holdout(100, 0.05, seed=4)[1] != held
    assert len(holdout(10, 0.01, seed=0)[1]) == 1  # at least one sample is held out
    with pytest.raises(JobInvalid, match=r"data\.validation\.fraction: 0\.9 of 2 samples leaves none to train on"):
        holdout(2, 0.9, seed=0)


def test_training_never_sees_the_held_out_samples(micro_model, tmp_path):
    cfg = tiny_job(micro_model, tmp_path, data={"validation": {"fraction": 0.1, "every_steps": 2}})
    family = CausalLM()
    trained = family.build_dataset(cfg, tmp_path, RecLog())
    held = family.validation_set(cfg, tmp_path, RecLog())
    everything = CausalLM().build_dataset(tiny_job(micro_model, tmp_path), tmp_path, RecLog()).samples
    train_i, held_i = holdout(len(everything), 0.1, cfg.train.seed)
    assert trained.samples == [everything[i] for i in train_i]  # the rest, in their original order
    assert [held.dataset.samples[i] for i in held.indices] == [everything[i] for i in held_i]
    # the order is a seeded permutation of the training samples alone: every epoch covers each once
    assert sorted(trained.indices_at(cfg.train.seed, 0, len(trained))) == list(range(len(trained)))


def _train(micro_model, tmp_path, name: str, train_over: dict, data: dict):
    cfg = tiny_job(micro_model, tmp_path, train={"steps": 6, **train_over}, data=data)
    assert train(cfg, tmp_path / name, progress="none") == 0
    return tmp_path / name


def test_schedulefree_trains_bit_identically_with_and_without_validation(micro_model, tmp_path):
    # evaluated on its averaged weights, swapped in and back out bit for bit
    sf = {"optimizer": "adamw_schedulefree", "schedule": "constant"}
    with_val = _train(micro_model, tmp_path, "with", sf, {"validation": EVERY_2})
    assert adapter_bytes(with_val) == adapter_bytes(_train(micro_model, tmp_path, "without", sf, {}))
    values = _validations(with_val)
    assert [s for s, _ in values] == [2, 4, 6] and len({v for _, v in values}) == 3  # the weights moved between


def test_with_ema_validation_reads_the_averaged_weights_and_training_is_unchanged(micro_model, tmp_path):
    ema = {"optimizer": "adamw", "ema": {"decay": 0.8}}
    with_val = _train(micro_model, tmp_path, "with", ema, {"validation": EVERY_2})
    assert adapter_bytes(with_val) == adapter_bytes(_train(micro_model, tmp_path, "without", ema, {}))
    assert not _validations(tmp_path / "without")
    # the same raw weights without EMA (EMA never feeds back into training) evaluate differently: the EMA's are read
    raw = _validations(_train(micro_model, tmp_path, "raw", {"optimizer": "adamw"}, {"validation": EVERY_2}))
    averaged = _validations(with_val)
    assert [s for s, _ in averaged] == [s for s, _ in raw] == [2, 4, 6]
    assert all(a != r for (_, a), (_, r) in zip(averaged, raw, strict=True))


@pytest.mark.parametrize("validation, key", [
    ({"path": "x.jsonl", "fraction": 0.1}, r"data\.validation: give exactly one of path"),
    ({"every_steps": 10}, r"data\.validation: give exactly one of path"),
    ({"fraction": 0.0}, r"data\.validation\.fraction: must be greater than 0"),
    ({"fraction": 1.0}, r"data\.validation\.fraction: must be less than 1"),
    ({"fraction": 0.1, "every_steps": 0}, r"data\.validation\.every_steps: must be greater than or equal to 1"),
    ({"fraction": 0.1, "batches": 0}, r"data\.validation\.batches: must be greater than or equal to 1"),
    ({"fraction": 0.1, "evry_steps": 5}, r"data\.validation\.evry_steps: unknown key"),
    ({"path": "missing.jsonl"}, r"data\.validation\.path: .*missing\.jsonl does not exist"),
])
def test_a_bad_validation_key_is_refused_by_name(micro_model, tmp_path, validation, key):
    with pytest.raises(JobInvalid, match=key):
        tiny_job(micro_model, tmp_path, data={"validation": validation})


def test_a_validation_path_of_the_other_family_exits_65_naming_the_key(micro_model, tmp_path, capfd,
                                                                          keep_signal_handlers):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                                              {"data": {"validation": {"path": str(images)}}})))
    assert main(["--job", str(job), "--workdir", str(tmp_path / "w")]) == 65
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.validation.path: " in err[0] and "contains no .txt files" in err[0], err
    flux = {"name": "f", "model": {"family": "flux", "path": "builtin:tiny-flux"},
            "data": {"path": str(images), "validation": {"path": str(QUICKSTART_DATA)}}}
    with pytest.raises(JobInvalid, match=r"data\.validation\.path: .*must be a folder of images"):
        parse_job(flux, tmp_path)


def test_the_daemons_allowed_roots_cover_the_validation_path(tmp_path):
    from engine.config.policy import JobPolicy

    inside, outside = tmp_path / "root" / "train.jsonl", tmp_path / "elsewhere" / "val.jsonl"
    for f in (inside, outside):
        f.parent.mkdir()
        f.write_text('{"text": "x"}\n')
    policy = JobPolicy(False, (inside.parent,))
    policy.check({"data": {"path": str(inside), "validation": {"path": str(inside)}}}, tmp_path)
    with pytest.raises(JobInvalid, match=r"^data\.validation\.path: .*outside the allowed roots"):
        policy.check({"data": {"path": str(inside), "validation": {"path": str(outside)}}}, tmp_path)


def test_only_the_fraction_decides_the_weights(micro_model, tmp_path):
    plain = tiny_job(micro_model, tmp_path).identity_hash()
    assert tiny_job(micro_model, tmp_path, data={"validation": EVERY_2}).identity_hash() == plain
    frac = tiny_job(micro_model, tmp_path, data={"validation": {"fraction": 0.1}}).identity_hash()
    assert frac != plain
    assert tiny_job(micro_model, tmp_path, data={"validation": {"fraction": 0.1, "every_steps": 7,
                                                                 "batches": 3}}).identity_hash() == frac


def test_a_flux_validation_sample_gets_the_same_noise_at_every_evaluation():
    a, b = sample_generator(3, 5), sample_generator(3, 5)
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))
    assert not torch.equal(torch.randn(8, generator=sample_generator(3, 5)),
                           torch.randn(8, generator=sample_generator(3, 6)))


def test_flux_validation_gives_the_same_number_for_the_same_weights_and_leaves_the_rng_alone(tiny_flux, tmp_path):  # noqa: F811
    from engine.distributed.ddp import Ranks, World
    from engine.families.image.flux import Flux
    from engine.training.heldout import evaluate

    data = make_images(tmp_path / "data")
    cfg = parse_job(flux_job_dict(tiny_flux, data, data={"validation": {"fraction": 0.4, "every_steps": 1}}),
                    tmp_path)
    family, log = Flux(), RecLog()
    family.build_dataset(cfg, tmp_path / "w", log)
    vset = family.validation_set(cfg, tmp_path / "w", log)
    trained = {it.record.rel for it in family.items[:family.n_train]}
    held = {family.items[i].record.rel for i in vset.indices}
    assert len(held) == 2 and not trained & held  # 2 of 5 images, each at both resolutions
    assert len(vset.indices) == 4
    model = family.load_model(cfg, tmp_path / "w", torch.device("cpu"), log)
    model.train()
    rng = torch.get_rng_state()
    first = evaluate(family, model, vset, cfg, torch.device("cpu"), Ranks(World()), log, step=1)
    second = evaluate(family, model, vset, cfg, torch.device("cpu"), Ranks(World()), log, step=2)
    assert first == second and first[1] == 2  # 4 samples in batches of train.batch_size 2
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert [e["phase"] for e in log.named("heartbeat")] == ["validation"] * 4
