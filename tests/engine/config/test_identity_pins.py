"""identity_hash() decides whether a checkpoint resumes: it must not move under a refactor of the schema.

The hashes below and the dumps in pinned_jobs.yaml were computed by the code before the job schema was split by
section (issue 22). A change here strands every checkpoint of an existing job: never update them to pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.config.job import dump_job, parse_job
from tests.helpers.processes import REPO

PINS = yaml.safe_load((Path(__file__).parent / "pinned_jobs.yaml").read_text())
EXAMPLES = REPO / "configs" / "examples"

EXAMPLE_HASHES = {
    "chat-lora.yaml": "aaadb9714759cdd0",
    "chroma-lora.yaml": "e7fb0c1b34303553",
    "flux-lora-tiny.yaml": "5545cf09deba204d",
    "flux-lora.yaml": "dc52e1d425b3102c",
    "flux2-dev-lora.yaml": "da5a18da217c511e",
    "flux2-lora-tiny.yaml": "6f588dc5741a214c",
    "flux3-lora.yaml": "4542a962f2941a00",
    "krea2-lora.yaml": "cbd8183678eecfb0",
    "qwen-image-21-lora.yaml": "0c164b26af19eee2",
    "quickstart.yaml": "cd4477e81229dc57",
    "qwen-image-character.yaml": "e6df8589879c688b",
    "qwen-image-lora-tiny.yaml": "8a60fe8d31363931",
    "qwen2.5-7b-qlora.yaml": "0d230ebf9ca59387",
    "flux-kontext-edit-tiny.yaml": "344377e08114984e",
    "flux-kontext-edit.yaml": "3e75ff8b340426da",
    "flux2-reference-edit.yaml": "2d7162bc32d582f1",
    "qwen-image-edit.yaml": "02b4e439e2ce7d31",
    "z-image-lora.yaml": "1f9ef88b0db7e35e",
    "hunyuan-video15-24gb.yaml": "5a56027d99fc50a4",
    "wan-lora-tiny.yaml": "e536ca32db8971f8",
    "wan22-a14b-24gb.yaml": "b21ccd2db3c438da",
    "wan22-ti2v-5b-720p.yaml": "40993f195f703227",
    "flux2-klein-4b-lora.yaml": "a8ccf5b04cbcd6dc",
    "flux2-klein-9b-lora.yaml": "ad2b1135f37ac85b",
    "sdxl-lora.yaml": "11c852068832b1f8",
    "ideogram4-lora.yaml": "4414173863c74878",
    "ltx2-24gb.yaml": "7e8d2bc009e62083",
    "hidream-lora.yaml": "cdf85a4a3e648eb0",
}
JOB_HASHES = {
    "flux2_default": "9a653a1ca3942414",
    "flux_default": "72f905e9eec675d5",
    "flux_lokr": "d0ee1df22b679946",
    "flux_many": "3d8716d721573c02",
    "lm_ema_export_only": "b404794fae17f31d",
    "lm_fraction": "1e9a48c7e289f1f0",
    "lm_fsdp_nodes": "5b06d375db440da4",
    "lm_lokr": "c7aa8a7913708cf5",
    "lm_many": "88200aef9fdb7aae",
    "lm_minimal": "95411f1e1da00740",
    "lm_prodigy": "6971a0326a04f198",
    "lm_quantize": "8a8461f2244acc2a",
    "lm_schedulefree": "545891399a69e052",
    "qwen_formats": "b331aa69d6ba39ea",
}


def test_every_shipped_example_is_pinned():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_HASHES)


@pytest.mark.parametrize("name", sorted(EXAMPLE_HASHES))
def test_a_shipped_example_keeps_its_identity_and_its_normalised_dump(name):
    # A base directory that does not exist: relative paths resolve the same on every machine.
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    cfg = parse_job(raw, Path("/pinned/examples"), source=name, check_paths=False)
    assert cfg.identity_hash() == EXAMPLE_HASHES[name]
    assert dump_job(cfg) == PINS["examples"][name]


@pytest.mark.parametrize("name", sorted(JOB_HASHES))
def test_a_representative_job_keeps_its_identity_and_its_normalised_dump(name):
    cfg = parse_job(PINS["jobs"][name]["raw"], Path("/pinned"), source=name, check_paths=False)
    assert cfg.identity_hash() == JOB_HASHES[name]
    assert dump_job(cfg) == PINS["jobs"][name]["dump"]
    # the dump reads back to the same job
    again = parse_job(yaml.safe_load(dump_job(cfg)), Path("/pinned"), source=name, check_paths=False)
    assert again.identity_hash() == JOB_HASHES[name]
