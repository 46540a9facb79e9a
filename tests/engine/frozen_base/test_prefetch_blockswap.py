"""Host→device streaming: the batch prefetcher and block swapping (engine/frozen_base/prefetch.py, engine/frozen_base/blockswap.py).

On the CPU the "device" copies are real copies into fresh CPU tensors, so
the swap logic (which block is where, when copies start, the two-block
window) runs and is checked here; the GPU tests check the overlap itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from engine.frozen_base.blockswap import BlockSwapper, find_blocks
from engine.frozen_base.prefetch import Prefetcher
from engine.frozen_base.speedups import compile_blocks
from tests.helpers.stacks import make_stack, run_steps


# ----------------------------------------------------------------- prefetcher
def test_prefetcher_on_cpu_is_a_lazy_passthrough():
    asked = []

    def make(cursor):
        asked.append(cursor)
        return {"input_ids": torch.full((2, 4), cursor), "n": cursor}

    pf = Prefetcher(make, torch.device("cpu"))
    assert not pf.enabled
    for c in (0, 2, 4, 10):  # a jump (resume) is served like any other cursor
        b = pf.get(c)
        pf.prefetch(c + 2)
        assert b["n"] == c and torch.equal(b["input_ids"], torch.full((2, 4), c))
    assert asked == [0, 2, 4, 10]  # built exactly when asked, never ahead: CPU runs are unchanged by it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetcher_on_gpu_serves_the_next_batch_from_the_side_stream():
    asked = []

    def make(c):
        asked.append(c)
        return {"x": torch.full((1024, 1024), float(c))}

    pf = Prefetcher(make, torch.device("cuda"))
    for c in range(5):
        b = pf.get(c)
        pf.prefetch(c + 1)  # after this step's work is queued
        pf.prefetch(c + 1)  # asking twice builds once
        assert b["x"].is_cuda and b["x"][0, 0].item() == c
    assert pf.misses == 1 and pf.hits == 4 and asked == [0, 1, 2, 3, 4, 5]
    b = pf.get(42)  # not what was prefetched: built synchronously, still right
    assert b["x"][0, 0].item() == 42 and pf.misses == 2


# ----------------------------------------------------------------- block swapping on a toy stack
@pytest.mark.parametrize("checkpointing", [False, True])
def test_swapping_changes_nothing_in_the_numbers(checkpointing):
    ref_losses, ref_params = run_steps(make_stack(checkpointing=checkpointing))
    model = make_stack(checkpointing=checkpointing)
    swapper = BlockSwapper(list(model.blocks), 4, torch.device("cpu"))
    losses, params = run_steps(model)
    assert losses == ref_losses
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)
    assert swapper.stats.loads > 0 and swapper.stats.max_resident <= 2


def test_two_swapped_blocks_at_most_are_resident_and_the_next_one_loads_while_this_one_computes():
    model = make_stack(n=6)
    swapper = BlockSwapper(list(model.blocks), 4, torch.device("cpu"), keep_trace=True)
    assert swapper.swapped == [2, 3, 4, 5]  # the last blocks: backward starts where forward ends
    seen = []
    for i, b in enumerate(model.blocks):
        # what is resident at the moment block i's own code runs
        b.register_forward_pre_hook(lambda m, a, i=i: seen.append(("fwd", i, swapper.resident())))
    model(torch.randn(2, 32)).backward()
    fwd = {i: r for what, i, r in seen if what == "fwd"}
    assert fwd[2] == [2, 3] and fwd[3] == [3, 4] and fwd[4] == [4, 5] and fwd[5] == [5]
    trace = swapper.stats.trace
    # forward: block i+1's copy is started right after waiting for block i
    assert trace.index(("load", 3)) == trace.index(("wait", 2)) + 1
    # backward walks down: block 4 is (re)loaded while block 5's backward runs, then 3, then 2
    back = trace[trace.index(("wait", 5), trace.index(("wait", 5)) + 1):]
    loads_back = [i for what, i in back if what == "load"]
    assert loads_back == [4, 3, 2]
    assert swapper.stats.max_resident == 2


class TwoOutputs(nn.Module):
    """Like Flux's blocks: (context, hidden) in and out. The last block's context output is never used."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora = nn.Linear(width, width, bias=False)

    def forward(self, ctx, x):
        return ctx + self.base(ctx), x + torch.tanh(self.base(x)) + self.lora(x)


