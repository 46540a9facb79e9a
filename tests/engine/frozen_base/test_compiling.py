"""torch.compile in training (engine/frozen_base/compiling.py): on by default on CUDA only, once per block, eager
after a compile error or the recompile limit (said once), a cache file in the home that a torn or stale copy
never turns into a crash, and a Qwen-Image job whose captions and buckets vary within a fixed number of compiles.

Dynamo runs with backend="eager" here (its tracing and guards, without inductor's C++ code generation), so each
test costs what tracing costs; bench/compile_cache.py measures the cache with the real inductor."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from engine.frozen_base import compiling
from engine.frozen_base.compiling import MAGIC, CompileCache, CompiledForward, CompileState, compile_wanted
from engine.frozen_base.speedups import compile_blocks
from tests.helpers.fakes import RecLog
from tests.helpers.images import make_images
from tests.helpers.stacks import make_stack


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_auto_compiles_on_cuda_only_and_a_setting_forces_it_either_way():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    train = SimpleNamespace(compile="auto")
    assert compile_wanted(train, cuda) and not compile_wanted(train, cpu)
    assert not compile_wanted(SimpleNamespace(compile="auto", sharding="fsdp"), cuda)
    assert compile_wanted(SimpleNamespace(compile=True), cpu)
    assert not compile_wanted(SimpleNamespace(compile=False), cuda)
    from engine.config.train import TrainConfig

    assert TrainConfig().compile == "auto"


def test_a_block_is_compiled_once_however_often_it_is_asked():
    model = make_stack(n=3)
    state = CompileState()
    assert compile_blocks(list(model.blocks), backend="eager", state=state) == 3
    first = [b.forward for b in model.blocks]
    assert compile_blocks(list(model.blocks), backend="eager", state=state) == 0
    assert [b.forward for b in model.blocks] == first and all(isinstance(f, CompiledForward) for f in first)
    assert first[0].eager.__func__ is type(model.blocks[0]).forward  # one frame deep, not a compiled compiled one


def broken_backend(gm, example_inputs):
    raise RuntimeError("the backend cannot build this graph")


def test_a_compile_error_falls_back_to_eager_and_is_said_once():
    model, ref = make_stack(n=3), make_stack(n=3)
    log = RecLog()
    state = CompileState(log)
    compile_blocks(list(model.blocks), backend=broken_backend, state=state)
    x = torch.randn(4, 32)
    for _ in range(2):
        out = model(x)
        assert torch.equal(out, ref(x))
        out.backward()
    falls = log.named("compile_fallback")
    assert len(falls) == 1 and falls[0]["block"] == "Block" and "compile error" in falls[0]["reason"]
    assert state.eager == {"Block": falls[0]["reason"]}


def backend_whose_backward_fails(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd

    def backward(bw_gm, bw_inputs):
        raise RuntimeError("the backend cannot build this backward")

    return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=backward)(gm, example_inputs)


def test_a_compile_error_in_the_backward_falls_back_to_eager_too_and_the_gradients_are_eagers():
    model, ref = make_stack(n=3), make_stack(n=3)
    log = RecLog()
    compile_blocks(list(model.blocks), backend=backend_whose_backward_fails, state=CompileState(log))
    x = torch.randn(4, 32)
    model(x).backward()  # lowered lazily, this backward would raise the backend's error: the step would crash
    ref(x).backward()
    grads = [(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters(), strict=True)]
    assert any(a is not None for a, _ in grads)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in grads)
    (fall,) = log.named("compile_fallback")
    assert fall["reason"] == ("compile error: BackendCompilerFailed (RuntimeError: the backend cannot build this "
                              "backward)")


class Scaled(nn.Module):
    """A block with a Python number among its arguments: dynamo specialises on its value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, k: int):
        return self.lin(x) * k


def test_past_the_recompile_limit_the_block_goes_eager_with_an_event_not_silently():
    log = RecLog()
    state = CompileState(log)
    block = Scaled()
    compile_blocks([block], backend="eager", state=state)
    x = torch.randn(2, 8)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        for k in (1, 2, 3, 4):  # every value a recompile: the third is past the limit
            assert torch.equal(block(x, k), block.forward.eager(x, k))
    events = [e for _, e, _ in log.events]
    assert events.count("compile_fallback") == 1 and events.count("recompile") == 1
    assert "recompile limit" in state.eager["Scaled"]


def test_the_token_dimensions_are_dynamic_from_the_first_compile_so_other_buckets_compile_nothing():
    state = CompileState()
    block = make_stack(n=1).blocks[0]
    compile_blocks([block], backend="eager", state=state)
    for rows in (3, 5, 7):  # another bucket's token count: served by the first graph
        x = torch.randn(2, rows, 32)
        assert torch.equal(block(x), block.forward.eager(x))
    assert state.compiles == {"Block": 1}


