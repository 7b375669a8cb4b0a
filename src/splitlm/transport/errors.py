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
    AUTH_FAILED = 10  # a peer did not prove its static key (bad HELLO_OK confirmation, client key not held, none sent)
    UNKNOWN_CLIENT = 11  # the client's static key is not on the cloud's allow-list
    DECRYPT_FAILED = 12  # an encrypted frame failed AES-GCM authentication (tampered, truncated, wrong key)
    REPLAY = 13  # a sequence number that was already accepted (or too old to tell)
    OUT_OF_ORDER = 14  # a sequence number below one already accepted, never seen itself (reordered)
    NOT_ENCRYPTED = 15  # a plaintext frame after the handshake
    SERVER_KEY_MISMATCH = 16  # edge-side only: the cloud's static key is not the pinned / known one
    POLICY = 17  # a request the session's cache policy forbids, or an attempt to loosen the policy
    SEALED_KEY = 18  # a sealed session's request without its cache key, or with a key that does not open it
    CAPACITY = 19  # the cloud's KV memory budget cannot hold a new session or this step now (retry later)
    PREEMPTED = 20  # the session's cache was freed to make room (or it sat idle): open a new one and replay
    EXCEEDS_BUDGET = 21  # the request needs more KV memory than the cloud's whole budget: it never fits (permanent)


class ProtocolError(Exception):
    """A failure that becomes (or came from) an ERROR frame."""

    MAX_MESSAGE = 300  # messages may quote peer-supplied values: keep logs and ERROR frames small

    def __init__(self, code: ErrorCode, message: str):
        if len(message) > self.MAX_MESSAGE:
            message = message[: self.MAX_MESSAGE - 3] + "..."
        super().__init__(f"{code.name}: {message}")
        self.code = ErrorCode(code)
        self.message = message
