"""torch.compile for training: on by default on CUDA, once per block, never a crash, and never twice.

    train.compile: auto     on on CUDA (not with sharding: fsdp), off on the CPU (the default); true / false force it

Regional: each transformer block's forward is compiled (engine/frozen_base/speedups.py), so one block type
compiles once for every block of that type. What this module adds around torch.compile:

- **Once.** A block already compiled is left as it is; compiling it again would stack a second dynamo frame
  on the first.
- **Never a crash.** A compile error (dynamo, the backend, inductor; the backward's too, lowered with the forward)
  turns that block type back to eager for the rest of the attempt, with one `compile_fallback` event. So does dynamo's recompile limit
  (torch._dynamo.config.recompile_limit, 8 per code object): past it dynamo would run the block eagerly without
  a word; here the limit raises inside the call (fail_on_recompile_limit_hit), and the block type goes eager
  with the event, which the daemon keeps for `lorad status JOB` ("compile: eager ...").
- **Few shapes.** Every dimension of a tensor argument but its last (the features) is marked dynamic before
  the call (torch._dynamo.maybe_mark_dynamic: batch, tokens, frames; a dimension the code needs fixed is
  specialised without an error), so the first compile already serves the other aspect buckets and caption
  lengths, and so does the compile cache: a resume whose first batch is another bucket than the run it
  resumes is still warm. Anything left to change compiles once more with automatic dynamic shapes
  (dynamic=None), not once per shape. Families whose text is padded under a mask (Qwen-Image) also pad it
  to a multiple of TEXT_MULTIPLE while compiling, so caption lengths fall on a few sizes
  (engine/families/image/dataset.py); the mask keeps padded tokens out of every real token's attention.
  Every compile after the first of a block type is a `recompile` event with the running count.
- **Never twice.** The artifacts of the compiles (inductor's FX graphs, AOTAutograd's, Triton's kernels, the
  dynamic-shape profile) are saved with torch.compiler.save_cache_artifacts into HOME/cache/compile/KEY.bin
  after a step that compiled something, written like every file lorad commits (temp name, fsync, rename),
  and loaded before the first step. KEY hashes torch's and Triton's versions, the device (GPU name and
  capability, or the CPU), the model section, the LoRA section and the shapes (batch size, resolution or
  sequence length, swapping, checkpointing): a resume after an outage and the next job on the same model start warm. A
  file that is torn, of another format, or that torch refuses is a cold compile (a `compile_cache` event
  says which), never a crash. Inductor's own cache directory (the C++ kernels it builds on the CPU are not in
  the artifacts) is kept beside the file and committed with a manifest (InductorDir). Both count toward
  HOME/cache's size limit (engine/storage/cache_evict.py): the attempt leases its key, a warm start touches
  them, and least-recently-used keys no one leases are evicted with the latent entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from engine.frozen_base.inductor_dir import InductorDir
from engine.storage import cache_evict
from engine.storage.cache import STALE_S
from engine.storage.fsio import FileLayer, RealFs, ensure_dir_durable, write_file_durable
from engine.storage.home import cache_dir

BACKEND = "inductor"  # tests set "eager": dynamo's tracing and guards, without inductor's code generation
TEXT_MULTIPLE = 64  # tokens: masked text is padded to a multiple of this while compiling
MAGIC = b"lorad-compile-cache-1\n"
REASON_CHARS = 300


def compile_wanted(train, device: torch.device) -> bool:
    """train.compile: auto → on CUDA only (compiling on the CPU costs more than it saves on short jobs), and not
    with train.sharding: fsdp, whose compiled path has not run on a GPU here yet (`true` still asks for it)."""
    if train.compile == "auto":
        return torch.device(device).type == "cuda" and getattr(train, "sharding", "ddp") != "fsdp"
    return bool(train.compile)


def _compile_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)  # BackendCompilerFailed and inductor's InductorError are among them


def why_not_compiled(e: BaseException) -> str:
    """A compile error in one line: a backend's failure by its own error (dynamo's first line only says which
    backend raised)."""
    def line(x: BaseException) -> str:
        first = str(x).strip().splitlines()[0] if str(x).strip() else ""
        return f"{type(x).__name__}: {first}" if first else type(x).__name__

    inner = getattr(e, "inner_exception", None)
    return f"{type(e).__name__} ({line(inner)})" if isinstance(inner, BaseException) else line(e)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileState:
    """What the compiled forwards of one model report: compiles per block type, and the types gone eager."""

    def __init__(self, log=None):
        self.log = log
        self.compiles: dict[str, int] = {}
        self.eager: dict[str, str] = {}  # block type → why it runs eagerly now
        self.graphs_at_save = 0

    def compiled(self, name: str, n: int) -> None:
        before = self.compiles.get(name, 0)
        self.compiles[name] = before + n
        if before and self.log is not None:  # the first compile is expected; each one after it is a recompile
            self.log.info("recompile", block=name, compiles=self.compiles[name])

    def fall_back(self, name: str, reason: str) -> None:
        if name in self.eager:
            return
        self.eager[name] = reason[:REASON_CHARS]
        if self.log is not None:
            self.log.warning("compile_fallback", block=name, reason=self.eager[name],
                             message=f"{name} runs eagerly from now on: {self.eager[name]}")

    def total(self) -> int:
        return sum(self.compiles.values())


class CompiledForward:
    """A module's forward, compiled; eager again for its block type after a compile error or the recompile limit."""

    def __init__(self, eager, name: str, state: CompileState, backend: str = BACKEND):
        self.eager, self.name, self.state = eager, name, state
        self.compiled = torch.compile(eager, backend=backend, dynamic=None)

    def __call__(self, *args, **kwargs):
        if self.name in self.state.eager:
            return self.eager(*args, **kwargs)
        from torch._dynamo.exc import FailOnRecompileLimitHit

        before = _graphs()
        _mark_dynamic((args, kwargs))
        try:
            # Raise at the limit instead of dynamo's silent eager run, so the fallback is said. And lower the
            # backward with the forward: AOTAutograd otherwise compiles it at the first backward, where an error
            # would escape this call and crash the step.
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                    torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                out = self.compiled(*args, **kwargs)
        except FailOnRecompileLimitHit:
            self.state.fall_back(self.name, f"dynamo's recompile limit "
                                            f"({torch._dynamo.config.recompile_limit} per code object)")
            return self.eager(*args, **kwargs)
        except _compile_errors() as e:
            self.state.fall_back(self.name, f"compile error: {why_not_compiled(e)}")
            return self.eager(*args, **kwargs)
        if (n := _graphs() - before) > 0:
            self.state.compiled(self.name, n)
        return out


