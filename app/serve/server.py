"""The FastAPI app: OpenAI's endpoints over the engine loop (docs/design.md §8).

Handlers never touch the scheduler: they parse and check the request, hand a
`Job` to the engine loop and read its events from an asyncio queue the engine
thread fills with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.loop import Accepted, EngineLoop, Job, Refused
from engine.scheduler import FinishEvent, TokenEvent

from . import metrics
from .friendliness import AdmissionProbe, Friendliness
from .guard import DEFAULT_MAX_BODY_BYTES, Guard, local_hosts
from .protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_LABEL_CHARS,
    ApiError,
    ParsedRequest,
    StopFilter,
    check_logit_bias,
    chunk,
    error_body,
    new_id,
    parse_chat,
    parse_completion,
    response,
    usage_chunk,
)

DISCONNECT_POLL_S = 0.5
# Completion ids a later answer may name as `diverged_from`: the most recently served or named
# 16,384 (at most about 10 MB with 256-character salts); an older request is named null.
COMPLETION_IDS = 16_384
log = logging.getLogger("prefixlab.serve")


class CompletionIds:
    """Served requests' completion ids by the scheduler's request id, so an answer names the
    earlier request it diverged from by the id its own tenant was given, never by the scheduler's
    id, which counts every tenant's requests. Bounded to `size` (least recently added or named go
    first); one scheduler's (a new one after a reset starts it over, as its ids do). Engine
    thread only: it adds at `Accepted` and names at `FinishEvent`."""

    def __init__(self, size: int = COMPLETION_IDS):
        self.size = size
        self._ids: OrderedDict[int, tuple[str, str]] = OrderedDict()  # request id -> (namespace, id)
        self._scheduler = lambda: None   # a weak reference to the scheduler the ids are of

    def _of(self, scheduler) -> OrderedDict[int, tuple[str, str]]:
        if self._scheduler() is not scheduler:
            self._ids.clear()
            self._scheduler = weakref.ref(scheduler)
        return self._ids

    def add(self, scheduler, request_id: int, namespace: str, completion_id: str) -> None:
        ids = self._of(scheduler)
        ids[request_id] = (namespace, completion_id)
        if len(ids) > self.size:
            ids.popitem(last=False)

    def name(self, scheduler, request_id: int | None, namespace: str) -> str | None:
        """The completion id `request_id` was answered with, when it was served in `namespace`
        and is still remembered; else None."""
        ids = self._of(scheduler)
        known = ids.get(request_id) if request_id is not None else None
        if known is None or known[0] != namespace:
            return None
        ids.move_to_end(request_id)
        return known[1]


@dataclass
class Backend:
    """What the HTTP side may read: the engine loop, the model once loaded, the latest stats row."""

    loop: EngineLoop
    model: Callable[[], object | None]
    stats: Callable[[], dict]
    load_error: Callable[[], str | None] = lambda: None
    state: Callable[[], str] = lambda: "serving"   # the engine thread's: loading/failed/serving/dead
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    info: Callable[[], dict] = dict  # what /health adds once loaded (the KV budget)
    friendliness: Friendliness = field(init=False)
    ttft: metrics.TtftHistogram = field(default_factory=metrics.TtftHistogram)
    # every served job's events, after the server's own books (engine thread): the desktop's
    # cards, the Advisor tab's recording
    watchers: list[Callable[[Job, object], None]] = field(default_factory=list)
    completions: CompletionIds = field(default_factory=CompletionIds)

    def __post_init__(self):
        self.friendliness = Friendliness(lambda: getattr(self.model(), "tokenizer", None))
        self.probes = AdmissionProbe()
        self.loop.observers.append(self.probes)

    def close(self) -> None:
        """Stop probing the loop's queue (the loop may outlive this server: the desktop's)."""
        if self.probes in self.loop.observers:
            self.loop.observers.remove(self.probes)

    def submit(self, job: Job, deliver: Callable[[object], None]) -> int:
        """Hand a served job to the loop: its events feed the server's books and the watchers,
        then `deliver` (the request's own queue). Returns its ticket."""
        job.sink = lambda event: self._event(job, event, deliver)
        return self.loop.submit(job)

    def _event(self, job: Job, event, deliver: Callable[[object], None]) -> None:
        if isinstance(event, FinishEvent):
            self.friendliness.observe(job, event, self.probes.take(job.ticket))
            self.ttft.observe(event)
        elif isinstance(event, Refused):
            self.probes.take(job.ticket)
        for watch in list(self.watchers):
            watch(job, event)
        deliver(event)


def tenant_of(key: str) -> str:
    """A stable, non-secret cache namespace for an API key."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def namespace_of(tenant: str, salt: str) -> str:
    """The API key's tenant plus the request's cache_salt: two tenants never share a page."""
    return f"{tenant}/{salt}" if tenant else salt


def sse(obj) -> str:
    """One Server-Sent Events message (strict JSON, as JSONResponse writes: never NaN or Infinity)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def model_id(model) -> str:
    """The id clients see: the GGUF file name."""
    return os.path.basename(model.path)


def create_app(backend: Backend, api_keys: list[str] | None = None, cors: bool = False, *,
               host: str = "127.0.0.1", allowed_hosts: list[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics_key: str | None = None) -> FastAPI:
    """The server's ASGI app; `api_keys` empty: no authentication. It answers Host names of this
    machine and `host` (plus `allowed_hosts`; "*": any) and bodies up to `max_body_bytes`.
    `/metrics` counts every tenant's traffic: with `api_keys` (or `metrics_key`) it answers the
    bearer of `metrics_key` only."""
    app = FastAPI(title="PrefixLab", docs_url=None, redoc_url=None, openapi_url=None)
    keys = {k: tenant_of(k) for k in (api_keys or [])}
    app.add_middleware(Guard, allowed_hosts=local_hosts(host, allowed_hosts), max_body_bytes=max_body_bytes)
    if cors:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    _answer_errors_as_objects(app)
    _add_routes(app, backend, keys, metrics_key)
    return app


def _answer_errors_as_objects(app: FastAPI) -> None:
    """Every error an OpenAI error object: ours, Starlette's (404, 405), validation, the rest."""

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        message = "not found" if e.status_code == 404 else str(e.detail)
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        return JSONResponse(error_body(400, f"invalid request: {e.errors()!r:.300}"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


def _tenant_checker(keys: dict[str, str]) -> Callable[[Request], str]:
    """A request's tenant from its bearer key (401 when keys are set and it has none of them)."""

    def tenant(request: Request) -> str:
        if not keys:
            return ""
        given = _bearer(request)
        for key, name in keys.items():
            if hmac.compare_digest(given.encode(), key.encode()):
                return name
        raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>'" if given else
                       "missing API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")

    return tenant


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def _operator_checker(keys: dict[str, str], metrics_key: str | None) -> Callable[[Request], None]:
    """A 401 for a /metrics scrape without `metrics_key` when one is set or tenants are: its
    counts of requests, tokens and queued requests are every tenant's traffic."""

    def operator(request: Request) -> None:
        if not keys and not metrics_key:
            return
        if not metrics_key:
            raise ApiError(401, "with --api-key, /metrics serves the operator only: start the server "
                           "with --metrics-key KEY and scrape with 'Authorization: Bearer KEY'",
                           None, "invalid_api_key")
        if not hmac.compare_digest(_bearer(request).encode(), metrics_key.encode()):
            raise ApiError(401, "/metrics needs the --metrics-key: send 'Authorization: Bearer <key>'",
                           None, "invalid_api_key")

    return operator


def _add_routes(app: FastAPI, backend: Backend, keys: dict[str, str], metrics_key: str | None) -> None:
    """The endpoints; `keys` maps each API key to its tenant (empty: no authentication)."""
    tenant = _tenant_checker(keys)
    operator = _operator_checker(keys, metrics_key)

    def loaded_model():
        model = backend.model()
        if model is None:
            error = backend.load_error()
            raise ApiError(503, f"the model failed to load: {error}" if error else "the model is loading",
                           None, "model_not_ready")
        return model

    @app.get("/health")
    async def health():
        if backend.model() is None:
            error = backend.load_error()
            return JSONResponse({"status": "error" if error else "loading", "error": error}, status_code=503)
        if backend.state() == "dead":
            return JSONResponse({"status": "error", "error": "the engine loop stopped"}, status_code=503)
        return {"status": "ok", **backend.info()}

    @app.get("/metrics")
    async def prometheus(request: Request):
        operator(request)
        text = metrics.render(backend.stats(), backend.ttft, backend.model() is not None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        tenant(request)
        model = loaded_model()
        return {"object": "list", "data": [{"id": model_id(model), "object": "model",
                                            "created": int(os.path.getmtime(model.path)),
                                            "owned_by": "prefixlab"}]}

    @app.get("/v1/prefixlab/friendliness")
    async def friendliness(request: Request):
        # with API keys each tenant sees its own clients only (their prompts' text is in here)
        return backend.friendliness.to_dict(tenant(request) if keys else None)

    async def complete(request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        ns_tenant = tenant(request)
        raw = await request.body()
        # decoding, checking and tokenizing a large body take long: off the event loop, so
        # /health and the other clients' streams go on meanwhile
        req = await asyncio.to_thread(_parse, raw, chat)
        model = loaded_model()
        check_logit_bias(req, model.config.vocab_size)
        remote = request.client.host if request.client else "?"
        client = f"http {remote} model={req.model[:MAX_LABEL_CHARS] or '-'} user={req.user or '-'}"
        namespace = namespace_of(ns_tenant, req.cache_salt)
        chat_args = await asyncio.to_thread(_chat_args, req, model, namespace, backend.default_max_tokens)
        answer = _Answer(req, new_id(chat), model_id(model))
        call = _Call(backend, asyncio.get_running_loop(), answer.rid, namespace)
        # the job carries the caller's tenant: views of served traffic show each tenant its own
        call.submit(Job(chat_args, client=client, arrival=arrival, tenant=ns_tenant))
        first = await call.next()
        if isinstance(first, Refused):
            raise ApiError(first.status, first.message, None,
                           "server_busy" if first.status == 503 else "invalid_request")
        if req.stream:
            return StreamingResponse(_stream(call, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, call, answer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)


def _parse(raw: bytes, chat: bool) -> ParsedRequest:
    """A checked request from the raw body; ApiError (400) for bad JSON, too deep or not."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    return parse_chat(body) if chat else parse_completion(body)


def _chat_args(req: ParsedRequest, model, namespace: str, default_max_tokens: int | None) -> dict:
    """`ChatFrontEnd.request` arguments (the context stops an answer before any max_tokens does)."""
    max_new = min(req.max_tokens or default_max_tokens or model.config.context_length,
                  model.config.context_length)
    common = {"sampling": req.sampling, "max_new_tokens": max_new, "namespace": namespace}
    if req.ignore_eos:
        common["stop_ids"] = []  # exactly max_tokens tokens (benchmarks)
    if req.chat:
        last_user = next((m["content"] for m in reversed(req.messages) if m["role"] == "user"), "")
        return {"messages": req.messages, "preview": last_user[:60], **common}
    # a text prompt starts with the BOS the model wants (Gemma), as llama.cpp's server adds it
    ids = req.prompt_ids if req.prompt_ids is not None else model.tokenizer.encode_prompt(req.prompt_text)
    preview = req.prompt_text[-60:] if req.prompt_text else ""
    return {"prompt": ids, "preview": preview, **common}


class _Call:
    """One request's link to the engine thread: events arrive on an asyncio queue. Its
    completion id goes into the backend's books when the scheduler accepts it, and at its finish
    `diverged_from` names the caller's own earlier completion its prompt departs from."""

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop, completion_id: str, namespace: str):
        self.backend, self.loop = backend, loop
        self.completion_id, self.namespace = completion_id, namespace
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ticket = 0
        self.done = False
        self.diverged_from: str | None = None

    def sink(self, event) -> None:  # engine thread: the scheduler whose ids these are is current
        scheduler = self.backend.loop.scheduler
        if isinstance(event, Accepted):
            self.backend.completions.add(scheduler, event.request_id, self.namespace, self.completion_id)
        elif isinstance(event, FinishEvent):
            tenant = event.record.tenant
            self.diverged_from = self.backend.completions.name(
                scheduler, tenant.diverged_from if tenant is not None else None, self.namespace)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def submit(self, job: Job) -> None:
        self.ticket = self.backend.submit(job, self.sink)

    async def next(self):
        event = await self.queue.get()
        if isinstance(event, (Refused, FinishEvent)):
            self.done = True
        return event

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.done:
            self.backend.loop.cancel(self.ticket, reason)


class _Answer:
    """The text so far, cut at stop strings; the finish reason once known."""

    def __init__(self, req: ParsedRequest, rid: str, model: str):
        self.req, self.rid, self.model = req, rid, model
        self.stops = StopFilter(req.stop)
        self.parts: list[str] = []

    def piece(self, call: _Call, event: TokenEvent) -> str:
        text = self.stops.feed(event.text)
        if self.stops.stopped:
            call.cancel("stop")  # a stop string: the rest of the answer is not wanted
        self.parts.append(text)
        return text

    def finish(self, event: FinishEvent) -> tuple[str, str]:
        tail = self.stops.flush()
        self.parts.append(tail)
        reason = "length" if event.reason == "length" and not self.stops.stopped else "stop"
        return tail, reason


async def _stream(call: _Call, answer: _Answer):
    """SSE chunks: the role, the text pieces, the finish, the usage if asked, then [DONE]."""
    req, rid, model = answer.req, answer.rid, answer.model
    try:
        if req.chat:
            yield sse(chunk(req, rid, model, role=True))
        while True:
            event = await call.next()
            if isinstance(event, TokenEvent):
                text = answer.piece(call, event)
                if text:
                    yield sse(chunk(req, rid, model, text))
            elif isinstance(event, FinishEvent):
                tail, reason = answer.finish(event)
                if tail:
                    yield sse(chunk(req, rid, model, tail))
                yield sse(chunk(req, rid, model, finish=reason))
                if req.include_usage:
                    yield sse(usage_chunk(req, rid, model, event.record, call.diverged_from))
                yield "data: [DONE]\n\n"
                return
            elif isinstance(event, Refused):
                yield sse(error_body(event.status, event.message))
                return
    finally:
        if not call.done:
            log.warning("prefixlab serve: %s: the client disconnected mid-stream; request cancelled", rid)
        call.cancel()  # the client went away (or we stopped): its pages go back


async def _whole(request: Request, call: _Call, answer: _Answer) -> Response:
    """Collect the answer; a client that hangs up meanwhile cancels it."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(call.next(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    log.warning("prefixlab serve: %s: the client disconnected; request cancelled", answer.rid)
                    return Response(status_code=499)
                continue
            if isinstance(event, TokenEvent):
                answer.piece(call, event)
            elif isinstance(event, FinishEvent):
                _, reason = answer.finish(event)
                return JSONResponse(response(answer.req, answer.rid, answer.model, "".join(answer.parts),
                                             reason, event.record, call.diverged_from))
            elif isinstance(event, Refused):
                raise ApiError(event.status, event.message)
    finally:
        call.cancel()
