"""The OpenAI-compatible HTTP ingress of the Serve application: validates, authenticates and forwards each request
to the model deployment. Every error is OpenAI's error JSON: 4xx for the client's mistakes, 5xx when a replica
fails, never a hang.

Its replica imports this module, so it imports nothing of the model stack (torch, transformers, peft): the ingress
is an HTTP router, and with :mod:`raylora.serve.replica` imported here its process held 563 MB and took 5.5 s of
CPU to start instead of ~200 MB and ~1.5 s. :mod:`raylora.serve.app` binds it to the model deployment.
"""

import asyncio
import hmac
import logging
import os
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raylora.config import JobConfig, from_dict
from raylora.registry import AdapterError, check_name, list_registered
from raylora.serve import protocol
from raylora.serve.adapters import install, list_local, local_adapter
from raylora.serve.protocol import ApiError
from raylora.serve.tools import CallStream, split_calls
from raylora.tracking import tracking_uri

log = logging.getLogger("ray.serve")
api = FastAPI(title="raylora", docs_url=None, redoc_url=None, openapi_url=None)  # only /health is open
REPLICA_TIMEOUT_S = 600  # a request still unanswered then is failed with 504, not left hanging


def served_name(cfg: JobConfig) -> str:
    """The ``model`` id of the base model: its registry name, or the folder / file name of its path."""
    return Path(cfg.model.name_or_path).name.removesuffix(".gguf")


def resolve_keys(cfg: JobConfig) -> tuple[str | None, str | None]:
    """``(api key, admin key)`` from the config, else the RAYLORA_API_KEY / RAYLORA_ADMIN_KEY environment."""
    return (cfg.serve.api_key or os.environ.get("RAYLORA_API_KEY") or None,
            cfg.serve.admin_key or os.environ.get("RAYLORA_ADMIN_KEY") or None)  # fmt: skip


