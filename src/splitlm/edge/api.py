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
import hmac
import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitlm import SplitLMError
from splitlm.edge.api_config import APIConfig
from splitlm.edge.api_disconnects import CLIENT_GONE
from splitlm.edge.api_errors import guarded
from splitlm.edge.api_generation import Responder
from splitlm.edge.api_metrics import EdgeMetrics, PrefixPoolCollector
from splitlm.edge.api_requests import APIError, check_length, invalid, parse_chat, parse_completion
from splitlm.edge.api_tools import template_input
from splitlm.edge.prefix_pool import PrefixPool
from splitlm.edge.runtime import Edge

log = logging.getLogger(__name__)

__all__ = ["APIConfig", "EdgeAPI", "cloud_health"]


class EdgeAPI:
    """The routes over one `Edge`; `app` is the ASGI application. `pool`: the prefix pool its generations
    run on (default: one of `config.prefix_pool`'s limits); `Responder` runs and answers them."""

    def __init__(self, edge: Edge, config: APIConfig | None = None, pool: PrefixPool | None = None):
        self.edge, self.config = edge, config or APIConfig()
        self.metrics = EdgeMetrics()
        self.pool = pool or PrefixPool(edge, self.config.prefix_pool)  # before any request (generate reads it)
        self.metrics.registry.register(PrefixPoolCollector(self.pool))
        self.responder = Responder(edge, self.pool, self.metrics, self.config)
        self.created = int(time.time())
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
        self.responder.close()
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
            prompt_ids = await asyncio.to_thread(self.edge.text.encode_messages, messages, tools)
        except SplitLMError as e:
            raise invalid("messages", str(e)) from None
        return await self.responder.respond(request, "/v1/chat/completions", req, prompt_ids, chat=True)

    async def completions(self, request: Request) -> Response:
        req = parse_completion(await self.body(request), self.edge.cfg.vocab_size, self.config.default_temperature)
        self.check_model(req.model)
        if isinstance(req.prompt, str):
            check_length(len(req.prompt), "prompt", self.edge.text, self.edge.context_length)
            try:
                prompt_ids = await asyncio.to_thread(self.edge.text.encode, req.prompt)
            except SplitLMError as e:
                raise invalid("prompt", str(e)) from None
        else:
            prompt_ids = req.prompt
        return await self.responder.respond(request, "/v1/completions", req, prompt_ids, chat=False)


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
