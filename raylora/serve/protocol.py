"""OpenAI request validation and response shapes, as pure functions (no Ray, no torch).

Every problem with a request becomes an :class:`ApiError`, answered as OpenAI's error JSON
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from raylora.config import ServeArgs
from raylora.data.formats import RowError, parse_tool_calls, parse_tools

ROLES = ("system", "user", "assistant", "tool")  # and "developer", read as system
MAX_STOP = 4
MAX_BODY_BYTES = 8 << 20  # a request body past this gets 413 before it is read
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# Fields OpenAI's clients echo back in an assistant message taken from a response; accepted when empty.
ECHOED = {"refusal", "audio", "function_call", "annotations"}
REASONING = ("reasoning_content", "reasoning")  # an assistant turn's reasoning, as reasoning models' servers echo it


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __reduce__(self):  # crosses Ray process boundaries intact
        return ApiError, (self.status, self.message, self.param, self.code)

    def body(self) -> dict:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(self.status)
        kind = kind or ("invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Generation:
    """A validated chat or completion request.

    Attributes:
        model: the base model's or an adapter's name.
        messages: the conversation (chat), or None; assistant messages may carry ``tool_calls``
            (``[{"type": "function", "function": {"name": str, "arguments": dict}}]``).
        prompt: the prompt text (completions), or None.
        max_tokens: requested answer length, or None for the server's default.
    """

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # json_object or json_schema; None: text
    extra: dict[str, Any] = field(default_factory=dict)


# Fields OpenAI defines that this server accepts only at their default value.
_DEFAULT_ONLY = {
    "n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""),
}  # fmt: skip
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "user"}
_COMMON |= {"response_format"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"}
CHAT_FIELDS |= _DEFAULT_ONLY.keys() - {"echo", "best_of", "suffix"}
COMPLETION_FIELDS = _COMMON | {"prompt"} | {"n", "logprobs", "logit_bias", "echo", "best_of", "suffix"}
COMPLETION_FIELDS |= {"frequency_penalty", "presence_penalty"}


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body; :class:`ApiError` 400 for anything else, including a number past
    Python's 4,300 digits and text that is not Unicode (a lone surrogate escape such as ``"\\ud800"``, which JSON
    allows and no tokenizer takes)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, huge integers
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(
            400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text; "
            "escape characters outside the Basic Multilingual Plane as surrogate pairs", code="invalid_json",
        ) from None  # fmt: skip
    return body


def parse_chat(body: dict, max_schema_chars: int = ServeArgs.max_schema_chars) -> Generation:
    """Validate a ``POST /v1/chat/completions`` body (:class:`ApiError` 400 names the first bad field); a
    ``response_format`` schema may be ``max_schema_chars`` long as JSON."""
    _check_fields(body, CHAT_FIELDS)
    messages = _required(body, "messages", list)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", "messages")
    gen = _common(body, max_schema_chars, messages=[_message(m, i) for i, m in enumerate(messages)])
    _check_tool_results(gen.messages)
    if body.get("max_completion_tokens") is not None:
        gen.max_tokens = _int(body, "max_completion_tokens", 1)
    gen.tools, gen.tool_choice, gen.tool_name = _tools(body)
    if body.get("parallel_tool_calls") is not None:
        gen.parallel_tool_calls = _required(body, "parallel_tool_calls", bool)
    return gen


def _tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    """``(tools, tool_choice, name)``: the function schemas the prompt shows; ``auto`` (the model may call one),
    ``none`` (its answer is text), ``required`` (it calls one) or ``function`` (it calls ``name``)."""
    raw = body.get("tools")
    if raw is not None and not (isinstance(raw, list) and all(isinstance(t, dict) and t.get("type") == "function"
                                                               for t in raw)):  # fmt: skip
        raise ApiError(400, "'tools' must be a list of {'type': 'function', 'function': {name, description, "
                       "parameters}}", "tools", "invalid_type")  # fmt: skip
    try:
        tools = parse_tools(raw)
    except RowError as e:
        raise ApiError(400, str(e), "tools") from None
    for k, tool in enumerate(tools or []):
        if not TOOL_NAME.fullmatch(tool["function"]["name"]):
            raise ApiError(400, f"tools[{k}].function.name must be 1-64 letters, digits, '_' or '-', got "
                           f"{tool['function']['name']!r}", f"tools[{k}].function.name", "invalid_value")  # fmt: skip
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none", None
    names = [tool["function"]["name"] for tool in tools or []]
    shape = "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name is None:
            raise ApiError(400, f"tool_choice must be {shape}, got {choice!r}", "tool_choice", "invalid_value")
        if name not in names:
            raise ApiError(400, f"tool_choice names {name!r}, which is not a function of 'tools' ({names})",
                           "tool_choice", "invalid_value")  # fmt: skip
        return tools, "function", name
    if choice not in ("auto", "none", "required"):
        raise ApiError(400, f"tool_choice must be {shape}, got {choice!r}", "tool_choice", "invalid_value")
    if choice != "none" and not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs 'tools'", "tool_choice", "invalid_value")
    return tools, choice, None


def parse_completion(body: dict, max_schema_chars: int = ServeArgs.max_schema_chars) -> Generation:
    """Validate a ``POST /v1/completions`` body; the prompt is one string (or a list holding one)."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string (one prompt per request)", "prompt")
    return _common(body, max_schema_chars, prompt=prompt)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key not in allowed:
            raise ApiError(400, f"unrecognized request argument: {key!r}", key, "unrecognized_argument")
        if key in _DEFAULT_ONLY and value not in _DEFAULT_ONLY[key]:
            raise ApiError(400, f"{key}={value!r} is not supported by this server; omit it", key, "unsupported_value")


