"""The edge's connections to its clouds: one per request at a time (idle ones wait in a pool), the
list of clouds to fail over to, and reconnecting with backoff (docs/failover.md).

    connections = CloudConnections(["wss://a:8765", "wss://b:8765"], ClientSettings(fingerprint))
    client, session_id = connections.open_session(Open("fp16", CachePolicy.parse("session")))
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from splitlm import SplitLMError
from splitlm.transport.client import PING_INTERVAL_S, ClientOptions, CloudClient, CloudError
from splitlm.transport.crypto import RekeyPolicy
from splitlm.transport.errors import ErrorCode
from splitlm.transport.keys import Identity
from splitlm.transport.messages import Open

log = logging.getLogger(__name__)

FAILOVER_TIMEOUT_S = 30.0  # how long a session keeps trying to reach a cloud after losing its own
FAILOVER_BACKOFF_S = 0.05  # the first wait between rounds of the cloud list; doubles up to the max
FAILOVER_BACKOFF_MAX_S = 2.0
# how long a session keeps retrying a cloud that answers CAPACITY (it is up, its KV memory is full):
# the cloud lets the oldest requests finish first, so a younger one may wait several generations
CAPACITY_TIMEOUT_S = 300.0

T = TypeVar("T")


def parse_cloud_urls(urls: str | list[str]) -> list[str]:
    """Cloud URLs from a list or a comma-separated string."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip() for u in items if u.strip()]
    if not out:
        raise SplitLMError("no cloud URL given")
    return out


class Pool(Generic[T]):
    """Objects that serve one request at a time: take an idle one, or make a new one."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._idle: list[T] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[T, bool]:
        """(object, whether it was idle in the pool rather than just made)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._make(), False

    def give(self, obj: T) -> None:
        with self._lock:
            self._idle.append(obj)

    @property
    def idle(self) -> int:
        """How many objects wait in the pool."""
        with self._lock:
            return len(self._idle)


@dataclass(frozen=True)
class ClientSettings:
    """How each connection to a cloud is made: `splitlm.transport.client.CloudClient`'s arguments but the URL
    (the keepalive pings' timeout is their interval)."""

    fingerprint: str  # the edge shard's: the cloud must serve the matching cloud shard
    timeout_s: float = 60.0
    identity: Identity | str | Path | None = None
    cloud_key: str | bytes | None = None
    known_hosts: str | Path | None = None
    tls_ca: str | Path | None = None
    rekey: RekeyPolicy | None = None
    ping_interval_s: float | None = PING_INTERVAL_S

    def connect(self, url: str, open_timeout_s: float | None = None) -> CloudClient:
        """A new connection to `url`; `open_timeout_s` caps the time to open it (not its requests')."""
        timeout_s = self.timeout_s if open_timeout_s is None else min(self.timeout_s, max(open_timeout_s, 0.1))
        options = ClientOptions(
            timeout_s=timeout_s,
            identity=self.identity,
            cloud_key=self.cloud_key,
            known_hosts=self.known_hosts,
            tls_ca=self.tls_ca,
            rekey=self.rekey,
            ping_interval_s=self.ping_interval_s,
            ping_timeout_s=self.ping_interval_s,
        )
        client = CloudClient(url, self.fingerprint, options)
        client.timeout_s = self.timeout_s
        return client


