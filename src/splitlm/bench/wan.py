"""A user-space WAN emulator: a TCP proxy that adds latency, jitter and a bandwidth cap.

Machines without ``tc netem`` can still benchmark over a "slow network" by pointing the
client at this proxy instead of the server::

    with WanEmulator(upstream=("127.0.0.1", 8765), config=WanConfig(rtt_ms=80)) as wan:
        client.connect(wan.url_for("ws"))

Model, per direction and per connection (`splitlm.bench.wan_link`): a chunk read at time ``t``
waits for the link's bandwidth, then travels for ``rtt/2`` ± jitter, in order, pipelined.

Faults (for failover tests and the bench): ``drop_after_bytes=N`` cuts the link once, in the
middle of whichever chunk carries its N-th byte (all connections and both directions counted;
``WanEmulator.cut_after`` arms it again); ``drop_prob=P`` cuts a connection at a random byte of
any chunk with probability P. A cut aborts both sides of the connection (a TCP reset, no
WebSocket close): the peers see a dead link, as when a NAT or a cloud worker goes away.

Not modelled: the TCP handshake (the client's connect completes locally at once), packet
loss, and TCP congestion control. The proxy holds at most ``wan_link.MAX_IN_FLIGHT`` bytes
per direction before it stops reading, which gives the sender back-pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading

from splitlm.bench.wan_link import CUT, RESET, Link, WanConfig, pipe

log = logging.getLogger(__name__)

Address = tuple[str, int]


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT`` (or ``[IPv6]:PORT``) into ``(host, port)``; raise ValueError if malformed."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT")
    return host, int(port_text)


def as_address(value: Address | str) -> Address:
    return parse_address(value) if isinstance(value, str) else (value[0], int(value[1]))


def format_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _banner(listen: Address, upstream: Address, config: WanConfig) -> str:
    return f"wan: {format_address(listen)} -> {format_address(upstream)}  {config.describe()}"


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
        log.info("wan: cutting a connection after %d bytes in all", self.bytes_up + self.bytes_down + passing)
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
                log.warning("wan: upstream %s unreachable: %s", format_address(self.upstream), exc)
                return
            writers.append(up_writer)
            _set_nodelay(up_writer)
            log.debug("wan: connection from %s", peer)
            cut = False  # once one direction is cut, the other delivers nothing more

            def gate(nbytes: int) -> int:
                nonlocal cut
                passing = 0 if cut else self._gate(nbytes)
                cut = cut or passing < nbytes
                return passing

            up = Link(self.config, self.rng, self._count_up, gate)
            down = Link(self.config, self.rng, self._count_down, gate)
            up.capture, down.capture = self.capture_up, self.capture_down
            pipes = [
                asyncio.create_task(pipe(client_reader, up_writer, up)),
                asyncio.create_task(pipe(up_reader, client_writer, down)),
            ]
            try:
                for finished in asyncio.as_completed(pipes):
                    ended = await finished
                    if ended == CUT:
                        for w in writers:
                            w.transport.abort()
                        break
                    if ended == RESET:
                        break  # one side failed; its data is flushed, so tear everything down
            finally:
                for task in pipes:
                    task.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            await asyncio.gather(*(_close(w) for w in writers))
            log.debug("wan: connection from %s closed", peer)


async def run_wan(listen: Address | str, upstream: Address | str, config: WanConfig) -> None:
    """Serve the emulator on ``listen``, relaying to ``upstream``, until cancelled."""
    proxy = _Proxy(as_address(listen), as_address(upstream), config)
    await proxy.start()
    log.info("%s", _banner(proxy.address, proxy.upstream, config))
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
        self._proxy = _Proxy(as_address(listen), as_address(upstream), config)
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
        return f"{scheme}://{format_address(self.address)}{path}"

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
        log.debug("%s", _banner(self.address, self.upstream, self.config))
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
