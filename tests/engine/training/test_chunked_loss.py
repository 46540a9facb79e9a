"""train.chunked_loss: the LM head and cross-entropy in chunks give the plain loss and gradients, and say what they refuse."""

from __future__ import annotations

import pytest
import torch

from engine.errors import JobInvalid
from engine.families.causal_lm import CausalLM
from engine.training.chunked_loss import chunked_cross_entropy
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import tiny_job


def test_chunked_cross_entropy_equals_the_plain_one_with_its_gradients():
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (2, 37), generator=g)
    labels[0, 5:11] = -100
    labels[1, -4:] = -100

    plain = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=300)
    plain_grads = torch.autograd.grad(plain, [hidden, weight])
    chunked = chunked_cross_entropy(hidden, weight, labels, rows=7)  # 72 rows: chunks that do not divide evenly
    chunked_grads = torch.autograd.grad(chunked, [hidden, weight])

    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_under_autocast_the_chunked_loss_computes_the_lm_head_in_its_own_dtype():
    """lora.dtype wider than a bf16 base runs the loss under autocast; fp32 hidden states meet a bf16 head."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 20, 16, generator=g, requires_grad=True)
    weight = torch.randn(100, 16, generator=g).bfloat16()
    labels = torch.randint(0, 100, (1, 20), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, labels, rows=6)
    loss.backward()
    plain = torch.nn.functional.cross_entropy((hidden[0, :-1].detach().bfloat16() @ weight.T).float(), labels[0, 1:])
    assert hidden.grad.dtype == torch.float32 and hidden.grad.abs().sum() > 0
    torch.testing.assert_close(loss.detach(), plain, rtol=1e-5, atol=1e-5)


def _lora_grads(model, family, batch):
    model.zero_grad(set_to_none=True)
    loss = family.loss(model, batch, torch.Generator())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_lora_model_trains_the_same_with_the_chunked_loss(micro_model, tmp_path):
    from engine.data.text import TokenDataset, encode_documents

    cfg = tiny_job(micro_model, tmp_path, train={"chunked_loss": True})
    family = CausalLM()
    model = family.load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
    model.eval()  # no LoRA dropout: both paths see the same function
    tok = family.tokenizer(cfg, tmp_path)
    docs = encode_documents(["Packed text for a loss.", "And a second document."], tok, None)
    batch = TokenDataset(docs, 0, 24, packing=True).collate([0, 0])
    assert family._chunked
    chunked = _lora_grads(model, family, batch)
    family._chunked = False
    plain = _lora_grads(model, family, batch)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=1e-6)
    assert chunked[1].keys() == plain[1].keys() and len(plain[1]) == 8
    for name in plain[1]:
        torch.testing.assert_close(chunked[1][name], plain[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_lora_on_lm_head_is_refused_with_chunked_loss_naming_both_keys(micro_model, tmp_path):
    cfg = tiny_job(micro_model, tmp_path, train={"chunked_loss": True}, lora={"targets": ["q_proj", "lm_head"]})
    with pytest.raises(JobInvalid, match=r"^train.chunked_loss: .*lm_head.*lora.targets"):
        CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), RecLog())


def test_auto_stays_off_below_the_vocabulary_threshold_and_for_an_lm_head_lora(micro_model, tmp_path):
    from engine.families.causal_lm import family as causal_lm  # where the code reads AUTO_MIN_VOCAB

    family = CausalLM()
    family.load_model(tiny_job(micro_model, tmp_path), tmp_path, torch.device("cpu"), RecLog())
    assert not family._chunked  # 259 tokens
    log = RecLog()
    cfg = tiny_job(micro_model, tmp_path, lora={"targets": ["q_proj", "lm_head"]})
    saved = causal_lm.AUTO_MIN_VOCAB
    causal_lm.AUTO_MIN_VOCAB = 100
    try:
        family.load_model(cfg, tmp_path, torch.device("cpu"), log)
    finally:
        causal_lm.AUTO_MIN_VOCAB = saved
    assert not family._chunked and [e for lvl, e, _ in log.events if lvl == "warning"] == ["chunked_loss_off"]


def test_chunked_loss_is_a_causal_lm_key(tmp_path):
    from engine.config.job import parse_job
    from tests.helpers.images import flux_job_dict

    with pytest.raises(JobInvalid, match=r"train.chunked_loss: only for model.family causal_lm"):
        parse_job(flux_job_dict("builtin:tiny-flux", tmp_path, train={"chunked_loss": True}), tmp_path,
                  check_paths=False)
    with pytest.raises(JobInvalid, match=r"train.chunked_loss"):
        tiny_job("builtin:tiny-llama", tmp_path, train={"chunked_loss": "always"})