# ----------------------------------------------------------------------------------------------------- the cache
def artifacts_of_a_compile(monkeypatch, payload: bytes):
    """What torch.compiler would hold after a compile, and a record of what a load puts back in its caches."""
    from torch.compiler._cache import CacheArtifactManager

    loaded = []
    monkeypatch.setattr(CacheArtifactManager, "need_serialize", classmethod(lambda cls: True))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, object()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or object())
    return loaded


def test_the_cache_is_committed_whole_and_a_later_start_loads_it(monkeypatch, tmp_path):
    loaded = artifacts_of_a_compile(monkeypatch, b"artifacts " * 1000)
    path = tmp_path / "home" / "cache" / "compile" / "k.bin"
    log = RecLog()
    assert CompileCache(path, log).load() == "cold" and not path.exists()
    assert CompileCache(path, log).save()
    assert os.listdir(path.parent) == ["k.bin"]  # renamed into place: no temp file left beside it
    assert CompileCache(path, log).load() == "warm" and loaded == [b"artifacts " * 1000]
    assert [kw["status"] for kw in log.named("compile_cache")] == ["cold", "saved", "warm"]


def write_cache(path: Path, payload: bytes) -> bytes:
    import hashlib

    data = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "foreign", "stale"])
def test_a_torn_corrupt_or_stale_cache_file_is_a_cold_compile_never_a_crash(damage, tmp_path):
    path = tmp_path / "k.bin"
    # "stale": intact to the last byte, but not artifacts this torch can read (another version's, say)
    data = write_cache(path, b"\x00not the artifacts torch wrote\xff" * 50)
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])  # a write cut short (no lorad write leaves one; a disk might)
    elif damage == "flipped":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign":
        path.write_bytes(b"PK\x03\x04 some other file")
    log = RecLog()
    assert CompileCache(path, log).load() == "corrupt"
    [said] = log.named("compile_cache")
    assert said["status"] == "corrupt" and "compiling cold" in said["message"]


def test_the_cache_key_names_torch_the_device_the_model_and_the_shapes(micro_model, tmp_path):
    from engine.config.job import parse_job
    from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job_dict

    base = tiny_job_dict(micro_model, QUICKSTART_DATA)
    cpu = torch.device("cpu")
    key = compiling.cache_key(parse_job(base, tmp_path), cpu)
    assert key == compiling.cache_key(parse_job(deep_update(base, {"train": {"steps": 99}}), tmp_path), cpu)
    for other in ({"train": {"batch_size": 4}}, {"data": {"seq_len": 64}}, {"lora": {"rank": 8}},
                  {"model": {"dtype": "bfloat16"}}):
        assert compiling.cache_key(parse_job(deep_update(base, other), tmp_path), cpu) != key, other
    assert compiling.compile_cache_file(tmp_path / "home" / "jobs" / "a-1", key) == \
        (tmp_path / "home" / "cache" / "compile" / f"{key}.bin").resolve()


# ----------------------------------------------------------------------------------------------------- shapes
# Two buckets (wide and square) and captions from one word to a long sentence; caption dropout adds the empty one.
VARIED = [("wide-0.png", 48, 24, "sks"), ("wide-1.png", 50, 26, "a red square on grass under a pale blue sky at noon"),
          ("wide-2.png", 46, 22, "a cat"), ("square-0.png", 32, 32, "a yellow sun over the hills, with long shadows"),
          ("square-1.png", 30, 30, "a tower"), ("square-2.png", 34, 34, "two boats on a lake in the morning fog, "
                                                                          "seen from a wooden pier")]
# The block type compiles twice (the first block's input needs no gradient, the later ones' do: a guard), whatever
# the buckets and captions; two spare. Compiled with dynamic=False and unpadded text it was once per step (6 here).
MAX_COMPILES = 4


@pytest.fixture(scope="module")
def qwen_compile_run(tiny_image_model, tmp_path_factory):
    """A Qwen-Image job with train.compile on the CPU (dynamo with the eager backend): its events and the
    number of graphs dynamo compiled."""
    from engine.config.job import parse_job
    from engine.recipe import train
    from tests.helpers.jobs import read_events

    root = tmp_path_factory.mktemp("qwen-compile")
    job = {"name": "compile", "model": {"family": "qwen_image", "path": str(tiny_image_model("qwen_image")),
                                        "dtype": "float32"},
           "lora": {"rank": 4, "alpha": 8},
           "data": {"path": str(make_images(root / "data", VARIED)), "resolution": [32], "caption_dropout": 0.3},
           "train": {"steps": 6, "batch_size": 2, "lr": 0.002, "optimizer": "adamw", "seed": 3, "compile": True},
           "checkpoint": {"every_steps": 100, "every_seconds": None}}
    mp = pytest.MonkeyPatch()
    mp.setattr(compiling, "BACKEND", "eager")
    mp.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the trainer points it into its home: put back after
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    try:
        assert train(parse_job(job, root), root / "home" / "jobs" / "compile-1", progress="none") == 0
    finally:
        mp.undo()
    events = read_events(root / "home" / "jobs" / "compile-1")
    return events, counters["stats"]["unique_graphs"] - graphs