def _error(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@api.exception_handler(ApiError)
async def _api_error(_: Request, e: ApiError) -> JSONResponse:
    return _error(e)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
    return _error(ApiError(e.status_code, str(e.detail), code=code))


@api.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error in the HTTP ingress")
    return _error(
        ApiError(500, f"internal error ({type(e).__name__}); the server keeps serving", code="internal_error")
    )


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _check_key(request: Request, key: str | None, what: str) -> None:
    if key is None:
        return
    given = _bearer(request)
    if not given:
        raise ApiError(401, f"{what} needs an API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "the API key given is not valid", code="invalid_api_key")


async def _read_body(request: Request) -> bytes:
    """The request body; 413 past :data:`~raylora.serve.protocol.MAX_BODY_BYTES`, before reading it when its length
    is declared."""
    limit = protocol.MAX_BODY_BYTES
    too_large = ApiError(413, f"the request body is over {limit >> 20} MiB", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


async def _next_event(stream) -> dict:
    """The next event from the model deployment, with its failures turned into :class:`ApiError`."""
    try:
        event = await asyncio.wait_for(stream.__anext__(), REPLICA_TIMEOUT_S)
    except StopAsyncIteration:
        raise ApiError(502, "the model replica ended the answer early", code="replica_failed") from None
    except TimeoutError:
        raise ApiError(
            504, f"no token from the model replica in {REPLICA_TIMEOUT_S} s", code="replica_timeout"
        ) from None
    except Exception as e:
        cause = getattr(e, "cause", None) or e  # Ray wraps what the replica raised
        if isinstance(cause, ApiError):
            raise ApiError(cause.status, cause.message, cause.param, cause.code) from None
        if isinstance(cause, AdapterError):
            raise ApiError(cause.status, str(cause), "model", cause.code) from None
        # A replica that died or failed: Serve replaces it; this request gets a 5xx body.
        log.warning("generation failed in the model replica: %s", e)
        raise ApiError(
            503, f"the model replica failed ({type(e).__name__}); retry shortly", code="replica_failed"
        ) from None
    refused = event.get("refused")
    if refused is not None:
        raise ApiError(refused["status"], refused["message"], refused["param"], refused["code"])
    return event


def _names(gen: protocol.Generation) -> set[str]:
    """The functions a call may name: the request's, or the one ``tool_choice`` names."""
    return {gen.tool_name} if gen.tool_choice == "function" else {tool["function"]["name"] for tool in gen.tools or []}


def _most_calls(gen: protocol.Generation) -> int | None:
    """How many of an answer's calls are kept: one for ``parallel_tool_calls: false`` or a named function."""
    return None if gen.parallel_tool_calls and gen.tool_choice != "function" else 1


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """HTTP routes; validates, authenticates and forwards generation to the model deployment."""

    def __init__(self, cfg: dict, llm):
        self.cfg = from_dict(cfg)
        self.llm = llm
        self.base = served_name(self.cfg)
        self.root = Path(self.cfg.serve.adapter_root).resolve()
        self.api_key, self.admin_key = resolve_keys(self.cfg)

    def _tracking_uri(self) -> str | None:
        if not self.cfg.tracking.enabled:
            return None
        return tracking_uri(self.cfg.tracking)

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        _check_key(request, self.api_key, "this endpoint")
        names = await asyncio.to_thread(self._adapter_names)
        created = int(time.time())
        data = [{"id": self.base, "object": "model", "created": created, "owned_by": "raylora"}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "raylora", "parent": self.base}
                 for n in names if n != self.base]  # fmt: skip
        return {"object": "list", "data": data}

    @api.get("/v1/models/{name}")
    async def model(self, name: str, request: Request) -> dict:
        _check_key(request, self.api_key, "this endpoint")
        listed = (await self.models(request))["data"]
        found = next((m for m in listed if m["id"] == name), None)
        if found is None:
            known = ", ".join(m["id"] for m in listed)
            raise ApiError(404, f"the model {name!r} does not exist; available: {known}", "model", "model_not_found")
        return found

    def _adapter_names(self) -> list[str]:
        uri = self._tracking_uri()
        return sorted(set(list_local(self.root)) | set(list_registered(uri) if uri else []))

    @api.post("/v1/adapters")
    async def register(self, request: Request) -> JSONResponse:
        if self.admin_key is None:
            raise ApiError(403, "adapter registration is off: set serve.admin_key or RAYLORA_ADMIN_KEY",
                           code="registration_disabled")  # fmt: skip
        _check_key(request, self.admin_key, "POST /v1/adapters")
        body = protocol.parse_body(await _read_body(request))
        unknown = set(body) - {"name", "source"}
        if unknown:
            raise ApiError(
                400, f"unrecognized fields {sorted(unknown)}; send name and source", code="unrecognized_argument"
            )
        name, source = body.get("name"), body.get("source")
        if not isinstance(name, str) or not isinstance(source, str) or not source:
            raise ApiError(400, "send {'name': str, 'source': a trained adapter folder, runs:/... or models:/...}")
        if name == self.base:
            raise ApiError(409, f"{name!r} is the base model's name", "name", "adapter_exists")
        try:
            check_name(name)
        except AdapterError as e:
            raise ApiError(e.status, str(e), "name", e.code) from None
        try:
            path = await asyncio.to_thread(install, self.root, name, source, self._tracking_uri())
        except AdapterError as e:
            raise ApiError(e.status, str(e), "name" if e.status == 409 else "source", e.code) from None
        log.info("adapter %s registered from %s into %s", name, source, path)
        return JSONResponse(
            {"id": name, "object": "model", "owned_by": "raylora", "parent": self.base}, status_code=201
        )

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._generate(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool):
        _check_key(request, self.api_key, "this endpoint")
        body = protocol.parse_body(await _read_body(request))
        limit = self.cfg.serve.max_schema_chars
        gen = protocol.parse_chat(body, limit) if chat else protocol.parse_completion(body, limit)
        adapter = "" if gen.model == self.base else await asyncio.to_thread(self._known_adapter, gen.model)
        payload = {"messages": gen.messages, "prompt": gen.prompt, "max_tokens": gen.max_tokens,
                   "temperature": gen.temperature, "top_p": gen.top_p, "stop": list(gen.stop), "seed": gen.seed,
                   "stream": gen.stream, "tools": gen.tools, "tool_choice": gen.tool_choice,
                   "tool_name": gen.tool_name, "parallel_tool_calls": gen.parallel_tool_calls,
                   "response_format": gen.response_format}  # fmt: skip
        stream = self.llm.options(stream=True, multiplexed_model_id=adapter).generate.remote(payload)
        rid = protocol.completion_id(chat)
        first = await _next_event(stream)  # errors before the first token still get a proper status code
        if gen.stream:
            return StreamingResponse(self._sse(stream, first, rid, gen, chat), media_type="text/event-stream")
        events = [first]
        while not (events[-1]["finish_reason"] or events[-1]["error"]):
            events.append(await _next_event(stream))
        if events[-1]["error"]:
            raise ApiError(500, events[-1]["error"], code="generation_failed")
        last = events[-1]
        text, calls = "".join(e["text"] for e in events), []
        if gen.tool_choice != "none":
            text, calls = split_calls(text, _names(gen))
            calls = calls[: _most_calls(gen)]
        use = protocol.usage(last["prompt_tokens"], last["completion_tokens"], last.get("cached_tokens", 0))
        finish = "tool_calls" if calls else last["finish_reason"]
        return protocol.response(rid, gen.model, chat, text, finish, use, calls)

    def _known_adapter(self, name: str) -> str:
        """``name`` if an adapter of that name can be served; :class:`ApiError` 404 naming what exists otherwise."""
        try:
            check_name(name)
            local_adapter(self.root, name)
            return name
        except AdapterError as e:
            if e.status != 404:
                raise ApiError(e.status, str(e), "model", e.code) from None
        uri = self._tracking_uri()
        if uri and name in list_registered(uri):
            return name
        known = [self.base, *self._adapter_names()]
        raise ApiError(
            404, f"the model {name!r} does not exist; available: {', '.join(known)}", "model", "model_not_found"
        )

    async def _sse(self, stream, first: dict, rid: str, gen: protocol.Generation, chat: bool):
        event, sent_role = first, False
        calls = None
        if gen.tool_choice != "none":
            calls = CallStream(_names(gen))
        # with include_usage, OpenAI's chunks carry "usage": null until the last one, which holds the counts
        usage_field = {"usage": None} if gen.include_usage else {}
        try:
            while True:
                if event["error"]:
                    yield protocol.sse(ApiError(500, event["error"], code="generation_failed").body())
                    break
                text, found, finish = event["text"], [], event["finish_reason"]
                if calls is not None:
                    text = calls.feed(text)
                    if finish:
                        rest, found = calls.finish()
                        text, found = text + rest, found[: _most_calls(gen)]
                if text or found or not sent_role:
                    # beside a call, no text is null content, as OpenAI sends it (not "")
                    content = None if found and not text else text
                    chunk = protocol.chunk(rid, gen.model, chat, content, None, not sent_role, found)
                    yield protocol.sse(chunk | usage_field)
                    sent_role = True
                if finish:
                    finish = "tool_calls" if found else finish
                    chunk = protocol.chunk(rid, gen.model, chat, None if chat else "", finish)
                    yield protocol.sse(chunk | usage_field)
                    if gen.include_usage:
                        use = protocol.usage(
                            event["prompt_tokens"], event["completion_tokens"], event.get("cached_tokens", 0)
                        )
                        yield protocol.sse(
                            {**protocol.chunk(rid, gen.model, chat, None, None), "choices": [], "usage": use}
                        )
                    break
                event = await _next_event(stream)
        except ApiError as e:  # the replica failed mid-answer: tell the client in the stream, then end it
            yield protocol.sse(e.body())
        yield protocol.sse("[DONE]")
