"""Drop a folder of images and walk away: captions written by a vision-language model as the job's first stage,
resumable, never written into the user's folder, reused by the next job on the same images.

The captioner is builtin:tiny-captioner (a random LLaVA built from a transformers config and saved, so the real
AutoProcessor / AutoModelForImageTextToText loading runs); the base is the tiny FLUX.1 pipeline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from engine.config.job import load_job
from engine.errors import JobInvalid
from tests.helpers import images
from tests.helpers.forked import ForkedTrainer, run_to_end
from tests.helpers.images import flux_job_dict, make_images, tensor_bytes

tiny_flux = images.tiny_flux  # shared session fixture

CAPTIONER = {"model": "builtin:tiny-captioner", "batch_size": 2, "max_tokens": 8}
NAMES = [name for name, *_ in images.IMAGES]


def _job(path: Path, model: Path, data: Path, **data_over) -> Path:
    d = flux_job_dict(model, data, train={"steps": 6}, checkpoint={"every_steps": 2, "keep": 5},
                      data={"captions": "auto", "captioner": CAPTIONER, **data_over})
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def _in_home(home: Path, job_id: str) -> Path:
    """HOME/jobs/ID, the layout whose HOME/cache the home's jobs share (engine/storage/home.py)."""
    (home / "jobs").mkdir(parents=True, exist_ok=True)
    return home / "jobs" / job_id


def _generated(events: list[dict]) -> list[str]:
    return [name for e in events if e.get("event") == "captions_committed" for name in e["images"]]


