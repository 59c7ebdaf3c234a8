"""Chat messages to token ids and labels, learning only the assistant turns."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from raylora.data.alpaca import Message, RowError

IGNORE_INDEX = -100


def encode_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], cutoff_len: int
) -> dict[str, list[int]]:
    """Render ``messages`` with the tokenizer's chat template and tokenise it.

    Every assistant turn (content and end-of-turn marker) is learned; system, user and the
    template's scaffolding get label ``IGNORE_INDEX``. The template is rendered prefix by prefix,
    so each segment's boundary is exactly where the template puts it.

    Returns:
        ``{"input_ids": [T], "labels": [T]}`` with ``T <= cutoff_len``.
    Raises:
        RowError: truncation to ``cutoff_len`` left no learned token.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise RowError("the chat template does not render this conversation prefix by prefix")
        asked = tokenizer(prompt[len(done) :], add_special_tokens=False)["input_ids"]
        answered = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        input_ids += asked + answered
        labels += [IGNORE_INDEX] * len(asked) + answered
        done = full
    input_ids, labels = input_ids[:cutoff_len], labels[:cutoff_len]
    if all(label == IGNORE_INDEX for label in labels):
        raise RowError(f"no response token is left after truncation to data.cutoff_len={cutoff_len}")
    return {"input_ids": input_ids, "labels": labels}
