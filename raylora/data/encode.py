"""Chat messages to token ids and labels: render with a chat template, tokenise, mask the prompt.

The template is rendered prefix by prefix (everything before an assistant turn, then through its
end), so the boundary between what is read and what is learned is exactly where the template puts
it, for any template. All segments of a batch are tokenised in one call to the fast tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from raylora.data.formats import Message, RowError
from raylora.models import CHATML

IGNORE_INDEX = -100
ALPACA = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ '### Instruction:\n' + m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '### Response:\n' + m['content'] + eos_token + '\n\n' }}"
    "{% else %}{{ '### Tool result:\n' + m['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)
FALLBACK_TEMPLATES = {"chatml": CHATML, "alpaca": ALPACA}


def template_source(tokenizer: PreTrainedTokenizerBase, name: str) -> tuple[str, str]:
    """``(name, jinja source)``: the tokenizer's own template for ``auto`` (chatml when it has none), else a named fallback."""
    if name == "auto":
        return ("tokenizer", tokenizer.chat_template) if tokenizer.chat_template else ("chatml", CHATML)
    return name, FALLBACK_TEMPLATES[name]


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class Encoder:
    """Encodes conversations for one tokenizer and template (compiled once per process).

    Args:
        tokenizer: a fast tokenizer.
        template: ``auto``, ``chatml`` or ``alpaca`` (see :func:`template_source`).
        cutoff_len: maximum tokens per example.
        truncation: ``tail`` cuts longer examples to ``cutoff_len``; ``reject`` rejects them.
        train_on_prompt: learn every token, not only the assistant turns.
    """

    def __init__(self, tokenizer, template: str, cutoff_len: int, truncation: str, train_on_prompt: bool):
        self.tokenizer = tokenizer
        self.template_name, source = template_source(tokenizer, template)
        self.template = _compile_jinja_template(source)
        self.specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self.cutoff_len, self.truncation, self.train_on_prompt = cutoff_len, truncation, train_on_prompt

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    def segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """``[(text, learned), ...]`` whose concatenation is the rendered conversation."""
        if messages[0]["role"] == "text":
            return [(messages[0]["content"] + (self.tokenizer.eos_token or ""), True)]
        out: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise RowError(
                    f"the {self.template_name} chat template does not render this conversation prefix by prefix"
                )
            out += [(prompt[len(done) :], self.train_on_prompt), (full[len(prompt) :], True)]
            done = full
        return out

    def encode_many(self, conversations: list[list[Message]]) -> list[Encoded | RowError]:
        """Encode a batch; each item is an :class:`Encoded` or the :class:`RowError` that rejects it."""
        plans: list[list[tuple[str, bool]] | RowError] = []
        for messages in conversations:
            try:
                plans.append(self.segments(messages))
            except RowError as e:
                plans.append(e)
        texts = [text for plan in plans if not isinstance(plan, RowError) for text, _ in plan]
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        results: list[Encoded | RowError] = []
        for plan in plans:
            if isinstance(plan, RowError):
                results.append(plan)
                continue
            input_ids: list[int] = []
            labels: list[int] = []
            for _, learned in plan:
                piece = next(ids)
                input_ids += piece
                labels += piece if learned else [IGNORE_INDEX] * len(piece)
            results.append(self._cut(input_ids, labels))
        return results

    def _cut(self, input_ids: list[int], labels: list[int]) -> Encoded | RowError:
        if len(input_ids) > self.cutoff_len:
            if self.truncation == "reject":
                return RowError(f"{len(input_ids)} tokens exceed data.cutoff_len={self.cutoff_len}")
            input_ids, labels = input_ids[: self.cutoff_len], labels[: self.cutoff_len]
        if all(label == IGNORE_INDEX for label in labels):
            return RowError(f"no response token is left after truncation to data.cutoff_len={self.cutoff_len}")
        return Encoded(input_ids, labels)