def _common(body: dict, max_schema_chars: int, **kind: Any) -> Generation:
    gen = Generation(model=_required(body, "model", str), **kind)
    if not gen.model:
        raise ApiError(400, "'model' must not be empty", "model")
    if body.get("max_tokens") is not None:
        gen.max_tokens = _int(body, "max_tokens", 1)
    if body.get("temperature") is not None:
        gen.temperature = _number(body, "temperature", 0, 2)
    if body.get("top_p") is not None:
        gen.top_p = _number(body, "top_p", 0, 1)
        if gen.top_p == 0:
            raise ApiError(400, "'top_p' must be > 0", "top_p")
    if body.get("seed") is not None:
        gen.seed = _int(body, "seed", -(2**63))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
            raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        gen.stop = tuple(stops)
    if body.get("stream") is not None:
        gen.stream = _required(body, "stream", bool)
    options = body.get("stream_options")
    if options is not None and not gen.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options", "invalid_value")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, "'stream_options' must be an object with only 'include_usage'", "stream_options")
        gen.include_usage = bool(_required(options, "include_usage", bool)) if options else False
    if body.get("user") is not None:
        _required(body, "user", str)
    if body.get("response_format") is not None:
        gen.response_format = _response_format(body["response_format"], max_schema_chars)
    return gen