def test_backward_prefetches_from_the_last_block_even_when_its_first_output_is_unused():
    torch.manual_seed(0)
    blocks = nn.ModuleList(TwoOutputs() for _ in range(6))
    swapper = BlockSwapper(list(blocks), 4, torch.device("cpu"), keep_trace=True)
    ctx, x = torch.randn(2, 32, requires_grad=True), torch.randn(2, 32)  # both outputs need gradients
    for b in blocks:
        ctx, x = b(ctx, x)
    swapper.stats.trace.clear()
    x.sum().backward()
    # the last block's gradient arrives through its second output: block 4 starts copying right away,
    # instead of being loaded on demand when its own gradient arrives
    assert swapper.stats.trace[:2] == [("wait", 5), ("load", 4)]


def saved_views_of(params: list[nn.Parameter]):
    """A saved-tensor hook that records every tensor autograd saves which aliases one of `params` without being it.

    Such a tensor (e.g. the `weight.t()` that a plain linear saves for its input gradient) keeps the
    device copy of a swapped block alive after eviction: the swap would free no memory until backward.
    """
    found: list[tuple[int, ...]] = []

    def pack(t):
        for p in params:
            if t is not p and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                found.append(tuple(t.shape))
        return t

    return found, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@pytest.mark.parametrize("fp8", [False, True])
def test_autograd_never_holds_a_swapped_weight_so_eviction_really_frees_it(fp8):
    from engine.frozen_base.precision import convert_linears_to_fp8

    model = make_stack(n=6)
    if fp8:
        convert_linears_to_fp8(model, skip="", only=r"\.base$", compute="scaled_mm")
    swapper = BlockSwapper(list(model.blocks), 4, torch.device("cpu"))
    found, hooks = saved_views_of([p for i in swapper.swapped for p in swapper._params[i]])
    with hooks:
        loss = model(torch.randn(8, 32))
    assert found == []
    loss.backward()  # and the gradients still flow: the input gradient reads the weight at backward time
    assert all(b.lora.weight.grad is not None for b in model.blocks)


def test_swapped_weights_live_on_the_host_between_uses_and_lora_never_moves():
    model = make_stack(n=4)
    lora_before = [b.lora.weight for b in model.blocks]
    swapper = BlockSwapper(list(model.blocks), 2, torch.device("cpu"))
    host_ptrs = {i: [h.data_ptr() for h in swapper._host[i]] for i in swapper.swapped}
    model(torch.randn(2, 32)).backward()
    for i in swapper.swapped:
        ptrs = [p.data_ptr() for p in swapper._params[i]]
        if i in swapper.resident():
            assert all(a != b for a, b in zip(ptrs, host_ptrs[i], strict=True))  # a separate "device" copy
        else:
            assert ptrs == host_ptrs[i]
    assert all(b.lora.weight is w and w.grad is not None for b, w in zip(model.blocks, lora_before, strict=True))
    assert all(p.requires_grad for i in swapper.swapped for p in model.blocks[i].lora.parameters())


def test_blocks_to_swap_is_bounded_by_the_number_of_blocks():
    with pytest.raises(ValueError, match="blocks_to_swap"):
        BlockSwapper(list(make_stack(n=3).blocks), 4, torch.device("cpu"))


def test_regional_compile_gives_the_same_numbers_with_swapping():
    ref_losses, _ = run_steps(make_stack(n=4))
    model = make_stack(n=4)
    BlockSwapper(list(model.blocks), 2, torch.device("cpu"))
    assert compile_blocks(list(model.blocks), backend="aot_eager") == 4
    losses, _ = run_steps(model)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


# ----------------------------------------------------------------- real models
def test_find_blocks_on_llama_and_flux_in_forward_order():
    from diffusers import FluxTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert find_blocks(llama) == list(llama.model.layers)
    flux = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                  guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    assert find_blocks(flux) == list(flux.transformer_blocks) + list(flux.single_transformer_blocks)