def _all_events(wd: Path) -> list[dict]:
    return [json.loads(line) for line in (wd / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_flux):
    """An uninterrupted run: its captions and adapter, which a killed run must reproduce bit for bit."""
    root = tmp_path_factory.mktemp("captions-ref")
    data = make_images(root / "data")
    job = _job(root / "job.yaml", tiny_flux, data)
    run_to_end(job, _in_home(root / "home", "ref"))
    return root, data


def test_captions_killed_mid_stage_and_mid_training_end_bit_identical_and_none_is_generated_twice(
        reference, tmp_path, tiny_flux):
    ref_root, data = reference
    ref = ref_root / "home" / "jobs" / "ref"
    before = sorted(p.name for p in data.iterdir())
    job = _job(tmp_path / "job.yaml", tiny_flux, data)
    wd = _in_home(tmp_path / "home", "killed")
    t = ForkedTrainer(job, wd, LORAD_DEBUG_STEP_DELAY_S="0.4", LORAD_CKPT_WRITER_NICE="0")
    t.wait_for(lambda: bool(t.named("captions_committed")))  # the first batch of two is committed
    t.kill()
    assert len(_generated(_all_events(wd))) < len(NAMES), "the kill came after the whole stage"
    t = ForkedTrainer(job, wd, LORAD_DEBUG_STEP_DELAY_S="0.4", LORAD_CKPT_WRITER_NICE="0")
    t.wait_for(lambda: bool(t.named("checkpoint_committed")))
    t.kill()  # mid-training: captions all committed, the cache perhaps half filled
    assert run_to_end(job, wd).named("done")

    generated = _generated(_all_events(wd))
    assert sorted(generated) == sorted(NAMES)  # every caption generated exactly once over the three runs
    ours, theirs = (json.loads((d / "captions.json").read_text()) for d in (wd, ref))
    assert ours == theirs and set(ours) == set(NAMES)
    assert all(c.startswith("sks") for c in ours.values())  # the trigger leads every caption
    for name in ("pytorch_lora_weights.safetensors", "flux_lora_comfyui.safetensors"):
        assert tensor_bytes(wd / "output" / name) == tensor_bytes(ref / "output" / name)
    assert sorted(p.name for p in data.iterdir()) == before  # nothing written into the user's folder


def test_a_second_job_on_the_same_images_and_captioner_generates_nothing(reference, tiny_flux, tmp_path):
    ref_root, data = reference
    job = _job(tmp_path / "again.yaml", tiny_flux, data)
    wd = _in_home(ref_root / "home", "again")  # the same home: its cache holds the reference's captions
    t = ForkedTrainer(job, wd)
    t.wait_for(lambda: bool(t.named("captioning")))
    t.kill()
    (ev,) = [e for e in _all_events(wd) if e["event"] == "captioning"]
    assert (ev["cached"], ev["to_caption"]) == (len(NAMES), 0)
    assert not _generated(_all_events(wd))


def test_files_else_auto_captions_only_the_images_without_a_caption_file(reference, tiny_flux, tmp_path):
    ref_root, data = reference
    job = _job(tmp_path / "mixed.yaml", tiny_flux, data, captions="files-else-auto")
    wd = tmp_path / "work"
    t = ForkedTrainer(job, wd)
    t.wait_for(lambda: bool(t.named("captioning")) and (wd / "captions.json").exists())
    t.kill()
    caps = json.loads((wd / "captions.json").read_text())
    assert caps["wide-0.png"] == "sks, a red square on grass"  # its file's caption
    (missing,) = [n for n, *rest in images.IMAGES if rest[-1] is None]
    (ev,) = [e for e in _all_events(wd) if e["event"] == "captioning"]
    assert ev["images"] == 1 and caps[missing].startswith("sks")


def test_an_edit_made_before_training_wins_enters_the_identity_and_is_never_trained_half_and_half(
        reference, tiny_flux, tmp_path):
    from engine.config.caption_edits import EDITS_FILE

    ref_root, data = reference
    ref = ref_root / "home" / "jobs" / "ref"
    job = _job(tmp_path / "edited.yaml", tiny_flux, data)
    wd = _in_home(ref_root / "home", "edited")  # the reference's captions are in this home's cache
    wd.mkdir()
    (wd / EDITS_FILE).write_text(json.dumps({NAMES[0]: "sks, my own words"}))  # as the daemon writes it
    t = ForkedTrainer(job, wd, LORAD_CKPT_WRITER_NICE="0")
    t.wait_for(lambda: bool(t.named("checkpoint_committed")))
    t.kill()
    ours, theirs = (json.loads((d / "captions.json").read_text()) for d in (wd, ref))
    assert ours == {**theirs, NAMES[0]: "sks, my own words"}  # the edit wins; every other caption as generated
    assert not _generated(_all_events(wd))
    (manifest,) = [json.loads(m.read_text()) for m in (wd / "checkpoints").glob("step-*/manifest.json")][:1]
    assert set(manifest["identity"]["caption_edits"]) == {NAMES[0]}
    assert manifest["config_hash"] != load_job(job).identity_hash()

    # An edit after training began (the daemon refuses it; written here by hand) would train the job half on one
    # caption and half on another: the checkpoint is not resumed as this job's (exit 65, naming the edit).
    (wd / EDITS_FILE).write_text(json.dumps({NAMES[0]: "sks, other words"}))
    t = ForkedTrainer(job, wd)
    assert t.finish(300) == 65
    assert f"caption_edits.{NAMES[0]}" in t.named("invalid_job")[-1]["message"]


def test_held_for_review_after_the_stage_then_an_edit_and_resume_train_on_the_edited_caption(
        reference, tiny_flux, tmp_path):
    """data.captioner.hold_for_review: the trainer stops after its captions (exit 75, nothing trained); the daemon's
    own `caption` and `resume` handlers edit a caption and release the hold; the next attempt trains on the edit."""
    from daemon import protocol as p
    from daemon.service import handlers
    from daemon.store import states
    from daemon.store.db import Store
    from daemon.supervisor.exit_policy import HELD_FOR_REVIEW

    ref_root, data = reference
    job = tmp_path / "held.yaml"
    job.write_text(yaml.safe_dump(flux_job_dict(tiny_flux, data, train={"steps": 2}, checkpoint={"every_steps": 2},
                                                data={"captions": "auto", "captioner": {**CAPTIONER,
                                                                                        "hold_for_review": True}})))
    wd = _in_home(ref_root / "home", "held")  # the reference's captions are cached: nothing is generated
    t = ForkedTrainer(job, wd)
    assert t.finish(300) == 75
    (ready,) = t.named("captions_ready")
    assert "lorad resume" in ready["message"] and not t.named("step") and not (wd / "checkpoints").exists()
    generated = json.loads((wd / "captions.json").read_text())  # shown for review

    store = Store(tmp_path / "state.db")  # the job as the daemon holds it after that exit (reap_path.py)
    jid = store.new_id("held")
    store.add_job(jid, "held", wd, 0, 2, "submit:test")
    store.transition(jid, states.QUEUED, states.PAUSED, HELD_FOR_REVIEW, stage=HELD_FOR_REVIEW)
    ctx = handlers.Context(home=ref_root / "home", store=store, intake=None, supervisor=None, started_at=0.0,
                           socket_path=tmp_path / "sock")
    handlers.caption(ctx, p.EditCaption(job=jid, image=NAMES[0], caption="sks, reviewed words"))
    assert handlers.resume(ctx, p.Resume(job=jid)).state == states.QUEUED
    assert store.get(jid)["stage"] is None
    store.close()

    t = run_to_end(job, wd)
    assert t.named("done") and not t.named("captions_ready") and not _generated(_all_events(wd))
    assert json.loads((wd / "captions.json").read_text()) == {**generated, NAMES[0]: "sks, reviewed words"}
    (manifest,) = [json.loads(m.read_text()) for m in (wd / "checkpoints").glob("step-*/manifest.json")][-1:]
    assert set(manifest["identity"]["caption_edits"]) == {NAMES[0]}  # the edit is what it trained on


# ------------------------------------------------------------------------------------------------ bad input
def test_a_captioner_that_sees_no_images_or_needs_remote_code_is_refused_naming_the_key(tmp_path):
    from engine.captioning.captioner import check

    plain = tmp_path / "llm"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(JobInvalid, match=r"data.captioner.model: .*llm is not a vision-language model"):
        check(plain, str(plain))
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "llava", "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(JobInvalid, match=r"data.captioner.model: .*remote needs trust_remote_code"):
        check(remote, str(remote))


def test_captioner_keys_are_checked_with_the_job(tmp_path):
    data = make_images(tmp_path / "data")
    d = flux_job_dict("builtin:tiny-flux", data, data={"captioner": CAPTIONER})  # captions still `files`
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(JobInvalid, match="captioner: set data.captions to auto"):
        load_job(tmp_path / "a.yaml")
    d = flux_job_dict("builtin:tiny-flux", data, data={"captions": "sometimes"})
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(JobInvalid, match="data.captions"):
        load_job(tmp_path / "b.yaml")


def test_lorad_captions_writes_them_out_as_text_files_without_a_daemon(reference, tmp_path, capsys):
    from daemon.client.cli import main as lorad

    ref_root, _data = reference
    home = ref_root / "home"
    caps = json.loads((home / "jobs" / "ref" / "captions.json").read_text())
    out = tmp_path / "captions"
    assert lorad(["captions", "ref", "--home", str(home), "--to", str(out)]) == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        Path(rel).with_suffix(".txt").name: text + "\n" for rel, text in caps.items()}
    (out / "wide-0.txt").write_text("mine")
    assert lorad(["captions", "ref", "--home", str(home), "--to", str(out)]) == 1
    assert "--force" in capsys.readouterr().err and (out / "wide-0.txt").read_text() == "mine"
    assert lorad(["captions", "nope", "--home", str(home), "--to", str(out)]) == 1
    assert "holds no job named 'nope'" in capsys.readouterr().err
    assert "could not be read" not in capsys.readouterr().out  # nothing skipped: nothing said


def test_lorad_captions_names_the_files_the_stage_could_not_read(reference, tmp_path, capsys):
    from daemon.client.cli import main as lorad
    from daemon.supervisor import caption_edits
    from engine.captioning import stage

    assert caption_edits.SKIPS_FILE == stage.SKIPS_FILE  # the CLI reads the file the stage writes
    ref_root, _data = reference
    home = tmp_path / "home"
    shutil.copytree(ref_root / "home" / "jobs" / "ref", home / "jobs" / "ref", symlinks=True)
    (home / "jobs" / "ref" / stage.SKIPS_FILE).write_text(json.dumps({"broken.png": "ab" * 32, "cut.png": "cd" * 32}))
    capsys.readouterr()
    assert lorad(["captions", "ref", "--home", str(home), "--to", str(tmp_path / "out")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("job ref: 2 file(s) could not be read and have no caption (why: `lorad logs ref`, "
                    "caption_skipped): broken.png, cut.png")
