"""An OpenAI-compatible HTTP API on the edge: apps talk to localhost, text never leaves the machine.

    GET  /v1/models               the served model
    POST /v1/chat/completions     chat (messages in the model's chat template)
    POST /v1/completions          raw text or token ids
    GET  /metrics                 Prometheus text format
    GET  /healthz                 the edge's state and the cloud's (200 when both are up, else 503)

Both POST routes stream with `"stream": true` (server-sent events, `data: [DONE]` at the end).
Each request runs in a worker thread with its own cloud connection and session, so concurrent
requests never share a cloud session. All requests use speculative decoding: greedy ones by
argmax acceptance, sampled ones by exact speculative sampling (distributed as plain sampling).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitlm import SplitLMError
from splitlm.decoding.grammar import GrammarError
from splitlm.decoding.modes import SpecConfig
from splitlm.edge.api_answer import AnswerBuilder, TokenBytes
from splitlm.edge.api_disconnects import CLIENT_GONE, unless_gone
from splitlm.edge.api_errors import guarded
from splitlm.edge.api_metrics import EdgeMetrics, PrefixPoolCollector, RequestClock
from splitlm.edge.api_requests import (
    APIError,
    GenerationRequest,
    check_length,
    cloud_failure,
    invalid,
    parse_chat,
    parse_completion,
)
from splitlm.edge.api_responses import Chunks, completion_body, sse
from splitlm.edge.api_tools import template_input
from splitlm.edge.prefix_pool import PoolLimits, PrefixPool
from splitlm.edge.runtime import Edge, GenerationResult
from splitlm.transport.client import CloudError

log = logging.getLogger(__name__)


@dataclass
class APIConfig:
    model_name: str = "splitlm"
    api_key: str | None = None  # None = no authentication (loopback use)
    spec: str | SpecConfig = "auto"  # speculative mode (greedy and sampled requests)
    max_concurrent: int = 4  # requests generating at once; more wait
    default_temperature: float = 1.0  # what an omitted temperature means (OpenAI's default is 1)
    default_max_tokens: int = 2048  # an omitted max_tokens: this, or what the context leaves
    prefix_pool: PoolLimits = field(default_factory=PoolLimits)  # conversation states reused (docs/prefix-reuse.md)


class EdgeAPI:
    """The routes over one `Edge`; `app` is the ASGI application."""

    def __init__(self, edge: Edge, config: APIConfig | None = None):
        self.edge, self.config = edge, config or APIConfig()
        self.metrics = EdgeMetrics()
        self.pool = PrefixPool(edge, self.config.prefix_pool)  # before any request (generate reads it)
        self.metrics.registry.register(PrefixPoolCollector(self.pool))
        self.executor = ThreadPoolExecutor(self.config.max_concurrent, thread_name_prefix="splitlm-generate")
        self.created = int(time.time())
        self.fingerprint = f"splitlm-{edge.model.manifest.fingerprint[:16]}"
        self.token_bytes = TokenBytes(edge.text)  # each token's bytes, for logprobs
        routes = [
            Route(path, guarded(endpoint, self.internal_error), methods=[method])
            for path, endpoint, method in (
                ("/v1/models", self.models, "GET"),
                ("/v1/models/{model:path}", self.model, "GET"),
                ("/v1/chat/completions", self.chat_completions, "POST"),
                ("/v1/completions", self.completions, "POST"),
                ("/metrics", self.metrics_text, "GET"),
                ("/healthz", self.healthz, "GET"),
            )
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                APIError: self.api_error,
                HTTPException: self.http_error,
                ClientDisconnect: self.client_gone,
                Exception: self.internal_error,
            },
        )

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()

    # -- errors and auth ---------------------------------------------------------------------------
    async def api_error(self, request: Request, exc: APIError) -> JSONResponse:
        self.metrics.errors.labels(type=exc.type).inc()
        self.metrics.requests.labels(endpoint=request.url.path, status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        message = {
            404: f"unknown URL {request.method} {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, exc.detail)
        return await self.api_error(
            request, APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        )

    async def client_gone(self, request: Request, exc: ClientDisconnect) -> Response:
        """The client went away before its answer: nothing to send, a 499 (nginx's) in the log and metrics."""
        self.metrics.requests.labels(endpoint=request.url.path, status=str(CLIENT_GONE)).inc()
        return Response(status_code=CLIENT_GONE)

    async def internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return await self.api_error(request, APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not scheme:
            raise APIError(
                401,
                "no API key given: send 'Authorization: Bearer KEY'",
                "invalid_request_error",
                code="invalid_api_key",
            )
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                f"the Authorization header must read 'Bearer KEY', not {scheme!r}",
                "invalid_request_error",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key", "invalid_request_error", code="invalid_api_key")

    async def body(self, request: Request):
        self.authorize(request)
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )

    # -- routes ------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "splitlm"}

    async def models(self, request: Request) -> JSONResponse:
        self.authorize(request)
        self.metrics.requests.labels(endpoint="/v1/models", status="200").inc()
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        self.authorize(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self.model_card())

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: Request) -> Response:
        tls_ca = self.edge.connections.tls_ca
        clouds = await asyncio.gather(*(asyncio.to_thread(cloud_health, url, tls_ca) for url in self.edge.cloud_urls))
        up = [c for c in clouds if c["status"] == "ok"]
        # "cloud": one that answers (requests fail over to it), else the first; "clouds": every URL of --cloud
        return JSONResponse(
            {
                "status": "ok" if up else "degraded",
                "model": self.config.model_name,
                "cloud": (up or clouds)[0],
                "clouds": list(clouds),
            },
            status_code=200 if up else 503,
        )

    async def chat_completions(self, request: Request) -> Response:
        req = parse_chat(await self.body(request), self.config.default_temperature)
        self.check_model(req.model)
        check_length(sum(len(t.content) for t in req.turns), "messages", self.edge.text, self.edge.context_length)
        try:
            messages, tools = template_input(req.turns, req.tools, self.edge.text.template_takes_tools)
            prompt_ids = await asyncio.to_thread(self.edge.encode_messages, messages, tools)
        except SplitLMError as e:
            raise invalid("messages", str(e)) from None
        return await self.respond(request, "/v1/chat/completions", req, prompt_ids, chat=True)

    async def completions(self, request: Request) -> Response:
        req = parse_completion(await self.body(request), self.edge.cfg.vocab_size, self.config.default_temperature)
        self.check_model(req.model)
        if isinstance(req.prompt, str):
            check_length(len(req.prompt), "prompt", self.edge.text, self.edge.context_length)
            try:
                prompt_ids = await asyncio.to_thread(self.edge.encode, req.prompt)
            except SplitLMError as e:
                raise invalid("prompt", str(e)) from None
        else:
            prompt_ids = req.prompt
        return await self.respond(request, "/v1/completions", req, prompt_ids, chat=False)

    # -- generation --------------------------------------------------------------------------------
    def max_tokens(self, req: GenerationRequest, prompt_ids: list[int], param: str) -> int:
        room = self.edge.context_length - len(prompt_ids)
        if req.max_tokens is None:
            if room < 1:
                raise invalid(
                    param,
                    f"the prompt has {len(prompt_ids)} tokens; the context holds {self.edge.context_length}",
                    "context_length_exceeded",
                )
            return min(room, self.config.default_max_tokens)
        if req.max_tokens > room:
            raise invalid(
                param,
                f"this model's context holds {self.edge.context_length} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {req.max_tokens} more",
                "context_length_exceeded",
            )
        return req.max_tokens

    def check_grammar(self, req: GenerationRequest) -> None:
        """A 400 naming the parameter when the request's grammar (response_format, forced tool calls)
        does not compile for this model."""
        if req.grammar is not None:
            try:
                self.edge.grammars.compile(req.grammar)
            except GrammarError as e:
                raise invalid(req.grammar_param or "response_format", str(e), "invalid_schema") from None

    def generate(
        self,
        req: GenerationRequest,
        prompt_ids: list[int],
        max_tokens: int,
        cancel: threading.Event,
        emit,
        clock: RequestClock,
        logprobs=None,
    ) -> GenerationResult | None:
        """In a worker thread: generate, calling emit(text) per piece; None if cancelled. `logprobs`: the
        request's `LogprobRecorder`."""
        self.metrics.started(clock)
        try:
            if cancel.is_set():
                return None
            stream = self.pool.stream(
                prompt_ids,
                max_tokens,
                spec=self.config.spec,
                sampling=req.sampling,
                stop=req.stop,
                cache_policy=req.cache_policy,
                response_format=req.grammar,
                logprobs=logprobs,
                interrupt=cancel.is_set,
            )  # a long prefill stops too
            for piece in stream:
                if cancel.is_set():
                    stream.close()
                    return None
                emit(piece)
            return stream.result  # None: interrupted during its prefill
        finally:
            self.metrics.ended()

    async def respond(
        self, request: Request, endpoint: str, req: GenerationRequest, prompt_ids: list[int], chat: bool
    ) -> Response:
        max_tokens = self.max_tokens(req, prompt_ids, "messages" if chat else "prompt")
        if req.cache_policy is not None and not self.edge.cache_policy.allows(req.cache_policy):
            raise invalid(
                "cache_policy",
                f"cache_policy {req.cache_policy} is looser than this server's "
                f"({self.edge.cache_policy}): a request may only tighten it",
            )
        await asyncio.to_thread(self.check_grammar, req)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        answer = AnswerBuilder(req, chat, self.token_bytes)

        def emit(piece: str) -> None:
            if req.stream:
                loop.call_soon_threadsafe(queue.put_nowait, answer.piece(piece))

        clock = self.metrics.arrived()
        job = loop.run_in_executor(
            self.executor, self.generate, req, prompt_ids, max_tokens, cancel, emit, clock, answer.recorder
        )
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        job.add_done_callback(lambda _: self.metrics.left(clock))
        if not req.stream:
            try:
                result = await unless_gone(request, job)  # a client that goes away stops its generation
            except (CloudError, SplitLMError) as e:
                raise cloud_failure(e) from None
            finally:
                cancel.set()
            self.metrics.finished(endpoint, result, clock)
            RequestNote.of(result)
            self.metrics.requests.labels(endpoint=endpoint, status="200").inc()
            whole = answer.whole(result)
            return JSONResponse(
                completion_body(
                    rid,
                    chat,
                    result,
                    self.config.model_name,
                    self.fingerprint,
                    whole,
                    answer.logprobs_body(whole.logprobs),
                )
            )
        try:  # a failure before the first token still gets an error status
            first = await unless_gone(request, asyncio.ensure_future(queue.get()))
        except ClientDisconnect:
            cancel.set()
            job.cancel()
            raise
        if first is None and isinstance(job.exception(), CloudError | SplitLMError):
            raise cloud_failure(job.exception())
        self.metrics.requests.labels(endpoint=endpoint, status="200").inc()
        return StreamingResponse(
            self.events(endpoint, rid, chat, req, first, queue, job, cancel, clock, answer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def events(
        self, endpoint, rid, chat, req, first, queue, job, cancel, clock, answer: AnswerBuilder
    ) -> AsyncIterator[str]:
        """SSE chunks: the role (chat), the text pieces from `first` on, the tool calls, the finish
        reason, usage, [DONE]."""
        out = Chunks(rid, chat, self.config.model_name, self.fingerprint, answer)
        try:
            if chat:
                yield sse(out.chunk(None, role=True))
            piece = first
            while piece is not None:
                if (c := out.delta(piece)) is not None:
                    yield sse(c)
                piece = await queue.get()
            try:
                result = job.result()
            except (CloudError, SplitLMError) as e:
                err = cloud_failure(e)
            except Exception as e:  # a bug: the stream ends with an error event, the server goes on
                log.exception("internal error while streaming")
                err = APIError(500, f"internal error: {type(e).__name__}", "server_error")
            else:
                err = None
            if err is not None:
                self.metrics.errors.labels(type=err.type).inc()
                yield sse(err.body())
                return
            if result is None:
                return
            self.metrics.finished(endpoint, result, clock)
            RequestNote.of(result)
            for c in out.last(req.include_usage, result):
                yield sse(c)
            yield sse("[DONE]")
        finally:
            cancel.set()  # the client went away (or we are done): stop generating


def cloud_health(url: str, tls_ca: str | None = None, timeout_s: float = 3.0) -> dict:
    """The cloud's own /healthz (on its WebSocket port): {"url", "status": "ok"|"unreachable", ...}."""
    import ssl
    import urllib.request

    http = url.replace("wss://", "https://", 1).replace("ws://", "http://", 1).rstrip("/") + "/healthz"
    context = ssl.create_default_context(cafile=tls_ca) if http.startswith("https://") else None
    try:
        with urllib.request.urlopen(http, timeout=timeout_s, context=context) as r:
            status, fingerprint, *_ = r.read().decode().split() + ["", ""]
    except (OSError, ValueError) as e:
        return {"url": url, "status": "unreachable", "error": str(getattr(e, "reason", None) or e)}
    return {"url": url, "status": "ok" if status == "ok" else status, "fingerprint": fingerprint}


@dataclass
class RequestNote:
    """What a generation request's log line adds: its prompt tokens and how many were reused."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    @staticmethod
    def of(result: GenerationResult) -> None:
        """Note a finished request's counts for `RequestLog` (in the request's context)."""
        if (note := REQUEST_NOTE.get()) is not None:
            note.prompt_tokens, note.cached_tokens = len(result.prompt_ids), result.stats.cached_tokens

    def __str__(self) -> str:
        return f", {self.prompt_tokens} prompt tokens, {self.cached_tokens} reused" if self.prompt_tokens else ""


REQUEST_NOTE: ContextVar[RequestNote | None] = ContextVar("splitlm_request_note", default=None)


class RequestLog:
    """ASGI middleware: one log line per request (method, route, status, duration, and for a generation
    its prompt tokens and how many were reused from the prefix pool; never any text)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        note = RequestNote()
        REQUEST_NOTE.set(note)  # this task's context, and the tasks it starts (a streamed body)
        try:
            await self.app(scope, receive, sending)
        finally:
            quiet = scope["path"] in ("/healthz", "/metrics")  # polled: only with -v
            (log.debug if quiet else log.info)(
                "%s %s %d %.0f ms%s",
                scope["method"],
                scope["path"],
                status[0],
                (time.perf_counter() - start) * 1000,
                note,
            )


def listen_socket(host: str, port: int):
    """A bound, listening socket, so that a busy port is an error before anything claims to serve."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SplitLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except OverflowError:
        sock.close()
        raise SplitLMError(f"cannot listen on {host}:{port}: not a port number") from None
    return sock


@contextlib.contextmanager
def serving(app, log_level: str = "warning", timeout_s: float = 30.0) -> Iterator[str]:
    """Serve an ASGI `app` (an `EdgeAPI`'s, possibly wrapped) with uvicorn in a thread on a free loopback
    port, for tests and benchmarks; yields its base URL once it has started (or `timeout_s` passed)."""
    import uvicorn

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def serve(edge: Edge, config: APIConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API with uvicorn until interrupted."""
    import uvicorn

    sock = listen_socket(host, port)
    api = EdgeAPI(edge, config)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it can use the model", host)
    log.info(
        "serving model '%s' on http://%s:%d/v1 (cloud %s%s)",
        config.model_name,
        host,
        sock.getsockname()[1],
        ",".join(edge.cloud_urls),
        ", API key required" if config.api_key else "",
    )
    server = uvicorn.Server(uvicorn.Config(RequestLog(api.app), log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        api.close()
        sock.close()
