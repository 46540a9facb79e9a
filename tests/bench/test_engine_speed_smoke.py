"""bench/engine_speed.py: its tiny CPU smoke mode runs, prints the table and writes it as markdown,
and its FLOP accounting (the MFU numerator) counts what the docstring says it counts."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn as nn

from tests.helpers.processes import REPO

sys.path.insert(0, str(REPO / "bench"))

import engine_speed as es  # noqa: E402

CONFIGS = ["baseline", "fp8-8bit", "fp8-8bit-scaledmm", "fp8-8bit-swap"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "table.md"
    rc = es.main(["--smoke", "--configs", ",".join(CONFIGS), "--out", str(out)])
    return rc, out.read_text()


def _rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in md.splitlines()
            if ln.startswith("| ") and not ln.startswith("| shape")]


def test_smoke_run_writes_one_labelled_row_per_shape_and_config(smoke):
    rc, md = smoke
    assert rc == 0
    assert "SMOKE RUN" in md and "not a performance measurement" in md
    rows = _rows(md)
    assert [(r[0], r[2]) for r in rows] == [(s, c) for s in ("flux-tiny", "llama-tiny") for c in CONFIGS]
    for r in rows:
        s_per_step, loss = float(r[10]), float(r[17])
        assert s_per_step > 0 and math.isfinite(loss)
    assert all(r[11] == "1.00×" for r in rows if r[2] == "baseline")


def test_smoke_losses_agree_across_configs_on_the_same_data_and_seed(smoke):
    _, md = smoke
    for shape in ("flux-tiny", "llama-tiny"):
        losses = {r[2]: float(r[17]) for r in _rows(md) if r[0] == shape}
        base = losses["baseline"]
        # bf16 vs fp32 adapters and FP8 vs bf16 base after 3 steps: within 2% of the baseline
        assert all(abs(v - base) / base < 0.02 for v in losses.values()), losses
        # swapping moves weights, it must not change a single number
        assert losses["fp8-8bit-swap"] == losses["fp8-8bit"]


def test_full_shapes_refuse_to_run_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert es.main(["--shape", "flux-dev"]) == 2
    assert "--smoke" in capsys.readouterr().err


def _flux_rows(name: str, shape) -> int:
    """How many rows (tokens) each Flux linear layer multiplies, read off the architecture."""
    b, img, txt = shape.batch, shape.image_tokens, shape.text_tokens
    if name.startswith("time_text_embed") or name.endswith((".norm1.linear", ".norm1_context.linear", ".norm.linear")) \
            or name == "norm_out.linear":
        return b  # embedders of the pooled vector and adaLN modulation: once per sample
    if name.startswith("single_transformer_blocks."):
        return b * (img + txt)  # the joint sequence
    if name.startswith("context_embedder") or any(k in name for k in (".add_", ".to_add_out", ".ff_context.")):
        return b * txt
    return b * img  # x_embedder, image-stream attention and MLP, proj_out


@pytest.mark.parametrize("shape_name", ["llama-tiny", "flux-tiny"])
def test_matmul_count_is_rows_times_in_times_out_of_every_linear(shape_name):
    shape = es.SHAPES[shape_name]
    model = es.build_model(shape, es.CONFIGS["bf16-8bit"], torch.device("cpu"), torch.float32, seed=0)
    counter = es.MatmulCounter(model)
    batch = es.make_batches(shape, 1, seed=0)[0]
    ids = es.flux_ids(shape, torch.device("cpu")) if shape.kind == "flux" else None
    with torch.no_grad():
        es.loss_fn(model, shape, batch, torch.float32, ids)
    counter.remove()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if shape.kind == "llama":
        expect = shape.batch * shape.tokens * sum(m.in_features * m.out_features for _, m in linears)
    else:
        expect = sum(_flux_rows(n, shape) * m.in_features * m.out_features for n, m in linears)
    assert counter.total == expect


def test_materialised_models_are_identical_across_configs_and_fp8_is_quantised_as_built():
    shape = es.SHAPES["llama-tiny"]
    a = es.build_model(shape, es.CONFIGS["bf16-8bit"], torch.device("cpu"), torch.bfloat16, seed=0)
    b = es.build_model(shape, es.CONFIGS["baseline"], torch.device("cpu"), torch.bfloat16, seed=0)
    c = es.build_model(shape, es.CONFIGS["fp8-8bit"], torch.device("cpu"), torch.bfloat16, seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(p.is_meta for p in c.parameters())
    from engine.frozen_base.fp8 import FP8Linear

    q = c.model.layers[0].self_attn.q_proj
    assert isinstance(q, FP8Linear)
    ref = a.model.layers[0].self_attn.q_proj.weight.float()
    assert ((q.dequantized(torch.float32) - ref).norm() / ref.norm()).item() < 0.05
    ids = torch.randint(0, 256, (1, 16))
    assert torch.isfinite(c(input_ids=ids).logits).all()
