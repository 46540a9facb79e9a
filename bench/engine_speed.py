"""Engine speed: the same LoRA training step under several engine configurations, in ONE process.

    .venv/bin/python bench/engine_speed.py --shape flux-dev --rank 16 --out bench/flux-r16.md   # on an H100
    .venv/bin/python bench/engine_speed.py --shape llama3-8b --rank 16
    .venv/bin/python bench/engine_speed.py --smoke                      # tiny shapes, CPU, < 60 s

Every configuration trains the same model shape from the same random
weights, LoRA initialisation, data and seed; only the engine differs. Each
row is then compared with the `baseline` row of the same run (the figures are
ratios measured side by side, never against numbers from elsewhere).

Configurations (see CONFIGS; `--configs a,b,c` picks some):

    baseline           peft LoRA, bf16 base, fp32 LoRA params (peft's default upcast), torch AdamW
                       — what a user writes by hand with the HF stack
    bf16-8bit          bf16 base, bf16 LoRA, bitsandbytes AdamW8bit
    fp8-8bit           FP8 base (engine/frozen_base/fp8.py: e4m3 + per-channel scales, _scaled_mm forward and
                       input gradient on sm_89+), bf16 LoRA, AdamW8bit
    *-swap             the same with block swapping (half the blocks streamed from pinned host memory)
    fp8-8bit-ckpt      activation checkpointing toggled against the shape's default
    fp8-8bit-compile   regional torch.compile of every block
    fp8-8bit-wT        FP8 with a persistent transposed weight copy for the input gradient
    fp8-8bit-dequant   FP8 storage, dequantising bf16 matmul (what FP8-as-storage trainers do)
    fp8-8bit-unfused   FP8 as before issue 39: peft's own LoRA layer over the FP8 base and the torch
                       quantisation (LORAD_FP8_KERNELS=torch), against fp8-8bit's fused function and kernels
    fp8-8bit-rows1     FP8 compute at every size: the size rule off (fp8.FP8_MIN_ROWS = 1), so the modulation
                       linears run _scaled_mm too; against fp8-8bit, this measures the rule
    bf16-8bit-eager    eager attention instead of SDPA (causal LM only)

Columns: s/step is the median of --steps timed steps after --warmup steps
(CUDA-synchronised); peak GiB is torch.cuda.max_memory_allocated over the
whole training (weights included); tokens/s = tokens per step / (s/step)
(Flux also pixels/s); loss@K is the training loss of step K (K = --loss-steps)
on a fixed cycle of batches. J/step is the GPU's energy over the timed steps divided by their number,
from NVML's total-energy counter (read only: nothing about the card is set), where NVML has one.

MFU = model FLOPs per step / (s/step) / peak dense bf16 FLOP/s of the GPU, with

    model FLOPs = forward 2·N·T + input-gradient 2·N·T + attention
    N·T         = Σ over every matmul layer (frozen base and LoRA A/B) of in·out·rows,
                  rows = tokens that pass through it (measured by hooks on the first step;
                  per-token layers see T rows, Flux's modulation layers see one row per sample)
    attention   = 3 × 4·T_q·T_k·d_model per attention layer (QKᵀ and PV forward, twice that for
                  their input gradients; × ½ for causal attention)

LoRA weight gradients (2·N_lora·T, well under 1% at rank ≤ 128) and activation
recomputation are not counted: MFU measures useful model work, so a config
that recomputes pays for it in MFU. The FP8 rows use the same bf16 peak, so
their MFU shows the speed-up directly (they can exceed what bf16 could reach).

Models are built on the 'meta' device and materialised module by module
directly on the GPU in their final dtype (FP8 layers are quantised as they are
materialised), so a 12B model never exists in fp32 or in host RAM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.frozen_base.blockswap import BlockSwapper, find_blocks  # noqa: E402
from engine.frozen_base.fp8 import FP8Linear  # noqa: E402
from engine.frozen_base.precision import DEFAULT_SKIP  # noqa: E402
from engine.frozen_base.prefetch import Prefetcher  # noqa: E402
from engine.frozen_base.speedups import avoid_cudnn_attention, compile_blocks  # noqa: E402

GiB = 1024**3

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets; --peak-tflops overrides.
PEAK_BF16 = {"H100 SXM": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 PCIe": 756.0e12, "H100 NVL": 835.0e12,
             "H200": 989.4e12, "GH200": 989.4e12, "A100": 312.0e12, "L40S": 362.1e12, "L4": 121.0e12,
             "RTX 4090": 165.2e12, "RTX 6000 Ada": 364.2e12, "B200": 2250e12}


# ----------------------------------------------------------------------------- shapes
@dataclass
class Shape:
    name: str
    kind: str  # "flux" or "llama"
    config: dict[str, Any]
    batch: int
    tokens: int  # tokens per sample (Flux: image + text)
    image_tokens: int = 0
    text_tokens: int = 0
    pixels: int = 0  # pixels per sample (Flux)
    checkpointing: bool = False  # the shape's default for activation checkpointing
    causal: bool = False


FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)

SHAPES = {
    # FLUX.1-dev's transformer (11.9B) at 1024x1024: a 128x128 latent packed 2x2 -> 4096 image tokens, 512 T5 tokens.
    # Activation checkpointing is on by default at this size (it is what fits with a bf16 base); -ckpt turns it off.
    "flux-dev": Shape("flux-dev", "flux", FLUX_DEV, batch=1, tokens=4096 + 512, image_tokens=4096, text_tokens=512,
                      pixels=1024 * 1024, checkpointing=True),
    "llama3-8b": Shape("llama3-8b", "llama", LLAMA3_8B, batch=1, tokens=2048, causal=True),
    # smoke shapes: every dimension a multiple of 16 so the FP8 _scaled_mm path runs (and is validated) on the CPU
    "flux-tiny": Shape("flux-tiny", "flux", dict(FLUX_DEV, in_channels=16, num_layers=1, num_single_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
                       batch=1, tokens=64 + 16, image_tokens=64, text_tokens=16, pixels=128 * 128),
    "llama-tiny": Shape("llama-tiny", "llama", dict(LLAMA3_8B, vocab_size=256, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                        batch=1, tokens=64, causal=True),
}


# ----------------------------------------------------------------------------- configurations
@dataclass
class Config:
    name: str
    base: str = "bf16"  # bf16 | fp8
    lora_fp32: bool = False  # peft's default upcast of the adapters
    optimizer: str = "adamw8bit"  # adamw | adamw8bit | paged_adamw8bit
    swap: bool = False
    ckpt_toggle: bool = False
    attn: str = "sdpa"
    compile: bool = False
    fp8_compute: str = "auto"
    transposed_copy: bool = False
    fused: bool = True  # fp8: lorad's one-function LoRA layer and fused quantisation (False: peft's and torch's)
    min_rows: int | None = None  # fp8: FP8_MIN_ROWS while the config runs (None: the engine's)


CONFIGS = {c.name: c for c in [
    Config("baseline", base="bf16", lora_fp32=True, optimizer="adamw"),
    Config("bf16-8bit"),
    Config("fp8-8bit", base="fp8"),
    Config("bf16-8bit-swap", swap=True),
    Config("fp8-8bit-swap", base="fp8", swap=True),
    Config("fp8-8bit-ckpt", base="fp8", ckpt_toggle=True),
    Config("fp8-8bit-compile", base="fp8", compile=True),
    Config("bf16-8bit-compile", compile=True),
    Config("fp8-8bit-wT", base="fp8", transposed_copy=True),
    Config("fp8-8bit-dequant", base="fp8", fp8_compute="dequant"),
    Config("bf16-8bit-eager", attn="eager"),
    Config("fp8-8bit-unfused", base="fp8", fused=False),
    Config("fp8-8bit-rows1", base="fp8", min_rows=1),
    # CPU smoke only: the CPU runs _scaled_mm, so the FP8 tensor-core code path can be exercised there
    Config("fp8-8bit-scaledmm", base="fp8", fp8_compute="scaled_mm"),
]}
DEFAULT_CONFIGS = ["baseline", "bf16-8bit", "fp8-8bit", "fp8-8bit-swap", "fp8-8bit-ckpt", "fp8-8bit-compile",
                   "fp8-8bit-wT", "fp8-8bit-dequant"]
SMOKE_CONFIGS = ["baseline", "bf16-8bit", "fp8-8bit", "fp8-8bit-scaledmm", "fp8-8bit-swap", "fp8-8bit-ckpt"]


# ----------------------------------------------------------------------------- building
def _seed_of(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF


@torch.no_grad()
def _init_direct(name: str, mod: nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic random init of a module's own parameters (same values whatever the config)."""
    g = torch.Generator(device=device).manual_seed(_seed_of(name, seed))
    for pname, p in mod.named_parameters(recurse=False):
        if isinstance(mod, nn.Linear) and pname == "weight":
            std = 1.0 / math.sqrt(mod.in_features)
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * std)
        elif pname == "bias":
            p.zero_()
        elif p.ndim == 1:  # norm scales
            p.fill_(1.0)
        else:  # embeddings and anything else
            p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02)