def _mark_dynamic(obj) -> None:
    """Every dimension but the last of every tensor in `obj` (nested tuples, lists, dicts) may be dynamic."""
    if isinstance(obj, torch.Tensor):
        if obj.ndim > 1:
            torch._dynamo.maybe_mark_dynamic(obj, list(range(obj.ndim - 1)))
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _mark_dynamic(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            _mark_dynamic(o)


def compile_forward(module: torch.nn.Module, state: CompileState, backend: str = BACKEND) -> bool:
    """Compile `module`'s forward in place, once; False when it already was."""
    if isinstance(module.__dict__.get("forward"), CompiledForward):
        return False
    module.forward = CompiledForward(module.forward, type(module).__name__, state, backend)
    return True


# ----------------------------------------------------------------------------------------------------- the cache
def device_key(device: torch.device) -> dict[str, Any]:
    device = torch.device(device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return {"gpu": torch.cuda.get_device_name(idx), "capability": list(torch.cuda.get_device_capability(idx))}
    return {"cpu": platform.machine(), "isa": str(torch.backends.cpu.get_cpu_capability())}


def triton_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


def cache_key(cfg, device: torch.device) -> str:
    """A hash of what the compiled code depends on (see the module docstring)."""
    train = cfg.train
    parts = {
        "torch": torch.__version__, "triton": triton_version(), "device": device_key(device),
        "model": cfg.model.model_dump(mode="json"), "lora": cfg.lora.model_dump(mode="json"),
        "shape": {"batch_size": train.batch_size, "resolution": getattr(cfg.data, "resolution", None),
                  "seq_len": getattr(cfg.data, "seq_len", None),
                  "blocks_to_swap": train.blocks_to_swap, "gradient_checkpointing": train.gradient_checkpointing},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def compile_cache_file(workdir: Path, key: str) -> Path:
    """HOME/cache/compile/KEY.bin, beside the home's shared latent cache (WORKDIR/cache/compile outside a home)."""
    return cache_dir(workdir) / "compile" / f"{key}.bin"


class CompileCache:
    """One cache file: MAGIC, the sha256 of the payload (hex, one line), the payload (save_cache_artifacts')."""

    def __init__(self, path: Path, log=None, fs: FileLayer | None = None):
        self.path, self.log, self.fs = Path(path), log, fs or RealFs()

    def load(self) -> str:
        """Put the file's artifacts in torch's caches: "warm", "cold" (no file) or "corrupt" (a cold compile)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return self._said("cold")
        except OSError as e:
            return self._said("corrupt", f"unreadable: {e.strerror or e}")
        payload = _payload(data)
        if payload is None:
            return self._said("corrupt", "torn or not a lorad compile cache (checksum)")
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        except Exception as e:  # noqa: BLE001 - whatever torch makes of a stale file, it is a cold compile
            return self._said("corrupt", f"refused by torch: {type(e).__name__}")
        if info is None:
            return self._said("corrupt", "refused by torch")
        cache_evict.touch(self.path)  # used now: the last to be evicted
        return self._said("warm", bytes=len(data))

    def save(self) -> bool:
        """Write the artifacts of every compile so far; False when there is nothing new to write."""
        from torch.compiler._cache import CacheArtifactManager

        if not CacheArtifactManager.need_serialize():
            return False
        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return False
        payload = out[0]
        ensure_dir_durable(self.fs, self.path.parent)
        write_file_durable(self.fs, self.path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        if self.log is not None:
            self.log.info("compile_cache", status="saved", file=str(self.path), bytes=len(payload))
        return True

    def _said(self, status: str, why: str | None = None, **kw) -> str:
        if self.log is not None:
            fields = {"status": status, "file": str(self.path), **kw}
            if why is not None:
                self.log.warning("compile_cache", **fields, reason=why,
                                 message=f"compile cache {self.path.name} not used ({why}): compiling cold")
            else:
                self.log.info("compile_cache", **fields)
        return status


def cache_counts() -> dict[str, int]:
    """Graphs compiled so far in this process, and how inductor's and AOTAutograd's caches served them."""
    from torch._dynamo.utils import counters

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"graphs": _graphs(), **{f"fxgraph_{k}": int(ind[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")},
            **{f"aot_{k}": int(aot[f"autograd_cache_{k}"]) for k in ("hit", "miss", "bypass")}}


def _payload(data: bytes) -> bytes | None:
    if not data.startswith(MAGIC):
        return None
    head, sep, payload = data[len(MAGIC):].partition(b"\n")
    if not sep or hashlib.sha256(payload).hexdigest().encode() != head:
        return None
    return payload


class Compiler:
    """One attempt's compile: the state its forwards report to, and the caches it starts from and saves to."""

    def __init__(self, state: CompileState, cache: CompileCache | None, inductor_dir: InductorDir | None = None,
                 lease: cache_evict.Lease | None = None):
        self.state, self.cache, self.inductor_dir = state, cache, inductor_dir
        self.lease = lease  # the compile key, kept from eviction while this attempt's model (its hook) lives

    def after_step(self) -> None:
        """After a step that compiled something (called before each forward: cheap when nothing was compiled): say
        what the caches served (`compile_stats`), and save the cache (where this process saves: rank 0)."""
        if _graphs() == self.state.graphs_at_save:
            return
        self.state.graphs_at_save = _graphs()
        if self.state.log is not None:
            self.state.log.info("compile_stats", **cache_counts())
        if self.cache is None:
            return
        try:
            self.cache.save()
            if self.inductor_dir is not None:
                self.inductor_dir.commit()
        except OSError as e:  # a full disk costs the next start a cold compile, not this job
            if self.state.log is not None:
                self.state.log.warning("compile_cache", status="unsaved", reason=e.strerror or str(e),
                                       message=f"compile cache not saved ({e.strerror or e}); the next start "
                                               f"compiles cold")


def start_compiling(model: torch.nn.Module, family, cfg, workdir: Path, device: torch.device, log=None) -> Compiler:
    """An attempt whose memory plan compiles: its caches loaded before the first step, text padded to a few lengths
    where the family allows it, and what a step compiled saved before the next forward (rank 0 saves)."""
    compiler = start_compiler(cfg, workdir, device, log, saves=int(os.environ.get("RANK", "0")) == 0)
    if hasattr(family, "bound_shapes"):
        family.bound_shapes(TEXT_MULTIPLE)
    model.register_forward_pre_hook(lambda module, args: compiler.after_step())
    return compiler


def start_compiler(cfg, workdir: Path, device: torch.device, log=None, saves: bool = True) -> Compiler:
    """For an attempt that compiles (its memory plan says so): a Compiler whose caches are loaded (saved by `saves`
    only). The compiled forwards report to their own CompileState (apply_train_speedups'); this one's log says
    what the caches served."""
    state = CompileState(log)
    key = cache_key(cfg, device)
    path = compile_cache_file(workdir, key)
    lease = _lease(cache_dir(workdir), key, log if saves else None)
    inductor_dir = InductorDir(path.with_suffix(".d"), log)
    inductor_dir.adopt()  # before the artifacts: loading them writes into inductor's cache directory
    cache = CompileCache(path, log)
    cache.load()
    return Compiler(state, cache if saves else None, inductor_dir, lease)


def _lease(root: Path, key: str, log) -> cache_evict.Lease | None:
    """Lease the compile key before its caches are looked at (an evicter sees the lease, or has finished), then
    keep HOME/cache under the daemon's limit (with `log`: the rank that saves) as a latent fill does."""
    try:
        lease = cache_evict.Lease(root, [key])
    except OSError:  # a home cache this process cannot write: it saves nothing there either
        return None
    if log is not None:
        for name in cache_evict.remove_stale(root / cache_evict.COMPILE, _temp_file, STALE_S, time.time()):
            log.info("cache_swept", file=f"{cache_evict.COMPILE}/{name}")
        if (max_bytes := cache_evict.limit()) is not None:
            cache_evict.evict(root, max_bytes, log)
    return lease


def _temp_file(name: str) -> bool:
    """A killed writer's temp file (.KEY.bin.tmp-PID-..., write_file_durable's): never loaded, it only takes disk."""
    return name.startswith(".") and ".tmp-" in name
