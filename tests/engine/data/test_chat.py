"""Chat-format data: assistant-only labels through the tokenizer's chat template, and packing that keeps documents apart."""

from __future__ import annotations

import json

import pytest
import torch

from engine.data.chat import FALLBACK_TEMPLATE
from engine.data.text import TokenDataset, encode_documents, read_documents
from engine.errors import JobInvalid
from engine.families.causal_lm import CausalLM
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import tiny_job

# A template of the Llama-3 kind (header, content, end-of-turn marker), as a published tokenizer carries one.
TEMPLATE = (
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Teal."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Ochre, then umber."},
]


@pytest.fixture(scope="module")
def lm(micro_model):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(micro_model, dtype=torch.float32).eval()
    model.config.use_cache = False  # as the family loads it: with a KV cache, packed documents are not seen
    return model, AutoTokenizer.from_pretrained(micro_model)


def _token_loss(logits: torch.Tensor, ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Cross-entropy of predicting ids[t] from logits[t-1], summed over `positions` (written out by hand)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -sum(logp[t - 1, ids[t]] for t in positions)


def test_chat_loss_is_the_cross_entropy_of_the_assistant_tokens_only(lm):
    model, tok = lm
    tok.chat_template = TEMPLATE
    log = RecLog()
    [(ids, labels)] = encode_documents([CONVERSATION], tok, "completions", log)
    assert log.named("chat_template_fallback") == []  # the tokenizer's own template was used
    batch = TokenDataset([(ids, labels)], tok.pad_token_id, len(ids) + 3, packing=False).collate([0])
    with torch.no_grad():
        loss = CausalLM().loss(model, batch, torch.Generator())
        logits = model(input_ids=batch["input_ids"]).logits[0]

    # The byte-level tokenizer maps each ASCII character to one token: character i is token i.
    text = "".join(f"<|start|>{m['role']}\n{m['content']}<|end|>\n" for m in CONVERSATION)
    assert tok.decode(ids) == text
    trained: list[int] = []
    at = 0
    for m in CONVERSATION:
        turn = f"<|start|>{m['role']}\n{m['content']}<|end|>\n"
        if m["role"] == "assistant":  # the content and the end-of-turn marker, not the header
            head = len(f"<|start|>{m['role']}\n")
            trained += range(at + head, at + len(turn))
        at += len(turn)
    assert [i for i, y in enumerate(labels) if y != -100] == trained
    expected = _token_loss(logits, batch["input_ids"][0], trained) / len(trained)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_train_on_all_labels_every_token_of_the_conversation(lm):
    model, tok = lm
    tok.chat_template = TEMPLATE
    [(ids, labels)] = encode_documents([CONVERSATION], tok, "all", RecLog())
    assert labels == ids


def test_a_tokenizer_without_a_chat_template_gets_the_fallback_and_a_warning(micro_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro_model)
    assert not tok.chat_template
    log = RecLog()
    [(ids, labels)] = encode_documents([CONVERSATION[1:3]], tok, "completions", log)
    assert [e for lvl, e, _ in log.events if lvl == "warning"] == ["chat_template_fallback"] and tok.chat_template == FALLBACK_TEMPLATE
    assert tok.decode([t for t in labels if t != -100]) == "Teal.</s>\n"


def test_packed_documents_do_not_see_each_other(lm):
    model, tok = lm
    docs = encode_documents(["The first document, about boats.", "A second one: trains and rails."], tok, None)
    n1, n2 = len(docs[0][0]), len(docs[1][0])
    ds = TokenDataset(docs, tok.pad_token_id, n1 + n2, packing=True)
    assert len(ds) == 1
    batch = ds.collate([0])
    assert batch["position_ids"][0].tolist() == [*range(n1), *range(n2)] and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = [model(input_ids=torch.tensor([d[0]])).logits[0] for d in docs]
        packed_loss = CausalLM().loss(model, batch, torch.Generator())
    torch.testing.assert_close(packed[:n1], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[n1:], alone[1], rtol=1e-5, atol=1e-5)
    # The per-document losses unpacked, pooled: each document's tokens after its first.
    per_doc = [_token_loss(a, torch.tensor(d[0]), range(1, len(d[0]))) for a, d in zip(alone, docs, strict=True)]
    assert packed_loss.item() == pytest.approx((sum(per_doc) / (n1 + n2 - 2)).item(), rel=1e-5)


def test_chat_jsonl_lines_are_read_as_conversations_and_checked(tmp_path):
    good = tmp_path / "chat.jsonl"
    good.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps({"messages": CONVERSATION[:3]}) + "\n")
    assert read_documents(good, "text") == [CONVERSATION, CONVERSATION[:3]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(JobInvalid, match=r"^data.path: bad.jsonl line 2: messages\[0\]"):
        read_documents(bad, "text")


def test_train_on_completions_refuses_plain_text_naming_the_key(micro_model, tmp_path):
    with pytest.raises(JobInvalid, match=r"data.train_on: completions needs chat data"):
        tiny_job(micro_model, tmp_path, data={"train_on": "completions"})
    with pytest.raises(JobInvalid, match=r"data.train_on: .*completions.*all"):
        tiny_job(micro_model, tmp_path, data={"train_on": "assistant"})