def materialise(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int, fp8: bool,
                fp8_compute: str, transposed_copy: bool) -> None:
    """Turn a meta-device model into a real one on `device`, one module at a time, FP8 layers quantised on the spot."""
    import re

    skip = re.compile(DEFAULT_SKIP)
    for name, mod in list(model.named_modules()):
        if not any(True for _ in mod.parameters(recurse=False)) and not any(True for _ in mod.buffers(recurse=False)):
            continue
        mod.to_empty(device=device, recurse=False)
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                setattr(mod, pname, nn.Parameter(p.to(dtype), requires_grad=p.requires_grad))
        _init_direct(name, mod, seed, device)
        if fp8 and type(mod) is nn.Linear and not skip.search(name):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, FP8Linear.from_linear(mod, compute_dtype=dtype, compute=fp8_compute,
                                                         transposed_copy=transposed_copy))
            mod.to("meta")  # free the bf16 original now (the module list above still references it)


def build_model(shape: Shape, cfg: Config, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    with torch.device("meta"):
        if shape.kind == "flux":
            from diffusers import FluxTransformer2DModel

            model = FluxTransformer2DModel(**shape.config)
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            lcfg = LlamaConfig(**shape.config)
            lcfg._attn_implementation = cfg.attn
            model = LlamaForCausalLM(lcfg)
    materialise(model, device, dtype, seed, cfg.base == "fp8", cfg.fp8_compute, cfg.transposed_copy)
    if shape.kind == "llama":
        # Rotary frequencies are computed buffers, not weights: rebuild them for real (meta left them empty).
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config).to(device)
        model.config.use_cache = False
    return model


