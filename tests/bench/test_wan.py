"""Tests for the user-space WAN emulator, driven from plain threads and sockets."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import socketserver
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from splitlm.bench.wan import (
    WanConfig,
    WanEmulator,
    parse_address,
    run_wan,
)
from splitlm.cli.wan import add_wan_arguments


@pytest.fixture(autouse=True)
def _no_logged_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The emulator's loop runs on another thread, so its failures only show up as log records."""
    yield
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass
        self.server.finished.set()  # type: ignore[attr-defined]


class _SinkHandler(socketserver.BaseRequestHandler):
    """Reads until EOF, noting when the expected number of bytes has arrived."""

    def handle(self) -> None:
        server = self.server
        total = 0
        while data := self.request.recv(65536):
            total += len(data)
            if total >= server.expected:  # type: ignore[attr-defined]
                server.done_at = time.perf_counter()  # type: ignore[attr-defined]
                server.finished.set()  # type: ignore[attr-defined]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handler: type[socketserver.BaseRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.finished = threading.Event()
        self.expected = 0
        self.done_at = 0.0


def _serve(handler: type[socketserver.BaseRequestHandler]) -> Iterator[_Server]:
    server = _Server(handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def echo_server() -> Iterator[_Server]:
    yield from _serve(_EchoHandler)


@pytest.fixture
def sink_server() -> Iterator[_Server]:
    yield from _serve(_SinkHandler)


def _connect(wan: WanEmulator) -> socket.socket:
    sock = socket.create_connection(wan.address, timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = sock.recv(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _round_trips_ms(wan: WanEmulator, count: int) -> list[float]:
    with _connect(wan) as sock:
        sock.sendall(b"w")  # warm-up: the first chunk also pays for the upstream connect
        assert _recv_exactly(sock, 1) == b"w"
        times = []
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"x")
            assert _recv_exactly(sock, 1) == b"x"
            times.append((time.perf_counter() - start) * 1000)
    return times


def test_round_trip_matches_rtt(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=40)) as wan:
        times = _round_trips_ms(wan, 9)
    assert min(times) >= 39.5, times
    assert 40 <= statistics.median(times) <= 48, times


def test_zero_rtt_is_fast(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=0)) as wan:
        times = _round_trips_ms(wan, 9)
    assert statistics.median(times) < 5, times


def test_jitter_varies_round_trips(echo_server: _Server) -> None:
    config = WanConfig(rtt_ms=20, jitter_ms=10, seed=3)
    with WanEmulator(upstream=echo_server.server_address, config=config) as wan:
        times = _round_trips_ms(wan, 15)
    # Each direction gets 10 +/- 10 ms, so round trips spread over [0, 40] ms.
    assert max(times) - min(times) > 3, times
    assert statistics.median(times) < 40, times


def test_pipelining_does_not_serialize_delays(echo_server: _Server) -> None:
    # Ten 1-byte messages 10 ms apart through a 100 ms RTT: the last echo should come back
    # about 100 ms after it was sent, not after ten round trips.
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=100)) as wan:
        with _connect(wan) as sock:
            start = time.perf_counter()
            for i in range(10):
                sock.sendall(bytes([i]))
                time.sleep(0.01)
            assert _recv_exactly(sock, 10) == bytes(range(10))
            elapsed = time.perf_counter() - start
    assert 0.19 <= elapsed < 0.6, elapsed


def test_order_preserved_with_jitter(echo_server: _Server) -> None:
    sent = b"".join(struct.pack(">I", i) for i in range(2000))
    config = WanConfig(rtt_ms=20, jitter_ms=10, seed=1)
    with WanEmulator(upstream=echo_server.server_address, config=config) as wan:
        with _connect(wan) as sock:
            received: list[bytes] = []
            reader = threading.Thread(target=lambda: received.append(_recv_exactly(sock, len(sent))))
            reader.start()
            for i in range(0, len(sent), 4):
                sock.sendall(sent[i : i + 4])
                if i % 400 == 0:
                    time.sleep(0.001)  # spread the chunks out so they get different jitter
            reader.join(timeout=10)
            assert not reader.is_alive()
        assert received == [sent]
        assert wan.bytes_up == len(sent)
        assert wan.bytes_down == len(sent)


