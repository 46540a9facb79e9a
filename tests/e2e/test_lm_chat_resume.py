"""A chat-format, chunked-loss causal-LM job killed mid-run and resumed ends bit-identical to an uninterrupted one.

The trainers are real processes forked from a server that imported the stack once (tests/helpers/forked.py); the
SIGKILL is real."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from tests.helpers.forked import killed_then_resumed, run_to_end
from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, tiny_job_dict

TOPICS = ["boats", "trains", "clouds", "bread", "maps", "owls", "glass", "rivers"]


def write_chat_data(path: Path) -> Path:
    lines = []
    for i, topic in enumerate(TOPICS * 2):
        lines.append(json.dumps({"messages": [
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": f"Tell me about {topic} ({i})."},
            {"role": "assistant", "content": f"{topic.capitalize()} are worth a closer look, fact {i}."},
        ]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_job(root: Path, micro_model: Path) -> Path:
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {
        "name": "tiny-chat",
        "data": {"path": str(write_chat_data(root / "chat.jsonl")), "seq_len": 48, "train_on": "completions"},
        "train": {"steps": 12, "warmup_steps": 2, "chunked_loss": True},
        "checkpoint": {"every_steps": 3},
    })
    job = root / "chat.yaml"
    job.write_text(yaml.safe_dump(d, sort_keys=False))
    return job


def _uninterrupted(job: Path, wd: Path) -> Path:
    t = run_to_end(job, wd)
    assert t.named("chunked_loss") and t.named("chat_template_fallback")
    assert t.named("dataset")[0]["format"] == "chat"
    return wd


def test_a_killed_chat_job_with_chunked_loss_resumes_bit_identical(tmp_path, micro_model):
    job = chat_job(tmp_path, micro_model)
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(_uninterrupted, job, tmp_path / "uninterrupted")
        got = pool.submit(killed_then_resumed, job, tmp_path / "interrupted", kill_at=(4, 9))
        ref_wd, from_step = ref.result(timeout=600), got.result(timeout=600)
    want, have = adapter_bytes(ref_wd), adapter_bytes(tmp_path / "interrupted")
    assert sorted(want) == sorted(have)
    assert [k for k in want if want[k] != have[k]] == [], f"resumed from step {from_step}"
