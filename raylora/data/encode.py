"""Chat messages to token ids and labels: render with a chat template, tokenise, mask the prompt.

The template is rendered prefix by prefix (everything before an assistant turn, then through its
end), so the boundary between what is read and what is learned is exactly where the template puts
it, for any template. All segments of a batch are tokenised together (:mod:`raylora.data.tokenize`).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from raylora.data.formats import Message, RowError
from raylora.data.tokenize import PieceTokenizer
from raylora.templates import CHATML, FALLBACK_TEMPLATES, compile_template

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizerSpec:
    """What an encoder needs of a tokenizer, as plain strings: workers rebuild it without transformers or torch.

    Attributes:
        tokenizer_json: the fast tokenizer's serialised form (``tokenizers.Tokenizer.to_str()``).
        template_name: ``tokenizer`` (its own chat template) or a fallback name.
        template: the Jinja chat template.
        specials: special tokens by role (``eos_token``, ``bos_token``, ...), passed to the template.
    """

    tokenizer_json: str
    template_name: str
    template: str
    specials: dict[str, str]

    def to_dict(self) -> dict:
        return asdict(self)


def tokenizer_spec(tokenizer, template: str) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of a Hugging Face fast tokenizer for ``data.template``.

    ``auto`` takes the tokenizer's own chat template, or chatml when it has none; other names pick a fallback.
    """
    if template == "auto":
        name, source = ("tokenizer", tokenizer.chat_template) if tokenizer.chat_template else ("chatml", CHATML)
    else:
        name, source = template, FALLBACK_TEMPLATES[template]
    specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return TokenizerSpec(tokenizer.backend_tokenizer.to_str(), name, source, specials)


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


@dataclass
class EncodedBatch:
    """A batch of encoded conversations, flat: row ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``.

    A rejected row has no tokens and its :class:`RowError` in ``errors``.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    errors: list[RowError | None]


class Encoder:
    """Encodes conversations for one tokenizer and template (built once per process).

    Args:
        spec: the tokenizer and template (:func:`tokenizer_spec`).
        cutoff_len: maximum tokens per example.
        truncation: ``tail`` cuts longer examples to ``cutoff_len``; ``reject`` rejects them.
        train_on_prompt: learn every token, not only the assistant turns.
    """

    def __init__(self, spec: TokenizerSpec, cutoff_len: int, truncation: str, train_on_prompt: bool):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(spec.tokenizer_json)
        self.tokenize = PieceTokenizer(self.backend)
        self.template_name = spec.template_name
        self.template = compile_template(spec.template)
        self.specials = spec.specials
        self.cutoff_len, self.truncation, self.train_on_prompt = cutoff_len, truncation, train_on_prompt

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    def segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """``[(text, learned), ...]`` whose concatenation is the rendered conversation."""
        if messages[0]["role"] == "text":
            return [(messages[0]["content"] + self.specials.get("eos_token", ""), True)]
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
        batch = self.encode_arrays(conversations)
        return [
            error or Encoded(batch.input_ids[a:b].tolist(), batch.labels[a:b].tolist())
            for error, a, b in zip(batch.errors, batch.offsets[:-1], batch.offsets[1:], strict=True)
        ]

    def encode_arrays(self, conversations: list[list[Message]]) -> EncodedBatch:
        """Encode a batch into flat arrays: render, tokenise every segment together, then mask and cut with numpy."""
        n = len(conversations)
        errors: list[RowError | None] = [None] * n
        plans: list[list[tuple[str, bool]]] = []
        for i, messages in enumerate(conversations):
            try:
                plans.append(self.segments(messages))
            except RowError as e:
                errors[i] = e.with_traceback(None)  # a traceback would keep this frame's batch alive
                plans.append([])
        texts = [text for plan in plans for text, _ in plan]
        pieces = self.tokenize(texts)
        piece_lens = np.fromiter(map(len, pieces), np.int64, count=len(pieces))
        ids = np.fromiter(itertools.chain.from_iterable(pieces), np.int32, count=int(piece_lens.sum()))
        learned = np.repeat(np.fromiter((lrn for plan in plans for _, lrn in plan), bool, count=len(texts)), piece_lens)
        piece_ends = np.concatenate([[0], np.cumsum(piece_lens)])
        pieces_per_row = np.fromiter(map(len, plans), np.int64, count=n)
        row_lens = np.diff(piece_ends[np.concatenate([[0], np.cumsum(pieces_per_row)])])
        row_of = np.repeat(np.arange(n), row_lens)
        position = np.arange(len(ids)) - np.repeat(np.cumsum(row_lens) - row_lens, row_lens)
        keep_lens = np.minimum(row_lens, self.cutoff_len)
        learned_kept = np.bincount(row_of[learned & (position < self.cutoff_len)], minlength=n)
        for i in np.flatnonzero((row_lens > self.cutoff_len) | (learned_kept == 0)):
            if errors[i] is not None:
                continue
            if self.truncation == "reject" and row_lens[i] > self.cutoff_len:
                errors[i] = RowError(f"{row_lens[i]} tokens exceed data.cutoff_len={self.cutoff_len}")
            elif learned_kept[i] == 0:
                errors[i] = RowError(f"no response token is left after truncation to data.cutoff_len={self.cutoff_len}")
            if errors[i] is not None:
                keep_lens[i] = 0
        keep = position < keep_lens[row_of]
        return EncodedBatch(
            input_ids=ids[keep],
            labels=np.where(learned, ids, IGNORE_INDEX).astype(np.int32)[keep],
            offsets=np.concatenate([[0], np.cumsum(keep_lens)]),
            errors=errors,
        )
