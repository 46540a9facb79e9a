"""The Flux cache encodes each image/bucket and each caption once, re-encodes only what changed or rotted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from daemon.client.cli import main as lorad
from engine.config.job import load_job
from engine.families.image.flux import Flux
from engine.storage.cache_evict import LEASES
from tests.helpers import images as fh
from tests.helpers.fakes import RecLog
from tests.helpers.images import IMAGES, make_images, write_flux_job
from tests.helpers.processes import REPO

tiny_flux = fh.tiny_flux  # shared session fixture

N_IMAGES, N_RES = len(IMAGES), 2
PROMPT = "sks, a tower at night"


@pytest.fixture
def job(tmp_path, tiny_flux):
    data = make_images(tmp_path / "data")
    return write_flux_job(tmp_path / "job.yaml", tiny_flux, data,
                          sample={"every_steps": 5, "prompts": [PROMPT], "width": 32, "height": 32})


def prepare(job_path: Path, workdir: Path):
    log = RecLog()
    fam = Flux()
    fam.prepare(load_job(job_path), workdir, log)
    return fam.report, log, fam


def test_first_run_encodes_everything_once_and_a_second_run_nothing(job, tmp_path):
    wd = tmp_path / "work"
    rep, log, fam = prepare(job, wd)
    assert len(rep.encoded["latent"]) == N_IMAGES * N_RES  # every image at every resolution's bucket
    # distinct captions (the caption-less image is the trigger alone), the empty caption, the sample prompt
    assert sorted(rep.encoded["text"]) == sorted(
        ["sks, " + c for _, _, _, c in IMAGES if c] + ["sks", "", PROMPT])
    assert log.named("cache_progress")[-1]["done"] == log.named("cache_progress")[-1]["total"] == 10 + 7
    entries = _entries(wd / "cache")
    assert len(entries) == 17
    files = sorted(p.name for p in (wd / "cache").iterdir() if not p.name.endswith(".entry.json"))
    assert files == sorted([LEASES, *(e["file"] for e in entries.values())])  # nothing half-written left
    # flip: true caches the mirrored latent next to the plain one
    lat = fam.cache.load(fam.plan.item_latent[0])
    assert set(lat) == {"latent", "latent_flip"} and lat["latent"].shape[0] == 4

    rep2, _, _ = prepare(job, wd)
    assert rep2.encoded["latent"] == [] and rep2.encoded["text"] == [] and rep2.reused == 17


def test_the_encoders_are_freed_after_caching(job, tmp_path):
    import gc

    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, T5EncoderModel

    prepare(job, tmp_path / "work")
    gc.collect()
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (AutoencoderKL, CLIPTextModel, T5EncoderModel))]
    assert alive == []


def test_changing_one_caption_re_encodes_only_that_caption(job, tmp_path):
    wd = tmp_path / "work"
    prepare(job, wd)
    (tmp_path / "data" / "tall-0.txt").write_text("a green tower, overgrown\n")
    rep, _, fam = prepare(job, wd)
    assert rep.encoded["text"] == ["sks, a green tower, overgrown"]
    assert rep.encoded["latent"] == []
    # the old caption's embedding stays: the cache is shared, and another job may still train on it
    sources = [e["source"] for e in _entries(wd / "cache").values()]
    assert "sks, a green tower" in sources and "sks, a green tower, overgrown" in sources


def test_a_new_image_is_encoded_alone_at_each_resolution(job, tmp_path):
    wd = tmp_path / "work"
    prepare(job, wd)
    make_images(tmp_path / "data", images=[("extra.png", 50, 50, "a yellow sun")], seed=9)
    rep, _, _ = prepare(job, wd)
    assert rep.encoded["latent"] == ["extra.png@48x48", "extra.png@64x64"]
    assert rep.encoded["text"] == []  # same caption text as square-0.png: shared


def test_corrupt_truncated_and_missing_cache_files_are_detected_and_re_encoded(job, tmp_path):
    wd = tmp_path / "work"
    _, _, fam = prepare(job, wd)
    latent_a, latent_b = (fam.cache.entries[fam.plan.item_latent[i]] for i in (0, 2))
    text = fam.cache.entries[fam.plan.item_text[0]]
    good = {e["file"]: (wd / "cache" / e["file"]).read_bytes() for e in (latent_a, latent_b, text)}
    flipped = bytearray(good[latent_a["file"]])
    flipped[len(flipped) // 2] ^= 0x40  # one bit of one value: same size, wrong checksum
    (wd / "cache" / latent_a["file"]).write_bytes(bytes(flipped))
    (wd / "cache" / text["file"]).write_bytes(good[text["file"]][:-7])
    (wd / "cache" / latent_b["file"]).unlink()
    rep, log, _ = prepare(job, wd)
    assert sorted(rep.corrupt) == sorted(good)
    assert sorted(e["file"] for e in log.named("cache_corrupt")) == sorted(good)
    assert len(rep.encoded["latent"]) == 2 and len(rep.encoded["text"]) == 1
    for name, data in good.items():
        assert (wd / "cache" / name).read_bytes() == data  # encoding is deterministic: the same bytes come back


def _entries(root: Path) -> dict[str, dict]:
    return {p.name[: -len(".entry.json")]: json.loads(p.read_text()) for p in root.glob("*.entry.json")}


def test_lorad_cache_ahead_of_time_leaves_the_daemon_job_nothing_to_encode(job, tmp_path, capsys):
    home = tmp_path / "home"
    (tmp_path / "daemon.yaml").write_text("cache_max_bytes: 1073741824\n")
    assert lorad(["cache", str(job), "--home", str(home), "--quiet", "--config", str(tmp_path / "daemon.yaml")]) == 0
    assert len(_entries(home / "cache")) == 17  # HOME/cache, not jobs/NAME/cache
    said = capsys.readouterr().err.splitlines()[-1]  # its size and the daemon's limit
    assert re.fullmatch(rf"lorad: cache {re.escape(str((home / 'cache').resolve()))}: 17 entries, \d+\.\d MiB; "
                        r"compile cache 0 keys, 0\.0 MiB; limit 1024\.0 MiB", said), said
    # the daemon runs the job in jobs/<name>-<id>, a directory `lorad cache` never saw
    rep, log, _ = prepare(job, home / "jobs" / "tiny-flux-3f9c2a")
    assert rep.encoded == {"latent": [], "text": []} and rep.reused == 17
    assert log.named("cache_start")[0]["dir"] == str((home / "cache").resolve())


def test_two_jobs_on_the_same_images_share_their_latents(job, tmp_path, tiny_flux):
    home = tmp_path / "home"
    prepare(job, home / "jobs" / "a-1")
    other = write_flux_job(tmp_path / "other.yaml", tiny_flux, tmp_path / "data", data={"trigger": "zkz"},
                           train={"steps": 3})
    rep, _, _ = prepare(other, home / "jobs" / "b-2")
    assert rep.encoded["latent"] == []  # same images, buckets, model: every latent came from job a
    assert sorted(rep.encoded["text"]) == sorted(["zkz, " + c for _, _, _, c in IMAGES if c] + ["zkz"])


def test_lorad_cache_refuses_a_causal_lm_job(tmp_path):
    repo = REPO
    shutil.copy(repo / "configs/examples/quickstart.yaml", tmp_path / "q.yaml")
    shutil.copytree(repo / "configs/examples/data", tmp_path / "data")
    assert lorad(["cache", str(tmp_path / "q.yaml"), "--home", str(tmp_path / "home"), "--quiet"]) == 65


def test_a_job_after_an_eviction_re_encodes_exactly_what_was_evicted_and_trains_bit_identically(job, tmp_path,
                                                                                                tiny_flux):
    """HOME/cache over its limit: job b's fill evicts job a's least recently used entries (its texts: b shares and
    touches the latents); job a again encodes exactly those, into the same files, and trains the same adapter."""
    import gc

    import yaml

    from engine.recipe import train
    from engine.storage import cache_evict
    from tests.helpers.images import tensor_bytes

    home = tmp_path / "home"
    d = yaml.safe_load(job.read_text())
    d["sample"], d["train"]["steps"] = {}, 3
    job.write_text(yaml.safe_dump(d))
    other = write_flux_job(tmp_path / "other.yaml", tiny_flux, tmp_path / "data", data={"trigger": "zkz"},
                           train={"steps": 1})

    def run(path: Path, name: str) -> Path:
        assert train(load_job(path), home / "jobs" / name, progress="none") == 0
        gc.collect()  # the finished job's Cache (and its lease) goes, as it would with its process
        return home / "jobs" / name

    def files() -> set[str]:
        return {p.name for p in (home / "cache").glob("*.safetensors")}

    first = run(job, "a-1")
    _, size = cache_evict.usage(home / "cache")
    cache_evict.set_limit(size)  # what job a's entries take; job b's new texts push the cache over it
    try:
        b = run(other, "b-2")
        evicted = {e["file"] for e in _events(b) if e["event"] == "cache_evicted"}
        assert evicted and all(name.startswith("text-") for name in evicted)
        assert cache_evict.usage(home / "cache")[1] <= size
        before = files()
        again = run(job, "a-3")
    finally:
        cache_evict.set_limit(None)
    start = next(e for e in _events(again) if e["event"] == "cache_start")
    assert start["to_encode"] == len(evicted) and files() - before == evicted  # deterministic: the same files
    assert tensor_bytes(again / "output" / "pytorch_lora_weights.safetensors") == \
        tensor_bytes(first / "output" / "pytorch_lora_weights.safetensors")


def _events(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
