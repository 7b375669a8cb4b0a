"""One direction of one emulated link: its timing model and the relay loop that applies it.

Per direction and per connection: a chunk read at time ``t`` first waits for the link
(``n * 8 / bandwidth`` seconds after the previous chunk finished), then travels for
``rtt/2 + uniform(-jitter, +jitter)`` (at least 0). It is never delivered before the chunk
in front of it, so the byte stream keeps its order. Reading goes on while earlier chunks
are in flight, so back-to-back messages are pipelined as on a real link. At most
``MAX_IN_FLIGHT`` bytes are held per direction before reading stops (back-pressure).
`splitlm.bench.wan` runs two of these per proxied connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass

MAX_IN_FLIGHT = 16 * 1024 * 1024  # bytes buffered per direction before reading pauses
READ_SIZE = 64 * 1024  # largest chunk read at once
MIN_SEGMENT = 1500  # smallest read size under a bandwidth cap (about one Ethernet frame)

EOF = "eof"  # the source half-closed: flush, then half-close the destination
RESET = "reset"  # the source failed: flush, then close the whole connection
WRITE_FAILED = "write-failed"  # the destination went away: drop what is left
CUT = "cut"  # a fault injected here: abort both sides


@dataclass
class WanConfig:
    """Link parameters; each direction gets ``rtt_ms / 2`` of delay and its own ``mbps``."""

    rtt_ms: float
    jitter_ms: float = 0.0
    mbps: float | None = None  # bandwidth cap per direction in Mbit/s; None = unlimited
    seed: int | None = None
    drop_after_bytes: int | None = None  # cut the link once, at this many bytes (all connections, both ways)
    drop_prob: float = 0.0  # cut a connection at any chunk with this probability

    def __post_init__(self) -> None:
        if not self.rtt_ms >= 0:
            raise ValueError(f"rtt must be >= 0 ms, got {self.rtt_ms}")
        if not self.jitter_ms >= 0:
            raise ValueError(f"jitter must be >= 0 ms, got {self.jitter_ms}")
        if self.mbps is not None and not self.mbps > 0:
            raise ValueError(f"bandwidth must be > 0 Mbit/s, got {self.mbps}")
        if self.drop_after_bytes is not None and self.drop_after_bytes < 0:
            raise ValueError(f"drop-after-bytes must be >= 0, got {self.drop_after_bytes}")
        if not 0 <= self.drop_prob <= 1:
            raise ValueError(f"drop probability must be in [0, 1], got {self.drop_prob}")

    def describe(self) -> str:
        """One-line summary, e.g. ``rtt=80ms jitter=0ms bw=unlimited``."""
        bw = "unlimited" if self.mbps is None else f"{self.mbps:g}Mbit/s"
        faults = (f" drop-after={self.drop_after_bytes}B" if self.drop_after_bytes is not None else "") + (
            f" drop-prob={self.drop_prob:g}" if self.drop_prob else ""
        )
        return f"rtt={self.rtt_ms:g}ms jitter={self.jitter_ms:g}ms bw={bw}{faults}"


class Link:
    """Timing and byte accounting for one direction of one connection."""

    def __init__(
        self,
        config: WanConfig,
        rng: random.Random,
        on_bytes: Callable[[int], None],
        gate: Callable[[int], int] = lambda n: n,
    ) -> None:
        self.config = config
        self.rng = rng
        self.on_bytes = on_bytes
        self.gate = gate  # how many bytes of a chunk cross before a cut (all of them: no cut)
        self.capture: list[bytes] | None = None  # if a list: every chunk delivered, in order (tests)
        self.free_at = 0.0  # when the link finishes serializing the last chunk
        self.last_release = 0.0  # when the last chunk is delivered
        self.in_flight = 0
        self.room = asyncio.Event()
        self.room.set()
        if config.mbps is None:
            self.read_size = READ_SIZE
        else:  # about 1 ms of link time per chunk, so delivery is not too bursty
            self.read_size = min(READ_SIZE, max(MIN_SEGMENT, int(config.mbps * 1e6 / 8 / 1000)))

    def schedule(self, now: float, nbytes: int) -> float:
        """Return the loop time at which a chunk of ``nbytes`` read at ``now`` is delivered."""
        sent = now
        if self.config.mbps is not None:
            self.free_at = max(now, self.free_at) + nbytes * 8 / (self.config.mbps * 1e6)
            sent = self.free_at
        jitter = self.rng.uniform(-self.config.jitter_ms, self.config.jitter_ms) if self.config.jitter_ms else 0.0
        delay = max(0.0, (self.config.rtt_ms / 2 + jitter) / 1000)
        self.last_release = max(sent + delay, self.last_release)
        return self.last_release

    def hold(self, nbytes: int) -> None:
        self.in_flight += nbytes
        if self.in_flight >= MAX_IN_FLIGHT:
            self.room.clear()

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        if self.in_flight < MAX_IN_FLIGHT:
            self.room.set()


async def _read_loop(
    reader: asyncio.StreamReader, link: Link, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop
) -> None:
    """Read chunks while the link has room, each queued with its delivery time; last, how the source ended."""
    while True:
        await link.room.wait()
        try:
            data = await reader.read(link.read_size)
        except (OSError, asyncio.IncompleteReadError):
            queue.put_nowait((link.schedule(loop.time(), 0), RESET))
            return
        if not data:
            queue.put_nowait((link.schedule(loop.time(), 0), EOF))
            return
        link.hold(len(data))
        queue.put_nowait((link.schedule(loop.time(), len(data)), data))


async def _deliver(writer: asyncio.StreamWriter, link: Link, item: bytes | str) -> str | None:
    """Deliver one queued chunk (or the source's end); how the direction ended, None while it goes on."""
    try:
        if isinstance(item, str):
            if item == EOF and writer.can_write_eof():
                writer.write_eof()
            return item
        passing = link.gate(len(item))
        cut = passing < len(item)
        item = item[:passing]
        link.on_bytes(len(item))  # counted before the peer can see it
        if link.capture is not None:
            link.capture.append(item)
        writer.write(item)
        await writer.drain()
        if cut:
            return CUT
    except OSError:
        return WRITE_FAILED
    link.release(len(item))
    return None


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> str:
    """Relay one direction until EOF or error; return how it ended (``EOF``, ``RESET``, ...)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | str]] = asyncio.Queue()
    reading = asyncio.create_task(_read_loop(reader, link, queue, loop))
    try:
        while True:
            release_at, item = await queue.get()
            wait = release_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            ended = await _deliver(writer, link, item)
            if ended is not None:
                return ended
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
