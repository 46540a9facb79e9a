"""Job files: every mistake is exit 65 with one line that names the key; every shipped example loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.config.job import dump_job, load_job, parse_job
from engine.errors import JobInvalid
from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job, tiny_job_dict
from tests.helpers.processes import PY, REPO, child_env

EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))


def _set(d: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


# (id, key to set or "-key" to remove, value, words the message must contain)
BAD_KEYS = [
    ("wrong type", "train.steps", "ten", ["train.steps", "integer", "'ten'"]),
    ("wrong type float", "train.lr", "fast", ["train.lr", "number"]),
    ("below range", "lora.rank", 0, ["lora.rank", "greater than or equal to 1"]),
    ("above range", "lora.dropout", 1.5, ["lora.dropout", "less than 1"]),
    ("range seq_len", "data.seq_len", 4, ["data.seq_len", "8"]),
    ("range keep", "checkpoint.keep", 0, ["checkpoint.keep"]),
    ("not positive", "train.max_grad_norm", 0, ["train.max_grad_norm", "greater than 0"]),
    ("closed set", "train.optimizer", "sgd", ["train.optimizer", "'adamw8bit'", "'adamw'", "'sgd'"]),
    ("closed set dtype", "model.dtype", "int4", ["model.dtype", "'bfloat16'"]),
    ("closed set family", "model.family", "sd15", ["model.family", "'causal_lm'"]),
    ("unknown key", "train.learning_rate", 0.1, ["train.learning_rate", "unknown key", "lr"]),
    ("typo'd key", "train.step", 10, ["train.step", "unknown key", "did you mean train.steps?"]),
    ("unknown section", "trainer", {}, ["trainer", "unknown key", "train"]),
    ("missing section", "-data", None, ["data", "required key is missing"]),
    ("missing model path", "model.path", "/nonexistent/model-dir", ["model.path", "/nonexistent/model-dir", "does not exist"]),
    ("unknown builtin", "model.path", "builtin:nope", ["model.path", "nope", "tiny-llama"]),
    # a directory with no model in it (this test folder): named at once, never retried as a crash
    ("not a model directory", "model.path", str(Path(__file__).parent), ["model.path", "no config.json"]),
    ("missing data path", "data.path", "/nonexistent/data.jsonl", ["data.path", "does not exist"]),
    ("bad regex", "lora.targets", "([", ["lora.targets", "regular expression"]),
    ("empty targets", "lora.targets", [], ["lora.targets", "at least one"]),
    ("bad name", "name", "bad name!", ["name", "letters"]),
    ("warmup over steps", "train.warmup_steps", 500, ["train.warmup_steps", "train.steps"]),
]


def _bad_job(tmp_path: Path, micro_model: Path, key: str, value) -> Path:
    d = tiny_job_dict(micro_model, QUICKSTART_DATA)
    if key.startswith("-"):
        d.pop(key[1:])
    else:
        _set(d, key, value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("lorad:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("case", BAD_KEYS, ids=[c[0] for c in BAD_KEYS])
def test_each_bad_key_is_exit_65_with_one_line_naming_it(case, tmp_path, micro_model, capsys, keep_signal_handlers):
    from daemon.client.cli import main as lorad
    from tests.helpers.processes import trainer_main as engine_run

    _, key, value, words = case
    job = _bad_job(tmp_path, micro_model, key, value)
    with pytest.raises(JobInvalid) as e:
        load_job(job)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)

    # The same message, once, through both front doors.
    assert engine_run(["--job", str(job), "--workdir", str(tmp_path / "w")]) == 65
    line = _one_line(capsys.readouterr().err)
    assert str(e.value) in line
    assert lorad(["run", str(job), "--home", str(tmp_path / "home")]) == 65
    assert str(e.value) in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "home" / "jobs").exists()  # nothing created for a job that can never run


def test_all_problems_are_reported_together(tmp_path, micro_model):
    d = tiny_job_dict(micro_model, QUICKSTART_DATA)
    d["lora"]["rank"] = -1
    d["train"]["optimizer"] = "sgd"
    d["train"]["epochs"] = 3
    with pytest.raises(JobInvalid) as e:
        parse_job(d, tmp_path)
    for key in ("lora.rank", "train.optimizer", "train.epochs"):
        assert key in str(e.value)


FILE_PROBLEMS = [
    ("bad yaml", "name: [unclosed\nmodel: {", ["not valid YAML", "line"]),
    ("not a mapping", "- name\n- model\n", ["must be a YAML mapping", "list"]),
    ("empty file", "", ["the job file is empty", "name, model and data"]),
    ("comments only", "# a job, some day\n", ["the job file is empty"]),
    ("scalar", "just words", ["must be a YAML mapping", "str"]),
]


@pytest.mark.parametrize("case", FILE_PROBLEMS, ids=[c[0] for c in FILE_PROBLEMS])
def test_malformed_job_files_are_exit_65(case, tmp_path, capsys, keep_signal_handlers):
    from tests.helpers.processes import trainer_main as engine_run

    _, text, words = case
    job = tmp_path / "job.yaml"
    job.write_text(text)
    assert engine_run(["--job", str(job), "--workdir", str(tmp_path / "w")]) == 65
    line = _one_line(capsys.readouterr().err)
    for w in words:
        assert w in line


def test_oversized_and_binary_job_files_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "#" * 300_000)
    with pytest.raises(JobInvalid, match="larger than"):
        load_job(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(JobInvalid, match="not UTF-8"):
        load_job(binary)


@pytest.mark.parametrize("content", ["", "\n\n   \n"], ids=["empty", "blank"])
def test_an_empty_dataset_is_refused_at_load(tmp_path, micro_model, content):
    data = tmp_path / "empty.jsonl"
    data.write_text(content)
    d = deep_update(tiny_job_dict(micro_model, data), {})
    with pytest.raises(JobInvalid, match=r"data\.path: .*empty"):
        parse_job(d, tmp_path)


@pytest.mark.parametrize(
    "lines, words",
    [(['{"text": "hi"}'], ["data:", "data.seq_len=32", "fewer than one sample"]),
     (['{"body": "a long enough line of text for one sample of thirty-two tokens"}'], ["data.path", "line 1", "'text'"])],
    ids=["too few tokens", "missing text field"],
)
def test_data_that_cannot_make_one_sample_is_exit_65_at_start(tmp_path, micro_model, capsys, keep_signal_handlers, lines, words):
    from tests.helpers.processes import trainer_main as engine_run

    data = tmp_path / "small.jsonl"
    data.write_text("\n".join(lines) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job_dict(micro_model, data)))
    assert engine_run(["--job", str(job), "--workdir", str(tmp_path / "w"), "--progress", "none"]) == 65
    line = _one_line(capsys.readouterr().err)
    for w in words:
        assert w in line


def test_real_processes_exit_65_before_importing_the_training_stack(tmp_path, micro_model):
    """The exit status as the daemon and a shell see it, for both commands: at once, not after seconds of torch."""
    job = _bad_job(tmp_path, micro_model, "lora.rank", 0)
    procs = [subprocess.Popen([PY, "-X", "importtime", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(), cwd=REPO)  # side by side: each spends its life starting
             for argv in (["-m", "engine.run", "--job", str(job), "--workdir", str(tmp_path / "w")],
                          ["-m", "daemon.client.cli", "run", str(job), "--home", str(tmp_path / "home")])]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 65, err
        assert "lora.rank" in _one_line(err)
        imported = {line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
        assert "yaml" in imported and not imported & {"torch", "transformers", "peft"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_is_a_valid_job(path):
    # Some examples document real model paths that do not exist on this machine: schema only for those.
    cfg = load_job(path, check_paths=False)
    assert cfg.name
    again = parse_job(yaml.safe_load(dump_job(cfg)), path.parent, check_paths=False)
    assert again == cfg  # the normalised job written to jobs/ID/job.yaml means the same thing


def test_the_quickstart_validates_with_its_paths():
    cfg = load_job(REPO / "configs" / "examples" / "quickstart.yaml")
    assert Path(cfg.data.path).is_absolute() and Path(cfg.data.path).is_file()


def test_identity_hash_covers_what_decides_the_weights_and_nothing_else(micro_model, tmp_path):
    base = tiny_job_dict(micro_model, QUICKSTART_DATA)
    h = parse_job(base, tmp_path).identity_hash()
    same = {
        "more steps": {"train": {"steps": 500}},
        "checkpoint cadence": {"checkpoint": {"every_steps": 50, "keep": 9}},
        "priority": {"priority": 5},
        "a default written out": {"train": {"schedule": "cosine", "gradient_checkpointing": False}},
    }
    for why, over in same.items():
        assert parse_job(deep_update(base, over), tmp_path).identity_hash() == h, why
    different = {
        "learning rate": {"train": {"lr": 0.01}},
        "seed": {"train": {"seed": 12}},
        "rank": {"lora": {"rank": 8}},
        "optimizer": {"train": {"optimizer": "adamw"}},
        "seq_len": {"data": {"seq_len": 64}},
    }
    for why, over in different.items():
        assert parse_job(deep_update(base, over), tmp_path).identity_hash() != h, why


def test_the_normalised_job_file_reads_back_as_the_same_job(tmp_path, micro_model):
    """jobs/ID/job.yaml is what the trainer child reads: defaults (targets: null included) must load."""
    d = tiny_job_dict(micro_model, QUICKSTART_DATA)
    del d["lora"]["targets"]  # the family's default targets
    cfg = parse_job(d, tmp_path)
    written = tmp_path / "jobs" / "tiny" / "job.yaml"
    written.parent.mkdir(parents=True)
    written.write_text(dump_job(cfg))
    assert load_job(written) == cfg


def test_validating_a_job_does_not_import_torch():
    """The daemon validates every inbox file on its service loop; that must stay cheap."""
    code = (
        "import sys; from engine.config.job import load_job; "
        "[load_job(p) for p in sys.argv[1:]]; "
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    root = REPO / "configs" / "examples"
    jobs = [str(root / "quickstart.yaml"), str(root / "flux-lora-tiny.yaml")]
    assert subprocess.run([sys.executable, "-c", code, *jobs], cwd=root.parents[1]).returncode == 0


def _hub_error(kind):
    e = kind.__new__(kind)
    Exception.__init__(e, "404 Client Error")
    return e


@pytest.mark.parametrize("kind,words", [
    ("RepositoryNotFoundError", ["model.path: someorg/no-such-model is not on the Hugging Face Hub", "HF_TOKEN"]),
    ("GatedRepoError", ["gated model", "https://huggingface.co/someorg/no-such-model"]),
    ("RevisionNotFoundError", ["model.revision"]),
])
def test_a_hub_answer_no_retry_can_change_is_an_invalid_job(tmp_path, micro_model, capsys, monkeypatch, kind, words):
    import huggingface_hub.errors as hub_errors
    import transformers

    from engine.recipe import train

    def refuse(*a, **k):
        # how transformers reports it: an OSError raised from the hub's own error
        raise OSError("someorg/no-such-model is not a local folder and is not a valid model identifier") \
            from _hub_error(getattr(hub_errors, kind))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    cfg = tiny_job(micro_model, tmp_path, model={"path": "someorg/no-such-model"})
    assert train(cfg, tmp_path / "w", progress="none") == 65  # invalid: the daemon does not retry it
    line = _one_line(capsys.readouterr().err)
    for w in words:
        assert w in line


def test_a_network_failure_stays_a_crash_the_daemon_retries(tmp_path, micro_model, monkeypatch):
    import transformers

    from engine.recipe import train

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files") from ConnectionError()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    cfg = tiny_job(micro_model, tmp_path, model={"path": "someorg/some-model"})
    with pytest.raises(OSError, match="couldn't connect"):
        train(cfg, tmp_path / "w", progress="none")


def test_a_job_with_no_checkpoint_trigger_at_all_is_refused(tmp_path, micro_model):
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"checkpoint": {"every_steps": None, "every_seconds": None}})
    with pytest.raises(JobInvalid, match="every_steps and every_seconds are both null"):
        parse_job(d, tmp_path)
    parse_job(deep_update(d, {"checkpoint": {"every_seconds": 30}}), tmp_path)  # either one is enough


def test_the_deprecated_model_quantize_still_means_base_precision_nf4(tmp_path, micro_model):
    for also in ({}, {"base_precision": "auto"}, {"base_precision": "nf4"}):
        cfg = tiny_job(micro_model, tmp_path, model={"quantize": "nf4", **also})
        assert cfg.model.effective_base_precision == "nf4"
        assert cfg.deprecated_keys() == [("model.quantize", "model.base_precision: nf4")]
    # Kept as written in the identity: checkpoints of job files that use it still resume.
    assert tiny_job(micro_model, tmp_path, model={"quantize": "nf4"}).identity()["model"] == {
        "path": str(micro_model), "dtype": "float32", "quantize": "nf4"}
    assert tiny_job(micro_model, tmp_path).deprecated_keys() == []


@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8"])
def test_model_quantize_contradicting_base_precision_is_refused_naming_both_keys(precision, tmp_path, micro_model):
    with pytest.raises(JobInvalid) as e:
        tiny_job(micro_model, tmp_path, model={"quantize": "nf4", "base_precision": precision})
    assert "model.quantize: nf4" in str(e.value) and f"model.base_precision: {precision}" in str(e.value)


def test_a_contradictory_quantize_is_exit_65_in_one_line(tmp_path, micro_model, capsys, keep_signal_handlers):
    from tests.helpers.processes import trainer_main as engine_run

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                                              {"model": {"quantize": "nf4", "base_precision": "fp8"}})))
    assert engine_run(["--job", str(job), "--workdir", str(tmp_path / "w")]) == 65
    line = _one_line(capsys.readouterr().err)
    assert "model.quantize: nf4 contradicts model.base_precision: fp8" in line


def test_a_run_with_model_quantize_warns_that_the_key_is_deprecated(tmp_path, micro_model, capsys, monkeypatch):
    import engine.recipe as run
    from tests.helpers.jobs import read_events

    class StopsAtPrepare:
        def prepare(self, cfg, workdir, log):
            raise JobInvalid("stopped before loading anything")  # the warning comes first; no nf4 load on a CPU

    monkeypatch.setattr(run, "get_family", lambda name: StopsAtPrepare())
    cfg = tiny_job(micro_model, tmp_path, model={"quantize": "nf4"})
    assert run.train(cfg, tmp_path / "w", progress="none") == 65
    assert "lorad: warning: model.quantize is deprecated: write model.base_precision: nf4 instead" in \
        capsys.readouterr().err
    said = [e for e in read_events(tmp_path / "w") if e["event"] == "deprecated_key"]
    assert [(e["level"], e["key"], e["use"]) for e in said] == [("warning", "model.quantize", "model.base_precision: nf4")]


def _diffusers_dir(path, pipeline: str, transformer: str):
    import json

    (path / "transformer").mkdir(parents=True)
    (path / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    (path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return path


def test_a_qwen_image_21_base_is_refused_by_the_qwen_image_family_naming_the_family_that_trains_it(tmp_path):
    """Qwen-Image 2.1 is not a Qwen-Image checkpoint (another transformer, VAE and text encoder): refused at submit
    naming model.path and the family to write, never a traceback at load."""
    from tests.helpers.images import make_images

    base = _diffusers_dir(tmp_path / "qwen-image-2.1", "QwenImage21Pipeline", "QwenImage21Transformer2DModel")
    job = {"name": "q21", "model": {"family": "qwen_image", "path": str(base)},
           "data": {"path": str(make_images(tmp_path / "data", [("a.png", 32, 32, "x")]))}}
    with pytest.raises(JobInvalid, match=r"^model\.path: .* is a QwenImage21Pipeline, which model\.family "
                                         r"qwen_image does not train: it is Qwen-Image 2\.1, .*write model\.family: "
                                         r"qwen_image_21$"):
        parse_job(job, tmp_path)
    job["model"]["family"] = "qwen_image_21"
    assert parse_job(job, tmp_path).model.family == "qwen_image_21"


@pytest.mark.parametrize("path", ["dir", "builtin:tiny-qwen-image"])
def test_a_qwen_image_base_is_refused_by_the_qwen_image_21_family_naming_model_family(tmp_path, path):
    from tests.helpers.images import make_images

    if path == "dir":
        path = str(_diffusers_dir(tmp_path / "qwen-image", "QwenImagePipeline", "QwenImageTransformer2DModel"))
    job = {"name": "q21", "model": {"family": "qwen_image_21", "path": path},
           "data": {"path": str(make_images(tmp_path / "data", [("a.png", 32, 32, "x")]))}}
    with pytest.raises(JobInvalid) as e:
        parse_job(job, tmp_path)
    said = str(e.value)
    if path.startswith("builtin:"):
        assert said.endswith("model.path: builtin:tiny-qwen-image is a qwen_image model, but model.family is "
                             "qwen_image_21"), said
    else:
        assert said.startswith("model.family: qwen_image_21 trains Qwen-Image 2.1 (QwenImage21Pipeline), but "
                               f"model.path: {path} is a QwenImagePipeline"), said