def test_bandwidth_cap(sink_server: _Server) -> None:
    payload = b"\0" * 200_000
    sink_server.expected = len(payload)
    # 8 Mbit/s = 1 MB/s, so 200 kB need at least 0.2 s on the wire (plus 5 ms one-way delay).
    with WanEmulator(upstream=sink_server.server_address, config=WanConfig(rtt_ms=10, mbps=8)) as wan:
        with _connect(wan) as sock:
            start = time.perf_counter()
            sock.sendall(payload)
            assert sink_server.finished.wait(timeout=5)
            elapsed = sink_server.done_at - start
        assert wan.bytes_up == len(payload)
    assert 0.19 <= elapsed < 2.0, elapsed


def test_unlimited_bandwidth_is_not_capped(sink_server: _Server) -> None:
    payload = b"\0" * 2_000_000
    sink_server.expected = len(payload)
    with WanEmulator(upstream=sink_server.server_address, config=WanConfig(rtt_ms=0)) as wan:
        with _connect(wan) as sock:
            start = time.perf_counter()
            sock.sendall(payload)
            assert sink_server.finished.wait(timeout=5)
            elapsed = sink_server.done_at - start
    assert elapsed < 1.0, elapsed


def test_half_close_is_relayed(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=20)) as wan:
        with _connect(wan) as sock:
            sock.sendall(b"hello")
            sock.shutdown(socket.SHUT_WR)
            # The echo server answers, sees our EOF, and closes; we read until that EOF.
            assert _recv_exactly(sock, 100) == b"hello"
        assert echo_server.finished.wait(timeout=5)


def test_client_reset_closes_upstream(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=10)) as wan:
        sock = _connect(wan)
        sock.sendall(b"abc")
        assert _recv_exactly(sock, 3) == b"abc"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # SO_LINGER 0: close sends RST
        assert echo_server.finished.wait(timeout=5)
        # The emulator keeps serving new connections afterwards.
        assert _round_trips_ms(wan, 1)


def test_upstream_refused_closes_client() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    with WanEmulator(upstream=("127.0.0.1", dead_port), config=WanConfig(rtt_ms=10)) as wan:
        with _connect(wan) as sock:
            try:
                sock.sendall(b"anyone?")
                assert sock.recv(10) == b""
            except ConnectionResetError:
                pass


def test_exit_closes_open_connections(echo_server: _Server) -> None:
    wan = WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=10))
    with wan:
        sock = _connect(wan)
        sock.sendall(b"x")
        assert _recv_exactly(sock, 1) == b"x"
    with sock:
        try:
            assert sock.recv(10) == b""
        except ConnectionResetError:
            pass
    with pytest.raises(OSError):
        socket.create_connection(wan.address, timeout=1).close()


def test_websocket_through_emulator() -> None:
    ws_server = pytest.importorskip("websockets.sync.server")
    ws_client = pytest.importorskip("websockets.sync.client")

    def echo(conn) -> None:  # type: ignore[no-untyped-def]
        for message in conn:
            conn.send(message)

    with ws_server.serve(echo, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with WanEmulator(upstream=server.socket.getsockname(), config=WanConfig(rtt_ms=30)) as wan:
                start = time.perf_counter()
                with ws_client.connect(wan.url_for("ws"), open_timeout=5, close_timeout=5) as ws:
                    ws.send(b"ping")
                    assert ws.recv(timeout=5) == b"ping"
                elapsed = time.perf_counter() - start
        finally:
            server.shutdown()
            thread.join(timeout=5)
    # Upgrade, echo and close handshake: three round trips, and no waiting on close timeouts.
    assert 0.09 <= elapsed < 1.0, elapsed


def test_bind_failure_raises(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=0)) as first:
        with pytest.raises(OSError):
            WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=0), listen=first.address).start()


def test_cli_runs_until_ctrl_c(echo_server: _Server) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host, up_port = echo_server.server_address
    code = (
        "import argparse, sys\n"
        "from splitlm.cli.wan import add_wan_arguments, wan_main\n"
        "parser = argparse.ArgumentParser()\n"
        "add_wan_arguments(parser)\n"
        "sys.exit(wan_main(parser.parse_args(sys.argv[1:])))\n"
    )
    argv = ["--listen", f"127.0.0.1:{port}", "--upstream", f"{host}:{up_port}", "--rtt-ms", "20"]
    # a shell that starts pytest in the background leaves SIGINT ignored, and children inherit that
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        assert banner.strip() == f"wan: 127.0.0.1:{port} -> {host}:{up_port}  rtt=20ms jitter=0ms bw=unlimited"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"hi")
            assert _recv_exactly(sock, 2) == b"hi"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_emulator_properties(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=1)) as wan:
        assert wan.host == "127.0.0.1"
        assert wan.port > 0
        assert wan.address == (wan.host, wan.port)
        assert wan.url_for("ws") == f"ws://127.0.0.1:{wan.port}"
        assert wan.url_for("http", "/x") == f"http://127.0.0.1:{wan.port}/x"


