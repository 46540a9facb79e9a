"""Where a model with `train.blocks_to_swap: N` lives right after loading (engine/blockswap.place_model).

The promise: the frozen weights of the N swapped blocks go from the loaded
(host) model straight to host memory and never sit on the GPU whole, so the
load peak is the resident part only (a 24 GB bf16 Flux with most blocks
swapped loads on a 24 GB card). Everything else — other blocks, embeddings,
norms, every LoRA weight (also those inside swapped blocks), FP8 scales — is
on the device.

On the CPU, 'meta' stands in for the GPU: it is a real second device, so a
tensor on the wrong side shows up as the wrong device type.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.config.job import parse_job
from engine.errors import JobInvalid
from engine.frozen_base import fp8
from engine.frozen_base.blockswap import find_blocks, place_model, swapped_blocks
from engine.frozen_base.fp8 import FP8Linear
from engine.frozen_base.precision import convert_linears_to_fp8, swapped_linear_weights
from tests.helpers import images as fh
from tests.helpers.fakes import RecLog
from tests.helpers.images import tiny_flux  # noqa: F401  (fixture)
from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job, tiny_job_dict

META = torch.device("meta")


class Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.lora = nn.Linear(width, width, bias=False)
        self.base.requires_grad_(False)
        self.norm.requires_grad_(False)


class Stack(nn.Module):
    def __init__(self, n: int = 6):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(32, 10)
        self.register_buffer("table", torch.arange(4.0))
        self.embed.requires_grad_(False)


def where(model: nn.Module) -> dict[str, str]:
    return {n: t.device.type for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_only_the_swapped_blocks_frozen_weights_stay_on_the_host():
    model = Stack(6)
    kept = place_model(model, META, blocks_to_swap=2)
    dev = where(model)
    on_host = sorted(n for n, d in dev.items() if d == "cpu")
    assert on_host == [f"blocks.{i}.{p}" for i in (4, 5) for p in ("base.bias", "base.weight", "norm.bias", "norm.weight")]
    assert {d for n, d in dev.items() if n not in on_host} == {"meta"}  # LoRA of swapped blocks included
    assert kept == 2 * (32 * 32 + 32 + 32 + 32) * 4


def test_without_swapping_placement_is_a_plain_move_and_more_than_all_blocks_swaps_all():
    model = Stack(3)
    assert place_model(model, META, 0) == 0
    assert set(where(model).values()) == {"meta"}
    model = Stack(3)
    assert len(swapped_blocks(model, 99)) == 3
    place_model(model, META, 99)
    assert {n.split(".")[1] for n, d in where(model).items() if d == "cpu"} == {"0", "1", "2"}


def test_a_model_without_repeated_blocks_is_an_invalid_job_not_a_crash():
    with pytest.raises(JobInvalid, match="train.blocks_to_swap"):
        place_model(nn.Sequential(nn.Linear(4, 4)), META, 1)


def test_fp8_layers_of_swapped_blocks_go_back_to_the_host_as_soon_as_they_are_quantised():
    # Roles reversed to tell the two sides apart: the CPU is the "device", meta the "host".
    model = Stack(4)
    keep = swapped_linear_weights(model, 1)
    report = convert_linears_to_fp8(model, skip=r"^head$", device=torch.device("cpu"), keep_on_host=keep, host=META,
                                    compute="scaled_mm")
    assert report.converted == 8  # base and lora of 4 blocks (the head is skipped)
    last = model.blocks[3]
    assert isinstance(last.base, FP8Linear) and last.base.weight.device.type == "meta"
    assert last.base.bias.device.type == "meta" and last.base.weight_scale.device.type == "cpu"
    assert last.base.compute == "scaled_mm"
    assert {b.base.weight.device.type for b in model.blocks[:3]} == {"cpu"}


def test_an_fp8_layer_computes_where_its_scales_are_even_while_its_weight_is_parked(monkeypatch):
    # Pretend the CPU has FP8 tensor cores (and meta does not): "auto" then depends on which device counts.
    monkeypatch.setattr(fp8, "fp8_tensor_cores", lambda d: torch.device(d).type == "cpu")
    layer = FP8Linear.from_linear(nn.Linear(32, 32))
    assert layer.compute == "scaled_mm"
    weight = layer.weight
    layer._apply(lambda t: t.to(META) if t is weight else t, recurse=False)  # park only the weight
    assert layer.weight.device.type == "meta" and layer.weight_scale.device.type == "cpu"
    assert layer.compute == "scaled_mm"
    layer._apply(lambda t: t.to(META), recurse=False)  # the scales moved too: now it is a meta layer
    assert layer.compute == "dequant"


def test_causal_lm_bf16_load_keeps_the_swapped_layer_on_the_host_and_its_lora_on_the_device(micro_model, tmp_path):
    from engine.families.causal_lm import CausalLM

    cfg = tiny_job(micro_model, tmp_path, model={"base_precision": "bf16", "dtype": "bfloat16"},
                   train={"blocks_to_swap": 1})
    model = CausalLM().load_model(cfg, tmp_path, META, RecLog())
    last = find_blocks(model)[-1]
    host = {id(p) for p in last.parameters() if not p.requires_grad}
    assert host
    for n, p in model.named_parameters():
        assert p.device.type == ("cpu" if id(p) in host else "meta"), n
    lora = [n for n, p in last.named_parameters() if p.requires_grad]
    assert lora and all(p.device.type == "meta" for p in last.parameters() if p.requires_grad)


def test_flux_bf16_load_keeps_the_swapped_blocks_on_the_host(tiny_flux, tmp_path):  # noqa: F811
    import shutil

    from diffusers import FluxTransformer2DModel

    from engine.families.image.flux import Flux

    # The built-in tiny Flux has one block of each kind (nothing to swap); give it two of each.
    model_dir = tmp_path / "flux-2x2"
    shutil.copytree(tiny_flux, model_dir)
    config = dict(FluxTransformer2DModel.load_config(model_dir / "transformer"), num_layers=2, num_single_layers=2)
    shutil.rmtree(model_dir / "transformer")
    FluxTransformer2DModel.from_config(config).save_pretrained(model_dir / "transformer")
    data = fh.make_images(tmp_path / "img")
    cfg = parse_job(fh.flux_job_dict(model_dir, data, model={"base_precision": "bf16"}, train={"blocks_to_swap": 2}),
                    tmp_path)
    model = Flux().load_model(cfg, tmp_path, META, RecLog())
    blocks = find_blocks(model)
    host = {id(p) for b in blocks[-2:] for p in b.parameters() if not p.requires_grad}
    assert host
    for n, p in model.named_parameters():
        assert p.device.type == ("cpu" if id(p) in host else "meta"), n


@pytest.mark.parametrize("precision", [{"base_precision": "nf4"}, {"base_precision": "int8"}, {"quantize": "nf4"}])
def test_bitsandbytes_bases_cannot_be_swapped_and_the_job_says_so(micro_model, tmp_path, precision):
    d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"model": precision, "train": {"blocks_to_swap": 1}})
    with pytest.raises(JobInvalid, match=r"train\.blocks_to_swap.*base_precision: fp8"):
        parse_job(d, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_on_gpu_the_load_peak_excludes_the_swapped_blocks(micro_model, tmp_path, precision):
    from engine.families.causal_lm import CausalLM
    from engine.frozen_base.fp8 import WEIGHT_CHUNK

    dev = torch.device("cuda")
    cfg = tiny_job(micro_model, tmp_path, model={"base_precision": precision, "dtype": "bfloat16"},
                   train={"blocks_to_swap": 2})
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    start = torch.cuda.memory_allocated(dev)
    model = CausalLM().load_model(cfg, tmp_path, dev, RecLog())
    blocks = find_blocks(model)
    swapped = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters() if not p.requires_grad)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    assert all(not p.is_cuda for b in blocks for p in b.parameters() if not p.requires_grad)
    largest = max(m.weight.numel() for b in blocks for m in b.modules() if hasattr(m, "weight"))
    one_layer = largest * 2  # bytes in bf16
    # Quantising a layer on the device holds ~12 bytes per parameter of one slice (fp8.quantize_weight_rows):
    # said here, not hidden in the slack, which is only the allocator's rounding of small tensors.
    quantising = min(largest, WEIGHT_CHUNK) * 12 if precision == "fp8" else 0
    assert torch.cuda.max_memory_allocated(dev) - start <= resident + one_layer * 2 + quantising + (1 << 20)
    assert swapped > one_layer * 2  # the bound above really excludes the swapped blocks
