"""A user-space WAN emulator: a TCP proxy that adds latency, jitter and a bandwidth cap.

Machines without ``tc netem`` can still benchmark over a "slow network" by pointing the
client at this proxy instead of the server::

    with WanEmulator(upstream=("127.0.0.1", 8765), config=WanConfig(rtt_ms=80)) as wan:
        client.connect(wan.url_for("ws"))

Model, per direction and per connection: a chunk read at time ``t`` first waits for the
link (``n * 8 / bandwidth`` seconds after the previous chunk finished), then travels for
``rtt/2 + uniform(-jitter, +jitter)`` (at least 0). It is never delivered before the chunk
in front of it, so the byte stream keeps its order. Reading goes on while earlier chunks
are in flight, so back-to-back messages are pipelined as on a real link.

Faults (for failover tests and the bench): ``drop_after_bytes=N`` cuts the link once, in the
middle of whichever chunk carries its N-th byte (all connections and both directions counted;
``WanEmulator.cut_after`` arms it again); ``drop_prob=P`` cuts a connection at a random byte of
any chunk with probability P. A cut aborts both sides of the connection (a TCP reset, no
WebSocket close): the peers see a dead link, as when a NAT or a cloud worker goes away.

Not modelled: the TCP handshake (the client's connect completes locally at once), packet
loss, and TCP congestion control. The proxy holds at most ``MAX_IN_FLIGHT`` bytes per
direction before it stops reading, which gives the sender back-pressure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 16 * 1024 * 1024  # bytes buffered per direction before reading pauses
READ_SIZE = 64 * 1024  # largest chunk read at once
MIN_SEGMENT = 1500  # smallest read size under a bandwidth cap (about one Ethernet frame)

Address = tuple[str, int]

_EOF = "eof"  # the source half-closed: flush, then half-close the destination
_RESET = "reset"  # the source failed: flush, then close the whole connection
_WRITE_FAILED = "write-failed"  # the destination went away: drop what is left
_CUT = "cut"  # a fault injected here: abort both sides


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
        faults = (f" drop-after={self.drop_after_bytes}B" if self.drop_after_bytes is not None else "") + \
            (f" drop-prob={self.drop_prob:g}" if self.drop_prob else "")
        return f"rtt={self.rtt_ms:g}ms jitter={self.jitter_ms:g}ms bw={bw}{faults}"


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT`` (or ``[IPv6]:PORT``) into ``(host, port)``; raise ValueError if malformed."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT")
    return host, int(port_text)


def _as_address(value: Address | str) -> Address:
    return parse_address(value) if isinstance(value, str) else (value[0], int(value[1]))


def _format_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _banner(listen: Address, upstream: Address, config: WanConfig) -> str:
    return f"wan: {_format_address(listen)} -> {_format_address(upstream)}  {config.describe()}"


class _Link:
    """Timing and byte accounting for one direction of one connection."""

    def __init__(self, config: WanConfig, rng: random.Random, on_bytes: Callable[[int], None],
                 gate: Callable[[int], int] = lambda n: n) -> None:
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
        jitter = (
            self.rng.uniform(-self.config.jitter_ms, self.config.jitter_ms) if self.config.jitter_ms else 0.0
        )
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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link) -> str:
    """Relay one direction until EOF or error; return how it ended (``_EOF``, ``_RESET``, ...)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | str]] = asyncio.Queue()

    async def read_loop() -> None:
        while True:
            await link.room.wait()
            try:
                data = await reader.read(link.read_size)
            except (OSError, asyncio.IncompleteReadError):
                queue.put_nowait((link.schedule(loop.time(), 0), _RESET))
                return
            if not data:
                queue.put_nowait((link.schedule(loop.time(), 0), _EOF))
                return
            link.hold(len(data))
            queue.put_nowait((link.schedule(loop.time(), len(data)), data))

    reading = asyncio.create_task(read_loop())
    try:
        while True:
            release_at, item = await queue.get()
            wait = release_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                if isinstance(item, str):
                    if item == _EOF and writer.can_write_eof():
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
                    return _CUT
            except OSError:
                return _WRITE_FAILED
            link.release(len(item))
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


