"""serve-edge's generations: a parsed request (`splitlm.edge.api_requests.APIRequest`) checked against
the model's context and the server's cache policy, run on the prefix pool in a worker thread, and
answered as one JSON body or as server-sent events (`Responder`)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from splitlm import SplitLMError
from splitlm.decoding.grammar import GrammarError
from splitlm.edge.api_answer import AnswerBuilder, TokenBytes
from splitlm.edge.api_config import APIConfig
from splitlm.edge.api_disconnects import unless_gone
from splitlm.edge.api_log import RequestNote
from splitlm.edge.api_metrics import EdgeMetrics, RequestClock
from splitlm.edge.api_requests import APIError, APIRequest, cloud_failure, invalid
from splitlm.edge.api_responses import Chunks, completion_body, sse
from splitlm.edge.prefix_pool import PrefixPool
from splitlm.edge.request import GenerationRequest
from splitlm.edge.runtime import Edge, GenerationResult
from splitlm.transport.client import CloudError

log = logging.getLogger(__name__)


@dataclass
class Answering:
    """One request being answered: what it asked, where its worker thread is, and what it has said."""

    endpoint: str
    rid: str  # the response's id
    chat: bool
    req: APIRequest
    queue: asyncio.Queue  # the worker's pieces, then None
    job: asyncio.Future  # the worker: its result, or None if cancelled
    cancel: threading.Event  # set: the worker stops
    clock: RequestClock
    answer: AnswerBuilder


class Responder:
    """Runs the API's generations (at most `max_concurrent` at once, on `pool`) and answers them."""

    def __init__(self, edge: Edge, pool: PrefixPool, metrics: EdgeMetrics, config: APIConfig):
        self.edge, self.pool, self.metrics, self.config = edge, pool, metrics, config
        self.model_name = config.model_name
        self.executor = ThreadPoolExecutor(config.max_concurrent, thread_name_prefix="splitlm-generate")
        self.fingerprint = f"splitlm-{edge.model.manifest.fingerprint[:16]}"
        self.token_bytes = TokenBytes(edge.text)  # each token's bytes, for logprobs

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def max_tokens(self, req: APIRequest, prompt_ids: list[int], param: str) -> int:
        """The request's max_tokens, checked against what the context leaves."""
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

    def check_grammar(self, req: APIRequest) -> None:
        """A 400 naming the parameter when the request's grammar (response_format, forced tool calls)
        does not compile for this model."""
        if req.grammar is not None:
            try:
                self.edge.grammars.compile(req.grammar)
            except GrammarError as e:
                raise invalid(req.grammar_param or "response_format", str(e), "invalid_schema") from None

    def check_policy(self, req: APIRequest) -> None:
        """A 400 for a cache policy looser than the server's."""
        if req.cache_policy is not None and not self.edge.cache_policy.allows(req.cache_policy):
            raise invalid(
                "cache_policy",
                f"cache_policy {req.cache_policy} is looser than this server's "
                f"({self.edge.cache_policy}): a request may only tighten it",
            )

    def generate(
        self,
        req: APIRequest,
        request: GenerationRequest,
        cancel: threading.Event,
        emit,
        clock: RequestClock,
    ) -> GenerationResult | None:
        """In a worker thread: generate `request`, calling emit(text) per piece; None if cancelled."""
        self.metrics.started(clock)
        try:
            if cancel.is_set():
                return None
            stream = self.pool.stream(request, req.cache_policy, cancel.is_set)  # a long prefill stops too
            for piece in stream:
                if cancel.is_set():
                    stream.close()
                    return None
                emit(piece)
            return stream.result  # None: interrupted during its prefill
        finally:
            self.metrics.ended()

    async def respond(
        self, request: Request, endpoint: str, req: APIRequest, prompt_ids: list[int], chat: bool
    ) -> Response:
        """Answer `req` (its prompt `prompt_ids`): one JSON body, or (`req.stream`) server-sent events."""
        max_tokens = self.max_tokens(req, prompt_ids, "messages" if chat else "prompt")
        self.check_policy(req)
        await asyncio.to_thread(self.check_grammar, req)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        answer = AnswerBuilder(req, chat, self.token_bytes)
        work = GenerationRequest(
            prompt_ids,
            max_tokens,
            spec=self.config.spec,
            sampling=req.sampling,
            stop=req.stop,
            logprobs=answer.recorder,
            response_format=req.grammar,
        )

        def emit(piece: str) -> None:
            if req.stream:
                loop.call_soon_threadsafe(queue.put_nowait, answer.piece(piece))

        clock = self.metrics.arrived()
        job = loop.run_in_executor(self.executor, self.generate, req, work, cancel, emit, clock)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        job.add_done_callback(lambda _: self.metrics.left(clock))
        run = Answering(endpoint, rid, chat, req, queue, job, cancel, clock, answer)
        if not req.stream:
            return await self.whole(request, run)
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
            self.events(run, first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def whole(self, request: Request, run: Answering) -> JSONResponse:
        """The answer in one body, once the worker is done."""
        try:
            result = await unless_gone(request, run.job)  # a client that goes away stops its generation
        except (CloudError, SplitLMError) as e:
            raise cloud_failure(e) from None
        finally:
            run.cancel.set()
        self.metrics.finished(run.endpoint, result, run.clock)
        RequestNote.of(result)
        self.metrics.requests.labels(endpoint=run.endpoint, status="200").inc()
        whole = run.answer.whole(result)
        return JSONResponse(
            completion_body(
                run.rid,
                run.chat,
                result,
                self.model_name,
                self.fingerprint,
                whole,
                run.answer.logprobs_body(whole.logprobs),
            )
        )

    async def events(self, run: Answering, first) -> AsyncIterator[str]:
        """SSE chunks: the role (chat), the text pieces from `first` on, the tool calls, the finish
        reason, usage, [DONE]."""
        out = Chunks(run.rid, run.chat, self.model_name, self.fingerprint, run.answer)
        try:
            if run.chat:
                yield sse(out.chunk(None, role=True))
            piece = first
            while piece is not None:
                if (c := out.delta(piece)) is not None:
                    yield sse(c)
                piece = await run.queue.get()
            try:
                result = run.job.result()
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
            self.metrics.finished(run.endpoint, result, run.clock)
            RequestNote.of(result)
            for c in out.last(run.req.include_usage, result):
                yield sse(c)
            yield sse("[DONE]")
        finally:
            run.cancel.set()  # the client went away (or we are done): stop generating
