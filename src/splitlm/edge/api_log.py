"""serve-edge's request log: one line per request (`RequestLog`), to which a generation adds its
prompt tokens and how many were reused from the prefix pool (`RequestNote`); never any text."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from splitlm.edge.results import GenerationResult

log = logging.getLogger(__name__)


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