def _response_format(value: Any, max_schema_chars: int) -> dict | None:
    """``None`` for text, else ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
    "schema", ...}}`` with a valid JSON Schema (draft 2020-12) of at most ``max_schema_chars`` as JSON."""
    shape = ("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
             "'json_schema': {'name': ..., 'schema': {...}, 'strict': true}}")  # fmt: skip
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema") or set(value) - {"type", "json_schema"}:
        raise ApiError(400, f"{shape}, got {value!r}", "response_format", "invalid_value")
    if kind != "json_schema":
        return None if kind == "text" else {"type": kind}
    spec = value.get("json_schema")
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and spec["name"]) or set(spec) - {
        "name",
        "schema",
        "strict",
        "description",
    }:
        raise ApiError(400, f"{shape}, got {value!r}", "response_format.json_schema", "invalid_value")
    schema = spec.get("schema", {"type": "object"})
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    size = len(json.dumps(schema))
    if size > max_schema_chars:
        raise ApiError(400, f"{param} is {size} characters of JSON; this server takes at most {max_schema_chars} "
                       "(serve.max_schema_chars)", param, "schema_too_large")  # fmt: skip
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ApiError(400, f"{param} is not a valid JSON Schema: {e.message}", param, "invalid_schema") from None
    return {"type": "json_schema", "json_schema": {**spec, "schema": schema}}


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{param} must be an object with 'role' and 'content'", param)
    echoed = {k for k in ECHOED & m.keys() if not m[k]}
    unknown = set(m) - {"role", "content", "name", "tool_call_id", "tool_calls", *REASONING} - echoed
    if unknown:
        raise ApiError(400, f"{param} has unrecognized fields: {sorted(unknown)}", param, "unrecognized_argument")
    role = "system" if m.get("role") == "developer" else m.get("role")  # OpenAI's newer name for system
    if role not in ROLES:
        raise ApiError(400, f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    calls = m.get("tool_calls") or None
    if calls is not None and role != "assistant":
        raise ApiError(400, f"{param}: only assistant messages carry tool_calls", f"{param}.tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(_function_call(c) for c in calls)):
        raise ApiError(400, f"{param}.tool_calls must be a list of {{'type': 'function', 'function': {{'name', "
                       "'arguments'}}}}", f"{param}.tool_calls", "invalid_type")  # fmt: skip
    reasoning = next((m[k] for k in REASONING if m.get(k) is not None), None)  # as training reads it
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise ApiError(400, f"{param}: reasoning is text, on assistant messages only", param, "invalid_value")
    content = m.get("content")
    if content is None and calls is not None:
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{param}.content parts must be {{'type': 'text', 'text': str}}", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content")
    message: dict[str, Any] = {"role": role, "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if calls is None:
        return message
    try:
        return message | {"tool_calls": parse_tool_calls(calls, f"{param}.tool_calls")}
    except RowError as e:
        raise ApiError(400, str(e), f"{param}.tool_calls", "invalid_value") from None


def _function_call(call: Any) -> bool:
    return (
        isinstance(call, dict) and call.get("type", "function") == "function" and isinstance(call.get("function"), dict)
    )


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """A ``tool`` message answers the assistant's ``tool_calls`` just before it (after other results)."""
    for i, m in enumerate(messages):
        before = messages[i - 1] if i else {}
        if m["role"] == "tool" and not (before.get("role") == "tool" or before.get("tool_calls")):
            raise ApiError(400, f"messages[{i}] is a tool result that answers no assistant tool_calls before it",
                           f"messages[{i}]", "invalid_value")  # fmt: skip


def _required(body: dict, key: str, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        raise ApiError(400, f"missing required field {key!r}", key, "missing_required_parameter")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{key!r} must be a {kind.__name__}, got {type(value).__name__}", key, "invalid_type")
    return value


def _int(body: dict, key: str, low: int) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key!r} must be an integer, got {value!r}", key, "invalid_type")
    if value < low or value > 2**63 - 1:
        raise ApiError(400, f"{key!r} must be ≥ {low}, got {value}", key, "invalid_value")
    return value


def _number(body: dict, key: str, low: float, high: float) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"{key!r} must be a number, got {value!r}", key, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"{key!r} must be between {low} and {high}, got {value}", key, "invalid_value")
    return float(value)


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache (prompt caching)."""
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def response(
    rid: str, model: str, chat: bool, text: str | None, finish: str, use: dict, calls: list[dict] | None = None
) -> dict:
    """A whole (non-streaming) chat.completion or text_completion object; ``calls``: the answer's tool calls
    (:func:`raylora.serve.tools.split_calls`), with ``text`` the content before them or None."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    message = {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})
    choice |= {"message": message} if chat else {"text": text}
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice], "usage": use}


def chunk(
    rid: str, model: str, chat: bool, text: str | None, finish: str | None, first: bool = False,
    calls: list[dict] | None = None,
) -> dict:  # fmt: skip
    """One streamed chunk; a chat stream's first chunk also carries the assistant role, and ``calls`` become
    ``tool_calls`` deltas, each whole, with its ``index``."""
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        if calls:
            delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(calls)]
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
