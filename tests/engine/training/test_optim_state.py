"""Optimizer state survives the pickle-free checkpoint form bit-exactly (engine/training/optim.py split_tree/join_tree)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.config.train import TrainConfig
from engine.training.optim import build_optimizer, join_tree, split_tree


def through_checkpoint(tree):
    """What a checkpoint does: tensors to safetensors bytes, the rest to JSON text, and back."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tree(tree, "", tensors)
    blob = st_save({k: v.detach().contiguous().clone() for k, v in tensors.items()})
    return join_tree(json.loads(json.dumps(skeleton)), st_load(blob))


def bit_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int64,
          torch.int32, torch.float8_e4m3fn]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    n = math.prod(shape)
    raw = draw(st.lists(st.integers(0, 255), min_size=n * torch.empty((), dtype=dtype).element_size(),
                        max_size=n * torch.empty((), dtype=dtype).element_size()))
    # Arbitrary bit patterns (NaN payloads, subnormals, -0.0) — what an 8-bit or fp16 state can hold.
    return torch.tensor(raw, dtype=torch.uint8).view(dtype).reshape(shape)


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), tensors(),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.integers(0, 1000), st.text(max_size=6)), children, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_state_tree_round_trips_bit_exactly(tree):
    assert bit_equal(through_checkpoint(tree), tree)


def test_an_unstorable_value_is_named():
    with pytest.raises(TypeError, match="state/0/odd"):
        split_tree({"state": {0: {"odd": object()}}}, "", {})


@pytest.mark.parametrize("name", ["adamw8bit", "adamw"])
def test_a_real_optimizer_continues_identically_after_the_round_trip(name):
    torch.manual_seed(0)
    # 8192 weights: above bitsandbytes' 4096-element threshold, so adamw8bit keeps real 8-bit state
    # (uint8 moments, quantisation maps, absmax) beside the 32-bit state of the small bias.
    model = torch.nn.Linear(128, 64)
    opt = build_optimizer(list(model.parameters()), TrainConfig(optimizer=name, lr=0.01, weight_decay=0.1))

    def step(m, o, seed):
        g = torch.Generator().manual_seed(seed)
        m(torch.randn(8, 128, generator=g)).pow(2).mean().backward()
        o.step()
        o.zero_grad()

    for s in range(3):
        step(model, opt, s)
    state = opt.state_dict()
    if name == "adamw8bit":
        flat: dict[str, torch.Tensor] = {}
        split_tree(state, "", flat)
        assert any(t.dtype == torch.uint8 for t in flat.values()), "no 8-bit state to test"

    restored = through_checkpoint(state)
    assert bit_equal(restored, state)

    twin = torch.nn.Linear(128, 64)
    twin.load_state_dict(model.state_dict())
    twin_opt = build_optimizer(list(twin.parameters()), TrainConfig(optimizer=name, lr=0.01, weight_decay=0.1))
    twin_opt.load_state_dict(restored)
    for s in range(3, 6):
        step(model, opt, s)
        step(twin, twin_opt, s)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert bit_equal(a.detach(), b.detach())