def tiny_lora_flux(device: torch.device, dtype: torch.dtype):
    """diffusers' real FluxTransformer2DModel (2 double-stream + 3 single-stream blocks, tiny dims) with LoRA."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from engine.families.image.flux import DEFAULT_TARGETS

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=DEFAULT_TARGETS, init_lora_weights=False))
    return model.to(device, dtype) if dtype != torch.float32 else model.to(device)


def flux_loss(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    dev, dt = model.device, model.dtype

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dt)

    out = model(hidden_states=rand(2, 16, 16), encoder_hidden_states=rand(2, 4, 32), pooled_projections=rand(2, 16),
                timestep=torch.rand(2, generator=g).to(dev, dt), img_ids=torch.zeros(16, 3, device=dev),
                txt_ids=torch.zeros(4, 3, device=dev), return_dict=False)[0]
    return out.float().pow(2).mean()


def watch_device_buffers(swapper: BlockSwapper) -> list[tuple[int, StorageWeakRef]]:
    """A weak reference to the storage of every device buffer the swapper loads (it sees when one is freed)."""
    loaded: list[tuple[int, StorageWeakRef]] = []
    load = swapper._load

    def recording_load(i):
        fresh = i not in swapper._resident
        load(i)
        if fresh and i in swapper._resident:
            loaded.append((i, StorageWeakRef(swapper._resident[i][1].untyped_storage())))

    swapper._load = recording_load
    return loaded


ON_GPU = pytest.param("cuda", torch.bfloat16, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize(("device", "dtype"), [("cpu", torch.float32), ON_GPU])
def test_real_flux_blocks_evicted_in_the_forward_are_freed_and_nothing_autograd_saved_aliases_them(device, dtype):
    # Flux's RMSNorm weights (norm_q, norm_k, norm_added_*) live in the block's flat buffer, and autograd
    # saves them for `x * weight` (CPU) or the fused RMSNorm's backward (CUDA): what it keeps must follow
    # the eviction, never pin the device copy until backward.
    device = torch.device(device)
    model = tiny_lora_flux(device, dtype)
    ref = flux_loss(tiny_lora_flux(device, dtype))
    swapper = BlockSwapper(find_blocks(model), 4, device)
    in_buffers = {id(p) for i in swapper.swapped for p in swapper._params[i]}
    norms = {n for n, p in model.named_parameters() if id(p) in in_buffers and ".norm_" in n}
    assert {n.split(".attn.")[1] for n in norms} == {"norm_q.weight", "norm_k.weight", "norm_added_q.weight",
                                                    "norm_added_k.weight"}
    loaded = watch_device_buffers(swapper)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = flux_loss(model)
    evicted = [(i, buf) for i, buf in loaded if i not in swapper.resident()]
    assert sorted(i for i, _ in evicted) == [1, 2, 3]  # block 4 (the last) stays for the backward
    aliasing = sorted({(i, tuple(t.shape)) for t in saved for i, buf in evicted
                       if not buf.expired() and StorageWeakRef(t.untyped_storage()).cdata == buf.cdata})
    assert aliasing == []
    assert [i for i, buf in evicted if not buf.expired()] == []  # and nothing else holds them either
    loss.backward()
    assert torch.allclose(loss.detach(), ref.detach(), rtol=0 if device.type == "cpu" else 1e-3)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n)


def test_fp8_llama_with_lora_trains_identically_with_and_without_swapping(micro_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.frozen_base.precision import apply_base_precision

    def build():
        m = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)
        apply_base_precision(m, "fp8", torch.device("cpu"), compute_dtype=torch.float32, fp8_compute="scaled_mm")
        torch.manual_seed(3)
        return get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                              autocast_adapter_dtype=False)

    # 2 x 16 tokens: CPU torch._scaled_mm (what fp8_compute scaled_mm runs here) costs in proportion to them
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))

    def train(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        out = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ref = train(build())
    model = build()
    swapper = BlockSwapper(find_blocks(model), 1, torch.device("cpu"))
    assert swapper.swapped == [1] and all(p.dtype == torch.float8_e4m3fn or p.ndim == 1 or not p.requires_grad
                                          for p in swapper._params[1])
    assert train(model) == ref
    assert swapper.stats.loads >= 3


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# The body runs on the CPU too: a test that could never pass on a GPU (a CPU batch of the wrong width) went
# unnoticed while it ran only there.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_swapped_blocks_free_their_memory_and_the_numbers_match(device):
    dev = torch.device(device)
    width = 1024 if dev.type == "cuda" else 128  # the memory checks below need 4 MiB blocks; the numbers do not
    ref = make_stack(n=8, width=width).to(dev)
    ref_losses, _ = run_steps(ref)
    model = make_stack(n=8, width=width).to(dev)
    before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    swapper = BlockSwapper(list(model.blocks), 6, dev)
    if dev.type == "cuda":
        assert torch.cuda.memory_allocated() < before - 4 * 1024 * 1024 * 4  # 6 base weights (4 MiB each) left
    losses, _ = run_steps(model)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert swapper.stats.max_resident <= 2


MiB = 1024 * 1024


def segment(nbytes: int) -> int:
    """The caching allocator's segment for one request of at least 10 MiB: its own, rounded up to 2 MiB.

    Requests between 1 and 10 MiB share 20 MiB segments (kLargeBuffer), which would hide how many blocks are
    resident (four 4 MiB blocks fit one), so the blocks below are 16 MiB."""
    assert nbytes > 10 * MiB
    return -(-nbytes // (2 * MiB)) * 2 * MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_evicted_blocks_give_their_memory_back_during_the_forward():
    dev, width = torch.device("cuda"), 2048
    model = make_stack(n=8, width=width).to(dev)
    swapper = BlockSwapper(list(model.blocks), 6, dev)
    # exactly sized and page-locked by cudaHostRegister, not rounded up by the pinned allocator
    assert all(flat.is_pinned() for flat in swapper._flat.values())
    seg = segment(swapper._flat[2].numel())  # one upload: weight and bias, 16 MiB + 8 KiB → an 18 MiB segment
    small = 2 * 2 * MiB  # activations and the like (64 KiB each) live in 2 MiB small-pool segments
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    loss = model(torch.randn(8, width, device=dev))
    torch.cuda.synchronize()
    # Reserved, at its peak: memory_allocated after a synchronise cannot see a CPU that ran ahead and took
    # fresh memory for further loads. Two swapped blocks at most: a third would be one more segment.
    assert torch.cuda.max_memory_reserved() - before <= 2 * seg + small
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    loss.backward()
    torch.cuda.synchronize()
    grads = 8 * segment(width * width * 4)  # each block's trainable linear gets a 16 MiB gradient
    assert torch.cuda.max_memory_reserved() - before <= 2 * seg + grads + small


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_swappers_one_after_another_release_their_registrations_with_their_models():
    import gc

    # Dropping a model unregisters its host buffers (after their last upload): the next swapper's buffers may
    # reuse the freed addresses, which a registration still alive would refuse (CUDA error 712).
    for _ in range(3):
        model = make_stack(n=6, width=1024).to("cuda")
        BlockSwapper(list(model.blocks), 4, torch.device("cuda"))
        run_steps(model, steps=1)
        del model
        gc.collect()
    torch.cuda.synchronize()


def test_a_job_with_blocks_to_swap_trains_the_same_adapter_through_the_recipe(micro_model, tmp_path):
    from engine.config.job import parse_job
    from engine.recipe import train
    from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, read_events, tiny_job_dict

    out = {}
    for n in (0, 1):
        d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                        {"train": {"steps": 6, "blocks_to_swap": n}, "checkpoint": {"every_steps": 3}})
        wd = tmp_path / f"swap{n}"
        assert train(parse_job(d, tmp_path), wd, progress="none") == 0
        out[n] = adapter_bytes(wd)
        swap_events = [e for e in read_events(wd) if e["event"] == "block_swap"]
        assert len(swap_events) == (1 if n else 0)
    assert out[0] == out[1]


def test_changing_blocks_to_swap_or_compile_keeps_checkpoints_valid(micro_model, tmp_path):
    # After an OOM a job may come back with more blocks swapped: same weights, so the same identity.
    from engine.config.job import parse_job
    from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job_dict

    base = tiny_job_dict(micro_model, QUICKSTART_DATA)
    h0 = parse_job(base, tmp_path).identity_hash()
    assert parse_job(deep_update(base, {"train": {"blocks_to_swap": 2, "compile": True}}), tmp_path).identity_hash() == h0
    assert parse_job(deep_update(base, {"model": {"base_precision": "fp8"}}), tmp_path).identity_hash() != h0
