"""Running an `EdgeAPI` with uvicorn: `serve` until interrupted, `serving` in a thread for tests and
benchmarks, on a socket bound first (`listen_socket`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from splitlm import SplitLMError
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.api_log import RequestLog
from splitlm.edge.runtime import Edge

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int):
    """A bound, listening socket, so that a busy port is an error before anything claims to serve."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SplitLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except OverflowError:
        sock.close()
        raise SplitLMError(f"cannot listen on {host}:{port}: not a port number") from None
    return sock


@contextlib.contextmanager
def serving(app, log_level: str = "warning", timeout_s: float = 30.0) -> Iterator[str]:
    """Serve an ASGI `app` (an `EdgeAPI`'s, possibly wrapped) with uvicorn in a thread on a free loopback
    port, for tests and benchmarks; yields its base URL once it has started (or `timeout_s` passed)."""
    import uvicorn

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def serve(edge: Edge, config: APIConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API with uvicorn until interrupted."""
    import uvicorn

    sock = listen_socket(host, port)
    api = EdgeAPI(edge, config)
    if host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach it can use the model", host)
    log.info(
        "serving model '%s' on http://%s:%d/v1 (cloud %s%s)",
        config.model_name,
        host,
        sock.getsockname()[1],
        ",".join(edge.cloud_urls),
        ", API key required" if config.api_key else "",
    )
    server = uvicorn.Server(uvicorn.Config(RequestLog(api.app), log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        api.close()
        sock.close()