def test_run_wan_logs_banner(echo_server: _Server, caplog: pytest.LogCaptureFixture) -> None:
    host, port = echo_server.server_address
    config = WanConfig(rtt_ms=80)

    async def main() -> None:
        task = asyncio.create_task(run_wan(("127.0.0.1", 0), f"{host}:{port}", config))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="splitlm.bench.wan"):
        asyncio.run(main())
    banners = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wan: ")]
    assert len(banners) == 1
    assert banners[0].endswith(f" -> {host}:{port}  rtt=80ms jitter=0ms bw=unlimited")


@pytest.mark.parametrize("text", ["foo", "foo:", ":80", "host:port", "host:99999", "host:-1", ""])
def test_bad_addresses_raise(text: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(text)


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_address("example.org:0") == ("example.org", 0)
    assert parse_address("[::1]:8765") == ("::1", 8765)


@pytest.mark.parametrize(
    "kwargs",
    [{"rtt_ms": -1}, {"rtt_ms": 10, "jitter_ms": -1}, {"rtt_ms": 10, "mbps": 0}, {"rtt_ms": 10, "mbps": -5}],
)
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WanConfig(**kwargs)


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_wan_arguments(parser)
    args = parser.parse_args(["--listen", "0.0.0.0:9000", "--upstream", "h:8765", "--rtt-ms", "80", "--mbps", "50"])
    assert args.listen == ("0.0.0.0", 9000)
    assert args.upstream == ("h", 8765)
    assert (args.rtt_ms, args.jitter_ms, args.mbps, args.seed) == (80.0, 0.0, 50.0, None)
    bad_args = [
        ["--upstream", "nope", "--rtt-ms", "10"],
        ["--upstream", "h:1", "--rtt-ms", "-1"],
        ["--upstream", "h:1", "--rtt-ms", "10", "--jitter-ms", "-1"],
        ["--upstream", "h:1", "--rtt-ms", "10", "--mbps", "0"],
    ]
    for bad in bad_args:
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_drop_after_bytes_cuts_the_link_once_at_that_byte(echo_server: _Server) -> None:
    config = WanConfig(rtt_ms=0, drop_after_bytes=1000)
    with WanEmulator(upstream=echo_server.server_address, config=config) as wan:
        with _connect(wan) as sock:
            sock.sendall(b"x" * 800)  # 800 up, then the echo: 200 more bytes come down, then the cut
            assert _read_until_closed(sock) == b"x" * 200
        assert wan.cuts == 1 and wan.bytes_up + wan.bytes_down == 1000
        with _connect(wan) as sock:  # the next connection is not cut
            sock.sendall(b"y" * 3000)
            assert _recv_exactly(sock, 3000) == b"y" * 3000
        wan.cut_after(10)  # armed again
        with _connect(wan) as sock:
            sock.sendall(b"z" * 100)
            assert _read_until_closed(sock) == b""
        assert wan.cuts == 2


def test_drop_prob_cuts_connections_at_random(echo_server: _Server) -> None:
    with WanEmulator(upstream=echo_server.server_address, config=WanConfig(rtt_ms=0, drop_prob=1.0, seed=1)) as wan:
        with _connect(wan) as sock:
            sock.sendall(b"q" * 500)
            assert len(_read_until_closed(sock)) < 500
        assert wan.cuts >= 1


def test_fault_options() -> None:
    parser = argparse.ArgumentParser()
    add_wan_arguments(parser)
    args = parser.parse_args(
        ["--upstream", "h:1", "--rtt-ms", "5", "--drop-after-bytes", "4096", "--drop-prob", "0.01"]
    )
    assert (args.drop_after_bytes, args.drop_prob) == (4096, 0.01)
    with pytest.raises(ValueError):
        WanConfig(rtt_ms=1, drop_prob=2)
    assert "drop-after=4096B drop-prob=0.01" in WanConfig(5, drop_after_bytes=4096, drop_prob=0.01).describe()