def test_a_qwen_image_job_with_varied_captions_and_two_buckets_stays_within_a_fixed_number_of_compiles(
        qwen_compile_run):
    events, graphs = qwen_compile_run
    [compiled] = [e for e in events if e["event"] == "compile"]
    assert compiled["blocks"] >= 2  # regional: every transformer block, one code object
    assert not [e for e in events if e["event"] == "compile_fallback"]
    recompiles = [e for e in events if e["event"] == "recompile"]
    assert 1 <= graphs <= MAX_COMPILES, (graphs, recompiles)
    assert len(recompiles) <= MAX_COMPILES - 1
    # the caches were looked up before the first step, and what was compiled was reported after it
    assert [e["status"] for e in events if e["event"] == "compile_cache"][:2] == ["cold", "cold"]
    assert [e for e in events if e["event"] == "compile_stats"][-1]["graphs"] >= 1


def test_qwen_image_text_padded_under_its_mask_predicts_the_same(tiny_image_model):
    """Why padding Qwen-Image's text while compiling is allowed: its attention masks the padded tokens out."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(tiny_image_model("qwen_image"), subfolder="transformer").eval()
    g = torch.Generator().manual_seed(0)
    c, d = model.config.in_channels, model.config.joint_attention_dim
    hidden, text = torch.randn(2, 12, c, generator=g), torch.randn(2, 9, d, generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0  # the second caption is shorter: already padded to the batch's longest

    def predict(text, mask):
        with torch.no_grad():
            return model(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                         timestep=torch.tensor([0.5, 0.5]), img_shapes=[[(1, 3, 4)]] * 2, return_dict=False)[0]

    padded = torch.cat([text, torch.randn(2, 64 - 9, d, generator=g)], dim=1)  # junk where the mask is 0
    padded_mask = torch.cat([mask, torch.zeros(2, 64 - 9, dtype=torch.long)], dim=1)
    torch.testing.assert_close(predict(padded, padded_mask), predict(text, mask), rtol=1e-5, atol=1e-6)


def inductor_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def committed_dir(tmp_path, monkeypatch) -> Path:
    from engine.frozen_base.compiling import InductorDir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    d = tmp_path / "KEY.d"
    assert InductorDir(d).adopt() == "cold"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(d)  # inductor writes into the home from now on
    (d / "fxgraph" / "ab").mkdir(parents=True)
    (d / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (d / "cpp" / "kernel.so").parent.mkdir(parents=True)
    (d / "cpp" / "kernel.so").write_bytes(b"\x7fELF" + b"k" * 1000)
    InductorDir(d).commit()
    return d


def test_inductors_cache_directory_in_the_home_is_committed_and_adopted_warm(tmp_path, monkeypatch):
    from engine.frozen_base.compiling import InductorDir

    d = committed_dir(tmp_path, monkeypatch)
    before = inductor_files(d)
    (d / "cpp" / "late.so").write_bytes(b"written after the commit by a process killed before the next")
    log = RecLog()
    assert InductorDir(d, log).adopt() == "warm"
    assert inductor_files(d) == before  # the uncommitted file is gone, every committed one intact
    assert log.named("compile_cache")[0]["status"] == "warm"


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing", "manifest"])
def test_a_torn_file_in_inductors_directory_makes_it_a_cold_compile(damage, tmp_path, monkeypatch):
    from engine.frozen_base.compiling import InductorDir

    d = committed_dir(tmp_path, monkeypatch)
    so = d / "cpp" / "kernel.so"
    if damage == "truncated":
        so.write_bytes(so.read_bytes()[:100])
    elif damage == "changed":
        so.write_bytes(b"\x7fELF" + b"x" * 1000)  # same size, other bytes
    elif damage == "missing":
        so.unlink()
    else:
        (d / "MANIFEST.json").write_text('{"files": ')  # torn
    log = RecLog()
    assert InductorDir(d, log).adopt() == "corrupt"
    assert inductor_files(d) == {}  # nothing of it is loaded: a cold compile
    assert "compiling cold" in log.named("compile_cache")[0]["message"]