def lora_targets(shape: Shape) -> list[str] | str:
    if shape.kind == "llama":
        return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # Attention and MLP projections of both Flux block types (the common "all linear" Flux LoRA).
    return (r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
            r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|proj_mlp|proj_out)")


def add_lora(model: nn.Module, shape: Shape, cfg: Config, rank: int, seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    torch.manual_seed(seed)  # same LoRA initialisation for every config
    lcfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=lora_targets(shape), init_lora_weights="gaussian")
    if cfg.fused:  # as the trainer's peft config does (engine/training/adapters.py)
        from engine.frozen_base.fp8_lora import lorad_custom_modules

        lcfg._register_custom_module(lorad_custom_modules())
    return get_peft_model(model, lcfg, autocast_adapter_dtype=cfg.lora_fp32)


# ----------------------------------------------------------------------------- data and loss
def make_batches(shape: Shape, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """A fixed cycle of host batches (same for every config)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    c = shape.config
    for _ in range(n):
        if shape.kind == "llama":
            ids = torch.randint(0, c["vocab_size"], (shape.batch, shape.tokens), generator=g)
            out.append({"input_ids": ids})
        else:
            b = shape.batch
            out.append({
                "latents": torch.randn(b, shape.image_tokens, c["in_channels"], generator=g),
                "noise": torch.randn(b, shape.image_tokens, c["in_channels"], generator=g),
                "t": torch.rand(b, generator=g),
                "text": torch.randn(b, shape.text_tokens, c["joint_attention_dim"], generator=g),
                "pooled": torch.randn(b, c["pooled_projection_dim"], generator=g),
            })
    return out


def flux_ids(shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    side = int(math.isqrt(shape.image_tokens))
    yy, xx = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img = torch.stack([torch.zeros_like(yy), yy, xx], dim=-1).reshape(-1, 3).float()
    txt = torch.zeros(shape.text_tokens, 3)
    return img.to(device), txt.to(device)


def loss_fn(model: nn.Module, shape: Shape, batch: dict[str, torch.Tensor], dtype: torch.dtype, ids) -> torch.Tensor:
    if shape.kind == "llama":
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    # Rectified-flow matching: x_t = (1 - t)·x0 + t·noise, predict the velocity noise - x0.
    x0, noise, t = batch["latents"], batch["noise"], batch["t"]
    tt = t.view(-1, 1, 1)
    xt = ((1 - tt) * x0 + tt * noise).to(dtype)
    pred = model(hidden_states=xt, encoder_hidden_states=batch["text"].to(dtype),
                 pooled_projections=batch["pooled"].to(dtype), timestep=t.to(dtype), img_ids=ids[0],
                 txt_ids=ids[1], guidance=torch.full_like(t, 3.5).to(dtype), return_dict=False)[0]
    return (pred.float() - (noise - x0)).square().mean()


# ----------------------------------------------------------------------------- FLOPs
class MatmulCounter:
    """Σ in·out·rows over every linear layer in one forward (hooks), i.e. N·T in the MFU formula."""

    def __init__(self, model: nn.Module):
        self.total = 0
        self.hooks = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, nn.Linear)]

    def _hook(self, mod, args, out):
        x = args[0]
        self.total += (x.numel() // mod.in_features) * mod.in_features * mod.out_features

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def attention_flops(shape: Shape) -> float:
    c = shape.config
    if shape.kind == "llama":
        layers, d, t = c["num_hidden_layers"], c["hidden_size"], shape.tokens
        fwd = 4 * t * t * d * layers * 0.5
    else:
        layers = c["num_layers"] + c["num_single_layers"]
        d, t = c["num_attention_heads"] * c["attention_head_dim"], shape.tokens
        fwd = 4 * t * t * d * layers
    return 3 * fwd * shape.batch


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_BF16.items():
        if key in name:
            return v
    return None


# ----------------------------------------------------------------------------- one configuration
@dataclass
class Row:
    shape: str
    config: Config
    rank: int
    s_per_step: float | None = None
    peak_gib: float | None = None
    weights_gib: float | None = None
    tokens_per_s: float | None = None
    pixels_per_s: float | None = None
    mfu: float | None = None
    loss: float | None = None
    swapped: int = 0
    checkpointing: bool = False
    joules_per_step: float | None = None
    note: str = ""
    losses: list[float] = field(default_factory=list)


class EnergyCounter:
    """NVML's total energy counter of the GPU torch computes on (millijoules since the driver loaded), read only.

    None where there is no NVML or the GPU has no counter (pre-Volta, some virtualised GPUs)."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                pci = f"{props.pci_domain_id:08x}:{bus:02x}:{props.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci)
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # no NVML, no such device, no counter: the column says "-"
            self.handle = None

    def millijoules(self) -> float | None:
        if self.handle is None:
            return None
        import pynvml

        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def one_step(model, shape: Shape, prefetcher, params, optimizer, dtype, ids, step: int) -> float:
    batch = prefetcher.get(step)
    loss = loss_fn(model, shape, batch, dtype, ids)
    loss.backward()
    prefetcher.prefetch(step + 1)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()  # also a sync point


def profile_steps(step_fn, first: int, device: torch.device, label: str, top: int) -> None:
    """Two more steps under torch.profiler; print the `top` ops by device time (CPU time on the CPU).

    Answers where a step's time goes (GEMM vs quantisation vs copies) without changing the timed steps,
    which ran before this."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for step in range(first, first + 2):
            step_fn(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"# profile of 2 steps: {label}\n" + prof.key_averages().table(sort_by=key, row_limit=top),
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def quantisation_kernels(cfg: Config):
    """An unfused config quantises with the torch reference (LORAD_FP8_KERNELS=torch) while it runs; a
    `min_rows` config sets the size rule's threshold (engine/frozen_base/fp8.py: fp8_compute_pays)."""
    import engine.frozen_base.fp8 as fp8

    saved, saved_rows = os.environ.get("LORAD_FP8_KERNELS"), fp8.FP8_MIN_ROWS
    if not cfg.fused:
        os.environ["LORAD_FP8_KERNELS"] = "torch"
    if cfg.min_rows is not None:
        fp8.FP8_MIN_ROWS = cfg.min_rows
    try:
        yield
    finally:
        fp8.FP8_MIN_ROWS = saved_rows
        if saved is None:
            os.environ.pop("LORAD_FP8_KERNELS", None)
        else:
            os.environ["LORAD_FP8_KERNELS"] = saved


def run_config(shape: Shape, cfg: Config, rank: int, device: torch.device, dtype: torch.dtype, args) -> Row:
    from engine.config.train import TrainConfig
    from engine.training.optim import build_optimizer

    row = Row(shape.name, cfg, rank)
    cleanup(device)
    model = build_model(shape, cfg, device, dtype, args.seed)
    ckpt = shape.checkpointing != cfg.ckpt_toggle
    row.checkpointing = ckpt
    if ckpt:
        if shape.kind == "flux":
            model.enable_gradient_checkpointing()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, shape, cfg, rank, args.seed)
    host = make_batches(shape, args.data_batches, args.seed)
    ids = flux_ids(shape, device) if shape.kind == "flux" else None
    # N·T for MFU from one no-grad forward, before swap hooks and compilation (counting hooks left inside a
    # compiled region would force a recompile when removed).
    counter = MatmulCounter(model)
    with torch.no_grad():
        loss_fn(model, shape, {k: v.to(device) for k, v in host[0].items()}, dtype, ids)
    counter.remove()
    blocks = find_blocks(model)
    swapper = None
    if cfg.swap:
        row.swapped = args.blocks_to_swap if args.blocks_to_swap is not None else len(blocks) // 2
        swapper = BlockSwapper(blocks, row.swapped, device)
    if cfg.compile:
        compile_blocks(blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, TrainConfig(optimizer=cfg.optimizer, lr=args.lr, weight_decay=0.0))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row.weights_gib = torch.cuda.memory_allocated(device) / GiB
        torch.cuda.reset_peak_memory_stats(device)

    prefetcher = Prefetcher(lambda i: host[i % len(host)], device)
    total_steps = max(args.warmup + args.steps, args.loss_steps)
    times: list[float] = []
    model.train()
    train_step = functools.partial(one_step, model, shape, prefetcher, params, optimizer, dtype, ids)
    energy, mj = EnergyCounter(device), []
    for step in range(total_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step == args.warmup:
            mj.append(energy.millijoules())
        t0 = time.perf_counter()
        loss_value = train_step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if step == args.warmup + args.steps - 1:
            mj.append(energy.millijoules())
        if args.warmup <= step < args.warmup + args.steps:
            times.append(dt)
        row.losses.append(loss_value)
    if args.profile:
        profile_steps(train_step, total_steps, device, f"{shape.name} r{rank} {cfg.name}", args.profile)
    nt = counter.total
    row.s_per_step = statistics.median(times)
    row.loss = row.losses[args.loss_steps - 1]
    tokens = shape.tokens * shape.batch
    row.tokens_per_s = tokens / row.s_per_step
    if shape.pixels:
        row.pixels_per_s = shape.pixels * shape.batch / row.s_per_step
    flops = 4 * nt + attention_flops(shape)
    peak = peak_flops(device, args.peak_tflops)
    if peak:
        row.mfu = flops / row.s_per_step / peak
    row.note = f"model FLOPs/step {flops:.3e}"
    if len(mj) == 2 and None not in mj:
        row.joules_per_step = (mj[1] - mj[0]) / 1000.0 / args.steps
    if device.type == "cuda":
        row.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
    # No swapper.remove(): the swapped blocks' registered host buffers are released with the model.
    del model, optimizer, params, prefetcher, swapper, blocks, train_step
    cleanup(device)
    return row


# ----------------------------------------------------------------------------- table
def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(rows: list[Row], device_name: str, header: str) -> str:
    lines = [header, "",
             "| shape | rank | config | base | LoRA | optimizer | swap | ckpt | attn | compile | s/step | × baseline speed "
             "| peak GiB | × baseline mem | tokens/s | pixels/s | MFU | loss@K | J/step | × baseline J |",
             "|---|---:|---|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r.shape, r.rank): r for r in rows if r.config.name == "baseline" and r.s_per_step}
    for r in rows:
        c = r.config
        b = base.get((r.shape, r.rank))
        if r.s_per_step is None:
            lines.append(f"| {r.shape} | {r.rank} | {c.name} | | | | | | | | {r.note} | | | | | | | | | |")
            continue
        speed = f"{b.s_per_step / r.s_per_step:.2f}×" if b else "-"
        mem = f"{r.peak_gib / b.peak_gib:.2f}×" if b and r.peak_gib and b.peak_gib else "-"
        joules = (f"{r.joules_per_step / b.joules_per_step:.2f}×"
                  if b and r.joules_per_step is not None and b.joules_per_step else "-")
        base_str = c.base if c.base == "bf16" else (
            f"fp8 ({c.fp8_compute}{', wT' if c.transposed_copy else ''}{'' if c.fused else ', unfused'}"
            f"{'' if c.min_rows is None else f', rows≥{c.min_rows}'})")
        lines.append(
            f"| {r.shape} | {r.rank} | {c.name} | {base_str} | {'fp32' if c.lora_fp32 else 'bf16'} | {c.optimizer} "
            f"| {r.swapped} | {'on' if r.checkpointing else 'off'} | {c.attn} | {'yes' if c.compile else 'no'} "
            f"| {r.s_per_step:.4f} | {speed} | {fmt(r.peak_gib, '.2f')} | {mem} | {fmt(r.tokens_per_s, ',.0f')} "
            f"| {fmt(r.pixels_per_s, ',.0f')} | {fmt(r.mfu, '.1%')} | {fmt(r.loss, '.4f')} "
            f"| {fmt(r.joules_per_step, '.1f')} | {joules} |")
    lines += ["", f"Device: {device_name}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default flux-dev")
    ap.add_argument("--rank", action="append", type=int, help="LoRA rank, repeatable; default 16 (flux-dev: 16 and 128)")
    ap.add_argument("--configs", help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    ap.add_argument("--loss-steps", type=int, default=0, help="K for loss@K (default: warmup + steps)")
    ap.add_argument("--data-batches", type=int, default=4, help="size of the fixed batch cycle")
    ap.add_argument("--blocks-to-swap", type=int, help="for the -swap configs (default: half the blocks)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU, for MFU")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, profile two more and print the top N ops by device time")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few steps; runs on the CPU")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    avoid_cudnn_attention(device)  # as the trainer does: cuDNN's attention backward failed on an H200
    if args.smoke:
        shapes = args.shape or ["flux-tiny", "llama-tiny"]
        ranks = args.rank or [16]
        configs = (args.configs.split(",") if args.configs else SMOKE_CONFIGS)
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    else:
        shapes = args.shape or ["flux-dev"]
        ranks = args.rank or ([16, 128] if shapes == ["flux-dev"] else [16])
        configs = args.configs.split(",") if args.configs else DEFAULT_CONFIGS
        if device.type != "cuda":
            print("engine_speed: no CUDA GPU here; full shapes need one (use --smoke on the CPU)", file=sys.stderr)
            return 2
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    args.loss_steps = args.loss_steps or (args.warmup + args.steps)
    dtype = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    rows: list[Row] = []
    t_all = time.monotonic()
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for rank in ranks:
            for name in configs:
                cfg = CONFIGS[name]
                t_cfg = time.monotonic()
                if cfg.attn == "eager" and shape.kind != "llama":
                    continue
                try:
                    with quantisation_kernels(cfg):
                        row = run_config(shape, cfg, rank, device, dtype, args)
                except torch.OutOfMemoryError:
                    row = Row(shape.name, cfg, rank, note="OOM")
                    cleanup(device)
                rows.append(row)
                print(f"# {shape.name} r{rank} {name} ({time.monotonic() - t_cfg:.1f} s): s/step={fmt(row.s_per_step, '.4f')} "
                      f"peak={fmt(row.peak_gib, '.2f')}GiB loss@{args.loss_steps}={fmt(row.loss, '.4f')} {row.note}",
                      file=sys.stderr, flush=True)
    kind = "SMOKE RUN (tiny shapes, not a performance measurement)" if args.smoke else "Measured"
    header = (f"**{kind}** — `bench/engine_speed.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
              f"warm-up {args.warmup}, median of {args.steps} steps, loss@K with K={args.loss_steps}, "
              f"torch {torch.__version__}, {time.monotonic() - t_all:.0f} s in total.")
    out = table(rows, device_name, header)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
