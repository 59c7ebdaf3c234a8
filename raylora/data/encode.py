"""Chat messages to token ids and labels: render with a chat template, tokenise, mask the prompt.

The template is rendered prefix by prefix (everything before an assistant turn, then through its
end), so the boundary between what is read and what is learned is exactly where the template puts
it, for any template. All segments of a batch are tokenised together (:mod:`raylora.data.tokenize`).

Tools, tool calls and reasoning go to the template in the fields it reads, found by rendering probes
once per encoder: ``tools=`` and ``tool_calls`` when it renders them, else the Hermes fallback
(:func:`~raylora.templates.hermes_tools`); reasoning in its own field (``reasoning_content``,
``thinking``) when it renders one, else as ``<think>...</think>`` before the answer.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np
from jinja2 import TemplateError
from tokenizers import Tokenizer

from raylora.data.formats import Conversation, Message, RowError
from raylora.data.tokenize import PieceTokenizer
from raylora.templates import (
    CHATML,
    FALLBACK_TEMPLATES,
    compile_template,
    hermes_tool_call,
    hermes_tool_response,
    hermes_tools,
    think,
)

IGNORE_INDEX = -100
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as Qwen3, gpt-oss and others name it
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "raylora_probe",
        "description": "raylora probe description",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
_PROBE_CALL = {"type": "function", "function": {"name": "raylora_probe", "arguments": {"q": "raylora probe value"}}}


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
        self.backend = Tokenizer.from_str(spec.tokenizer_json)
        self.tokenize = PieceTokenizer(self.backend)
        self.template_name = spec.template_name
        self.template = compile_template(spec.template)
        self.specials = spec.specials
        self.cutoff_len, self.truncation, self.train_on_prompt = cutoff_len, truncation, train_on_prompt
        self.native_tools = self._renders_tools()
        self.reasoning_field = self._reasoning_field()

    def render(self, messages: list[Message], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.specials
        )

    def _probe(self, messages: list[Message], marks: tuple[str, ...], tools: list | None = None) -> bool:
        """Whether the template renders ``messages`` with every one of ``marks`` in its text."""
        try:
            text = self.render(messages, tools=tools)
        except Exception:  # a template may refuse the probe any way it likes (raise_exception, a type error)
            return False
        return all(mark in text for mark in marks)

    def _renders_tools(self) -> bool:
        """Whether the template shows ``tools=``, assistant ``tool_calls`` and ``tool`` turns itself."""
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
            {"role": "tool", "content": "raylora probe result"},
            {"role": "assistant", "content": "a"},
        ]
        marks = ("raylora probe description", "raylora probe value", "raylora probe result")
        return self._probe(messages, marks, [_PROBE_TOOL])

    def writes_hermes_calls(self) -> bool:
        """Whether assistant tool calls come out as ``<tool_call>\n{"name": ..., "arguments": ...}`` (the Hermes
        fallback, or a template that writes them so itself, as Qwen2.5's does)."""
        conversation = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                                       "tool_calls": [_PROBE_CALL]}], [_PROBE_TOOL])  # fmt: skip
        messages, _, tools = self.template_view(conversation)
        return self._probe(messages, (hermes_tool_call(_PROBE_CALL),), tools)

    def _reasoning_field(self) -> str | None:
        """The assistant message field the template renders reasoning from, or None."""
        for field in REASONING_FIELDS:
            turn = {"role": "assistant", "content": "a", field: "raylora probe thought"}
            if self._probe([{"role": "user", "content": "q"}, turn], ("raylora probe thought",)):
                return field
        return None

    def template_view(self, conversation: Conversation) -> tuple[list[Message], list[bool], list | None]:
        """The messages as the template reads them, whether each is learned, and the ``tools=`` to render with.

        A message is learned by its ``loss_weight``, else when it is an assistant turn. Without the template's
        own support, tools join the system message, tool calls the assistant's text and tool results a user
        turn (consecutive results share one), all as the Hermes fallback writes them.
        """
        messages, tools = conversation.messages, conversation.tools
        if tools is None and all(len(m) == 2 and m["role"] != "tool" for m in messages):  # nothing to adapt
            return messages, [m["role"] == "assistant" for m in messages], None
        view: list[Message] = []
        learned: list[bool] = []
        after_tool = False
        for m in messages:
            weight = m.get("loss_weight")
            lrn = m["role"] == "assistant" if weight is None else weight > 0
            content = m["content"]
            out: Message = {"role": m["role"]}
            if m.get("tool_calls"):
                if self.native_tools:
                    out["tool_calls"] = m["tool_calls"]
                else:
                    content = "\n".join([content] * bool(content) + [hermes_tool_call(c) for c in m["tool_calls"]])
            if "reasoning" in m:
                if self.reasoning_field:
                    out[self.reasoning_field] = m["reasoning"]
                else:
                    content = think(m["reasoning"], content)
            out["content"] = content
            if m["role"] == "tool" and not self.native_tools:
                if after_tool:
                    view[-1]["content"] += "\n" + hermes_tool_response(content)
                    learned[-1] = learned[-1] or lrn
                    continue
                out = {"role": "user", "content": hermes_tool_response(content)}
            after_tool = m["role"] == "tool"
            view.append(out)
            learned.append(lrn)
        if tools is not None and not self.native_tools:
            if view[0]["role"] == "system":
                view[0] = {**view[0], "content": view[0]["content"] + "\n\n" + hermes_tools(tools)}
            else:
                view.insert(0, {"role": "system", "content": hermes_tools(tools)})
                learned.insert(0, False)
            tools = None
        return view, learned, tools

    def prompt(self, conversation: Conversation) -> str:
        """A conversation (and the functions it may call) rendered as training renders it, then the assistant's
        turn opened: what a model answers (serving, evaluation).

        Raises:
            jinja2.TemplateError: the chat template refuses the conversation (``raise_exception``).
        """
        messages, _, tools = self.template_view(conversation)
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def text(self, conversation: Conversation | list[Message]) -> str:
        """The whole conversation rendered, as training sees it (calibration, perplexity)."""
        if isinstance(conversation, list):
            conversation = Conversation(conversation)
        if conversation.messages[0]["role"] == "text":
            return self.segments(conversation)[0][0]
        messages, _, tools = self.template_view(conversation)
        return self.render(messages, tools=tools)

    def segments(self, conversation: Conversation | list[Message]) -> list[tuple[str, bool]]:
        """``[(text, learned), ...]`` whose concatenation is the rendered conversation, through its last learned turn.

        Every assistant turn, and every other turn that is learned, is cut out of the rendering at the
        boundaries the template itself draws: the text before it (with the generation prompt, for an
        assistant turn) and the text through its end are rendered, and the turn is what the second adds.
        Raises:
            RowError: the template refuses the conversation, or does not render it prefix by prefix.
        """
        if isinstance(conversation, list):
            conversation = Conversation(conversation)
        if conversation.messages[0]["role"] == "text":
            return [(conversation.messages[0]["content"] + self.specials.get("eos_token", ""), True)]
        messages, learned, tools = self.template_view(conversation)
        out: list[tuple[str, bool]] = []
        done = ""

        def cut(text: str, lrn: bool) -> None:
            nonlocal done
            if not text.startswith(done):
                raise RowError(
                    f"the {self.template_name} chat template does not render this conversation prefix by prefix"
                )
            if len(text) > len(done):
                out.append((text[len(done) :], lrn))
            done = text

        try:
            for i, (message, lrn) in enumerate(zip(messages, learned, strict=True)):
                if message["role"] == "assistant":
                    cut(self.render(messages[:i], add_generation_prompt=True, tools=tools), self.train_on_prompt)
                elif lrn:
                    cut(self.render(messages[:i], tools=tools) if i else "", self.train_on_prompt)
                else:
                    continue
                cut(self.render(messages[: i + 1], tools=tools), lrn)
        except TemplateError as e:
            raise RowError(f"the {self.template_name} chat template refuses this conversation: {e}") from None
        return out

    def encode_many(self, conversations: list[Conversation | list[Message]]) -> list[Encoded | RowError]:
        """Encode a batch; each item is an :class:`Encoded` or the :class:`RowError` that rejects it."""
        batch = self.encode_arrays(conversations)
        return [
            error or Encoded(batch.input_ids[a:b].tolist(), batch.labels[a:b].tolist())
            for error, a, b in zip(batch.errors, batch.offsets[:-1], batch.offsets[1:], strict=True)
        ]

    def encode_arrays(self, conversations: list[Conversation | list[Message]], whole: bool = False) -> EncodedBatch:
        """Encode a batch into flat arrays: render, tokenise every segment together, then mask and cut with numpy.

        With ``whole``, no row is cut or rejected for its length (callers that fit rows to ``cutoff_len`` themselves).
        """
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
        cutoff = np.iinfo(np.int64).max if whole else self.cutoff_len
        keep_lens = np.minimum(row_lens, cutoff)
        learned_kept = np.bincount(row_of[learned & (position < cutoff)], minlength=n)
        for i in np.flatnonzero((row_lens > cutoff) | (learned_kept == 0)):
            if errors[i] is not None:
                continue
            if not any(lrn for _, lrn in plans[i]):
                errors[i] = RowError("nothing to learn: every turn has loss_weight 0")
            elif self.truncation == "reject" and row_lens[i] > cutoff:
                # the count after ";": the summary groups reasons by what comes before it (one line, not one per length)
                errors[i] = RowError(f"longer than data.cutoff_len={self.cutoff_len}; {row_lens[i]} tokens")
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
