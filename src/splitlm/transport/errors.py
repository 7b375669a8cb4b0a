"""Error codes carried by ERROR frames."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    BAD_FRAME = 1  # undecodable header, metadata or tensor
    VERSION_MISMATCH = 2
    FINGERPRINT_MISMATCH = 3  # edge and cloud shards come from different splits
    NOT_READY = 4  # a request before a successful HELLO
    UNKNOWN_SESSION = 5
    BAD_REQUEST = 6  # well-formed frame with invalid content (shapes, positions, indices)
    TOO_LARGE = 7  # frame or tensor over the limits
    LIMIT_EXCEEDED = 8  # sessions, tokens per session
    INTERNAL = 9


class ProtocolError(Exception):
    """A failure that becomes (or came from) an ERROR frame."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message
