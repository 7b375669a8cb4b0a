"""Work off the event loop: large frames are decrypted, decoded, validated, encoded and sealed on the
codec pool, model compute runs on the scheduler's thread; the loop only routes."""

import threading
import time
import urllib.request

import torch

from conftest import cloud_forward
from splitlm.cloud import handlers as handlers_module
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.servicer import OFFLOAD_BYTES
from splitlm.model.shards import Manifest
from splitlm.transport.client import CloudClient
from splitlm.transport.crypto import Channel
from splitlm.transport.messages import Forward, Open


def test_large_frames_are_handled_off_the_event_loop(tiny_split, monkeypatch):
    seen: dict[str, set[str]] = {"open": set(), "validate": set(), "seal": set(), "compute": set()}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name].add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(Channel, "open", spy("open", Channel.open))
    monkeypatch.setattr(Channel, "seal", spy("seal", Channel.seal))
    monkeypatch.setattr(handlers_module, "validate", spy("validate", handlers_module.validate))
    import splitlm.cloud.runner as runner_module

    monkeypatch.setattr(runner_module, "run_layers", spy("compute", runner_module.run_layers))
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    with BackgroundServer(tiny_split / "cloud") as server:
        client = CloudClient(server.url, fp)
        try:
            sid = client.open(Open("fp32")).session
            rows = OFFLOAD_BYTES // (64 * 4) + 8  # a frame over the offload size, both ways
            for names in seen.values():  # only the large FORWARD and its RESULT
                names.clear()
            out = cloud_forward(client, sid, torch.randn(rows, 64), list(range(rows)), "fp32").hidden
            assert out.shape == (rows, 64)
        finally:
            client.close()
    server_threads = {n for names in seen.values() for n in names} - {threading.current_thread().name}
    assert "splitlm-cloud" not in server_threads, seen  # the event loop's thread
    assert all(n.startswith("splitlm-codec") for n in seen["validate"]), seen
    assert seen["compute"] == {"splitlm-compute"}
    assert any(n.startswith("splitlm-codec") for n in seen["open"]), seen


def test_the_loop_answers_health_checks_while_a_long_pass_runs(tiny_split, monkeypatch):
    import splitlm.cloud.runner as runner_module

    real = runner_module.run_layers
    running = threading.Event()

    def slow(model, pieces):
        running.set()
        time.sleep(1.5)
        return real(model, pieces)

    monkeypatch.setattr(runner_module, "run_layers", slow)
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    with BackgroundServer(tiny_split / "cloud") as server:
        client = CloudClient(server.url, fp)
        try:
            sid = client.open(Open("fp32")).session
            pending = client.send_forward(sid, Forward(torch.randn(4, 64), torch.arange(4)), "fp32", 256)
            assert running.wait(10)
            start = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server.port}/healthz", timeout=5) as r:
                assert r.status == 200
            assert time.perf_counter() - start < 0.5  # not behind the pass
            client.receive_forward(pending)
        finally:
            client.close()