class CloudConnections:
    """The edge's connections to the clouds of `urls` (each serves the same cloud shard). A request
    takes a connection of its own (`open_session`) and gives it back when done (`give`), or drops it
    when it failed (`drop`); after a lost cloud, `reconnect` tries the next one, with backoff."""

    def __init__(
        self,
        urls: str | list[str],
        settings: ClientSettings,
        failover_timeout_s: float = FAILOVER_TIMEOUT_S,
        capacity_timeout_s: float = CAPACITY_TIMEOUT_S,
    ):
        self.urls = parse_cloud_urls(urls)
        self.settings = settings
        self.failover_timeout_s, self.capacity_timeout_s = failover_timeout_s, capacity_timeout_s
        self._first = 0  # the URL new connections try first (the last one that worked)
        self._open: set[CloudClient] = set()  # every connection not yet closed, idle or in use
        self._lock = threading.Lock()
        self._idle: Pool[CloudClient] = Pool(self.connect)

    @property
    def tls_ca(self) -> str | Path | None:
        """The CA certificate file for wss:// URLs (None: the system's trust store)."""
        return self.settings.tls_ca

    @property
    def count(self) -> int:
        """Connections open now, idle or in use."""
        with self._lock:
            return len(self._open)

    @property
    def idle(self) -> int:
        """Connections waiting in the pool."""
        return self._idle.idle

    def __contains__(self, client: CloudClient) -> bool:
        with self._lock:
            return client in self._open

    def connect(self, after: str | None = None, open_timeout_s: float | None = None) -> CloudClient:
        """A connection to the first cloud that answers, starting with the one that worked last (or,
        with `after`, the URL after that one: a failover tries the next server first)."""
        n = len(self.urls)
        first = (self.urls.index(after) + 1) % n if after in self.urls else self._first
        for i in range(n):
            k = (first + i) % n
            try:
                client = self.settings.connect(self.urls[k], open_timeout_s)
            except CloudError as e:
                if not e.retryable or n == 1:
                    raise
                if i == n - 1:
                    raise CloudError(
                        f"none of the {n} clouds could be reached (the last: {e})", e.code, retryable=True
                    ) from None
                log.info("%s; trying the next cloud", e)
                continue
            self._first = k
            with self._lock:
                self._open.add(client)
            return client
        raise AssertionError("unreachable")

    def take(self) -> CloudClient:
        """An idle connection, or a new one."""
        return self._idle.take()[0]

    def give(self, client: CloudClient) -> None:
        """Return a connection that works to the pool."""
        self._idle.give(client)

    def drop(self, client: CloudClient) -> None:
        """Close a connection that failed (it never returns to the pool)."""
        with self._lock:
            self._open.discard(client)
        client.close()

    def open_session(self, request: Open) -> tuple[CloudClient, int]:
        """A connection of this thread's own and a new cloud session on it (failing over, as `reconnect`,
        when the cloud cannot be reached or the idle connection had gone stale)."""
        after = None
        try:
            client = self.take()
        except CloudError as e:
            if not e.retryable:
                raise
        else:
            try:
                return client, client.open(request).session
            except CloudError as e:
                self.drop(client)
                if not e.recoverable:  # gone, or full (CAPACITY): the clouds in turn, with backoff
                    raise
                after = client.url
        return self.reconnect(request, after, time.monotonic() + self.failover_timeout_s)

    def reconnect(self, request: Open, after: str | None, deadline: float) -> tuple[CloudClient, int]:
        """A new connection and session after `after` failed: the next cloud first, then round the list
        again, with exponential backoff and jitter between rounds, until `deadline` (time.monotonic())."""
        delay, started = FAILOVER_BACKOFF_S, time.monotonic()
        while True:
            client = None
            try:
                client = self.connect(after, deadline - time.monotonic())
                return client, client.open(request).session
            except CloudError as e:
                if client is not None:  # reached but refused: the next round starts after it
                    self.drop(client)
                    after = client.url
                if not e.recoverable:  # a full cloud (CAPACITY): try the next
                    raise
                left = self.give_up_at(e, deadline, started) - time.monotonic()
                if left <= 0:
                    waited = time.monotonic() - started
                    raise CloudError(f"failover gave up after {waited:.0f} s: {e}", e.code) from None
                log.info("no cloud yet (%s); retrying in %.2f s", e, delay)
                time.sleep(min(left, delay * random.uniform(0.5, 1.5)))
                delay = min(FAILOVER_BACKOFF_MAX_S, delay * 2)

    def give_up_at(self, error: CloudError, deadline: float, started: float) -> float:
        """When retrying after `error` stops (time.monotonic()): `deadline`, or for a cloud that is up
        but full (CAPACITY) `capacity_timeout_s` after `started`, if that is later."""
        if error.code == ErrorCode.CAPACITY:
            return max(deadline, started + self.capacity_timeout_s)
        return deadline

    def close(self) -> None:
        """Close every connection (idle or in use)."""
        with self._lock:
            connections, self._open = list(self._open), set()
        for client in connections:
            client.close()
