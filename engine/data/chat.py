"""Chat-format data: conversations rendered through the tokenizer's chat template, with assistant-only labels.

A line of a chat `.jsonl` is `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}`.
The conversation is rendered to text by the tokenizer's own chat template
(transformers' `apply_chat_template`), exactly as inference will render it,
and tokenized once. With `data.train_on: completions` (the default for chat
data) only the assistant turns carry labels; everything else is −100.

Which characters belong to an assistant turn is found by rendering prefixes:
the turn starts where the conversation up to it, rendered with the generation
prompt, ends, and stops where the conversation up to and including it ends.
So the assistant's content and the template's end-of-turn marker are trained
(the model learns to stop), the role header is not. Tokens are mapped to
characters through the fast tokenizer's offset mapping. transformers'
`return_assistant_tokens_mask` would do this too, but only for templates that
carry `{% generation %}` markers, which few published templates do.

A tokenizer without a chat template (the builtin byte-level one) gets
FALLBACK_TEMPLATE, and the trainer logs a `chat_template_fallback` warning:
the adapter then expects that format at inference.
"""

from __future__ import annotations

from typing import Any

from engine.errors import JobInvalid

IGNORE = -100

# Plain text, so it needs no new tokens (the vocabulary and the embeddings stay as they are); each turn ends with
# the tokenizer's EOS so the model learns to stop.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """A conversation as the template expects it, or JobInvalid naming the line."""
    if not isinstance(messages, list) or not messages:
        raise JobInvalid(f"data.path: {where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise JobInvalid(f"data.path: {where}: messages[{i}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def ensure_chat_template(tokenizer, log) -> None:
    """Give a tokenizer without a chat template lorad's documented fallback, and say so."""
    if getattr(tokenizer, "chat_template", None):
        return
    tokenizer.chat_template = FALLBACK_TEMPLATE
    if log is not None:
        log.warning("chat_template_fallback",
                    message="the tokenizer has no chat template; conversations are rendered with lorad's fallback "
                            "'<|role|>\\ncontent</s>\\n' format (engine/data/chat.py), which inference must use too")


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str, where: str) -> list[tuple[int, int]]:
    """Character spans of `text` (the whole rendered conversation) that belong to assistant turns."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            start = len(_render(tokenizer, messages[:i], generation_prompt=True)) if i else 0
        except Exception:  # noqa: BLE001 — some templates refuse an empty conversation: then the turn starts at 0
            start = 0
        upto = _render(tokenizer, messages[: i + 1])
        if not text.startswith(upto) or start > len(upto):
            raise JobInvalid(
                f"data.train_on: {where}: the tokenizer's chat template does not render this conversation "
                "prefix by prefix, so its assistant turns cannot be found; use data.train_on: all"
            )
        spans.append((start, len(upto)))
    return spans


def encode_conversation(tokenizer, messages: list[dict[str, str]], train_on: str, where: str
                        ) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one rendered conversation; labels are −100 outside assistant turns for completions."""
    text = _render(tokenizer, messages)
    if not getattr(tokenizer, "is_fast", False):
        raise JobInvalid("model.path: chat data needs a fast (Rust) tokenizer for its offset mapping")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on == "all":
        return ids, list(ids)
    spans = assistant_spans(tokenizer, messages, text, where)
    labels = [t if any(s <= a < e for s, e in spans) else IGNORE for t, (a, _) in zip(ids, enc["offset_mapping"], strict=True)]
    return ids, labels