class _Proxy:
    """The asyncio side of the emulator: a listening server plus one task per connection."""

    def __init__(self, listen: Address, upstream: Address, config: WanConfig) -> None:
        self.listen = listen
        self.upstream = upstream
        self.config = config
        self.rng = random.Random(config.seed)
        self.drop_rng = random.Random(None if config.seed is None else config.seed + 1)
        self.cut_at = config.drop_after_bytes  # bytes relayed (both ways) at which the link is cut; None = never
        self.cuts = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.capture_up: list[bytes] | None = None  # lists to record the delivered bytes (all connections)
        self.capture_down: list[bytes] | None = None
        self.address: Address = listen
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1])
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
        for task, writers in list(self._connections.items()):
            for writer in writers:
                writer.transport.abort()
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)

    def _gate(self, nbytes: int) -> int:
        """How many bytes of a chunk of `nbytes` are delivered before the link is cut (`nbytes`: all)."""
        if self.cut_at is not None and self.bytes_up + self.bytes_down + nbytes >= self.cut_at:
            passing, self.cut_at = max(0, self.cut_at - self.bytes_up - self.bytes_down), None
        elif self.config.drop_prob and nbytes and self.drop_rng.random() < self.config.drop_prob:
            passing = self.drop_rng.randrange(nbytes)
        else:
            return nbytes
        self.cuts += 1
        logger.info("wan: cutting a connection after %d bytes in all", self.bytes_up + self.bytes_down + passing)
        return passing

    def _count_up(self, nbytes: int) -> None:
        self.bytes_up += nbytes

    def _count_down(self, nbytes: int) -> None:
        self.bytes_down += nbytes

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # The relay runs in a task of its own, which close() may cancel; this callback itself
        # always ends normally (Python 3.11's asyncio logs a traceback for a cancelled one).
        writers = [client_writer]
        task = asyncio.create_task(self._relay(client_reader, writers))
        self._connections[task] = writers
        try:
            await asyncio.wait([task])
        finally:
            self._connections.pop(task, None)

    async def _relay(self, client_reader: asyncio.StreamReader, writers: list[asyncio.StreamWriter]) -> None:
        client_writer = writers[0]
        peer = client_writer.get_extra_info("peername")
        try:
            _set_nodelay(client_writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError as exc:
                logger.warning("wan: upstream %s unreachable: %s", _format_address(self.upstream), exc)
                return
            writers.append(up_writer)
            _set_nodelay(up_writer)
            logger.debug("wan: connection from %s", peer)
            cut = False  # once one direction is cut, the other delivers nothing more

            def gate(nbytes: int) -> int:
                nonlocal cut
                passing = 0 if cut else self._gate(nbytes)
                cut = cut or passing < nbytes
                return passing

            up = _Link(self.config, self.rng, self._count_up, gate)
            down = _Link(self.config, self.rng, self._count_down, gate)
            up.capture, down.capture = self.capture_up, self.capture_down
            pipes = [
                asyncio.create_task(_pipe(client_reader, up_writer, up)),
                asyncio.create_task(_pipe(up_reader, client_writer, down)),
            ]
            try:
                for finished in asyncio.as_completed(pipes):
                    ended = await finished
                    if ended == _CUT:
                        for w in writers:
                            w.transport.abort()
                        break
                    if ended == _RESET:
                        break  # one side failed; its data is flushed, so tear everything down
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            await asyncio.gather(*(_close(w) for w in writers))
            logger.debug("wan: connection from %s closed", peer)


async def run_wan(listen: Address | str, upstream: Address | str, config: WanConfig) -> None:
    """Serve the emulator on ``listen``, relaying to ``upstream``, until cancelled."""
    proxy = _Proxy(_as_address(listen), _as_address(upstream), config)
    await proxy.start()
    logger.info("%s", _banner(proxy.address, proxy.upstream, config))
    try:
        await asyncio.Event().wait()  # forever
    finally:
        await proxy.close()


class WanEmulator:
    """The emulator on a background thread, for synchronous tests and benchmarks.

    ``with WanEmulator(upstream=(host, port), config=WanConfig(rtt_ms=80)) as wan:`` then
    connect to ``wan.address`` (or ``wan.url_for("ws")``) instead of the upstream.
    """

    def __init__(
        self,
        upstream: Address | str,
        config: WanConfig,
        listen: Address | str = ("127.0.0.1", 0),
        capture: bool = False,
    ) -> None:
        self._proxy = _Proxy(_as_address(listen), _as_address(upstream), config)
        if capture:  # keep every byte relayed, for wire-capture tests (`captured_up`, `captured_down`)
            self._proxy.capture_up, self._proxy.capture_down = [], []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def config(self) -> WanConfig:
        return self._proxy.config

    @property
    def upstream(self) -> Address:
        return self._proxy.upstream

    @property
    def address(self) -> Address:
        """The ``(host, port)`` the emulator listens on (the real port once started)."""
        return self._proxy.address

    @property
    def host(self) -> str:
        return self._proxy.address[0]

    @property
    def port(self) -> int:
        return self._proxy.address[1]

    @property
    def bytes_up(self) -> int:
        """Bytes delivered from clients to the upstream so far."""
        return self._proxy.bytes_up

    @property
    def bytes_down(self) -> int:
        """Bytes delivered from the upstream to clients so far."""
        return self._proxy.bytes_down

    @property
    def captured_up(self) -> bytes:
        """Everything relayed from clients to the upstream (needs ``capture=True``)."""
        return b"".join(self._proxy.capture_up or [])

    @property
    def captured_down(self) -> bytes:
        """Everything relayed from the upstream to clients (needs ``capture=True``)."""
        return b"".join(self._proxy.capture_down or [])

    @property
    def cuts(self) -> int:
        """Connections cut by an injected fault so far."""
        return self._proxy.cuts

    def cut_after(self, nbytes: int | None) -> None:
        """Cut the link once more, when `nbytes` more bytes have crossed it (None: disarm)."""
        proxy = self._proxy
        proxy.cut_at = None if nbytes is None else proxy.bytes_up + proxy.bytes_down + nbytes

    def url_for(self, scheme: str = "ws", path: str = "") -> str:
        """A URL pointing at the emulator, e.g. ``ws://127.0.0.1:40123``."""
        return f"{scheme}://{_format_address(self.address)}{path}"

    def start(self) -> WanEmulator:
        """Start listening (returns once the port is bound; bind errors are raised here)."""
        if self._thread is not None:
            raise RuntimeError("WanEmulator already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="splitlm-wan", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self._proxy.start(), loop).result(timeout=10)
        except BaseException:
            self.stop()
            raise
        logger.debug("%s", _banner(self.address, self.upstream, self.config))
        return self

    def stop(self) -> None:
        """Close all connections and stop the background loop (safe to call twice)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._proxy.close(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _address_arg(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_wan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``splitlm wan`` to ``parser``."""
    parser.add_argument(
        "--listen",
        type=_address_arg,
        default=("127.0.0.1", 9000),
        metavar="HOST:PORT",
        help="address to accept clients on (default: 127.0.0.1:9000)",
    )
    parser.add_argument(
        "--upstream", type=_address_arg, required=True, metavar="HOST:PORT", help="server to relay to"
    )
    parser.add_argument(
        "--rtt-ms",
        type=_non_negative,
        required=True,
        metavar="MS",
        help="round-trip time to add; each direction gets half",
    )
    parser.add_argument(
        "--jitter-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="uniform jitter per chunk and direction, +/- this much (default: 0)",
    )
    parser.add_argument(
        "--mbps",
        type=_positive,
        default=None,
        metavar="MBIT",
        help="bandwidth cap per direction in Mbit/s (default: unlimited)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for the jitter and the drops")
    parser.add_argument("--drop-after-bytes", type=int, default=None, metavar="N",
                        help="fault injection: cut the link once, after N bytes (both directions, all connections)")
    parser.add_argument("--drop-prob", type=float, default=0.0, metavar="P",
                        help="fault injection: cut a connection at any chunk relayed with probability P (default 0)")


def wan_main(args: argparse.Namespace) -> int:
    """Run ``splitlm wan`` until Ctrl-C; return the exit status."""
    try:
        config = WanConfig(rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, mbps=args.mbps, seed=args.seed,
                           drop_after_bytes=args.drop_after_bytes, drop_prob=args.drop_prob)
        listen, upstream = _as_address(args.listen), _as_address(args.upstream)
    except ValueError as exc:
        print(f"splitlm wan: error: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        asyncio.run(run_wan(listen, upstream, config))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"splitlm wan: error: cannot listen on {_format_address(listen)}: {exc}", file=sys.stderr)
        return 1
    return 0
