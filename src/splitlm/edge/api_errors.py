"""OpenAI-style errors of serve-edge: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from splitlm.decoding.grammar import GrammarError
from splitlm.transport.errors import ErrorCode

CAPACITY_RETRY_AFTER_S = 2


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def cloud_failure(e: Exception) -> APIError:
    """A failed generation: 503 with Retry-After when the cloud is at its KV capacity, 400 when the
    request needs more KV memory than the cloud's whole budget (it never fits there), 500 when the edge's
    grammar engine failed, else 502."""
    if getattr(e, "code", None) == ErrorCode.EXCEEDS_BUDGET:
        return APIError(400, f"the request is too large for the cloud's memory: {e}", code="cloud_budget_exceeded")
    if getattr(e, "code", None) == ErrorCode.CAPACITY:
        return APIError(
            503,
            f"the cloud is at capacity: {e}",
            "server_error",
            code="cloud_capacity",
            headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)},
        )
    if isinstance(e, GrammarError):  # the edge's own constrained decoding, not the cloud
        return APIError(500, f"constrained decoding failed on the edge: {e}", "server_error", code="grammar_error")
    return APIError(502, f"the cloud failed: {e}", "server_error", code="cloud_error")


def invalid(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    """A 400 that names the request parameter at fault."""
    return APIError(400, message, param=param, code=code)


def guarded(endpoint, on_error):
    """`endpoint` with an unexpected exception answered by `on_error` (a 500) here: Starlette's
    handler of last resort re-raises it after answering, and the server then drops the keep-alive
    connection under the client."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except (APIError, HTTPException, ClientDisconnect):
            raise
        except Exception as exc:
            return await on_error(request, exc)

    return run
