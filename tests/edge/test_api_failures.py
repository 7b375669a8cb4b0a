"""The API over a tiny model (token-id prompts) when the cloud goes away: 502 with an OpenAI-style
error body, streamed or not, and the server keeps serving once the cloud is back; when the client
goes away: its generation stops, the request is logged as 499, nothing is an internal error; and a
body nested past Python's recursion limit is a 400."""

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace

import pytest

from conftest import scrape_metrics, serving
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig, GenerationRequest
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.prefix_pool import PrefixPool

uvicorn = pytest.importorskip("uvicorn")


def post(url, body):
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_cloud_failures_are_502_and_the_api_recovers(tiny_split):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    cloud = BackgroundServer(tiny_split / "cloud").__enter__()
    port = cloud.server.port
    # the edge retries a lost cloud for failover_timeout_s (default 30 s) before the request fails
    edge = Edge(
        tiny_split / "edge",
        cloud.url,
        EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint, failover_timeout_s=2.0),
    )
    api = EdgeAPI(edge, APIConfig(model_name="tiny", spec="none"))
    try:
        with serving(api.app) as url:
            status, text = post(url, body)
            assert status == 200
            expected = json.loads(text)["usage"]["completion_tokens"]
            cloud.__exit__(None, None, None)
            for stream in (False, True):
                status, text = post(url, {**body, "stream": stream})
                err = json.loads(text)["error"]
                assert status == 502 and err["type"] == "server_error" and err["code"] == "cloud_error"
                assert "cannot reach the cloud" in err["message"]
            cloud = BackgroundServer(tiny_split / "cloud", port=port, identity=cloud.server.identity).__enter__()
            status, text = post(url, body)
            assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == expected
            status, text = post(url, {**body, "prompt": [5, 10**6]})
            assert status == 400 and json.loads(text)["error"]["param"] == "prompt"
            status, text = post(url, {**body, "prompt": "text needs a tokenizer"})
            assert status == 400 and "no tokenizer" in json.loads(text)["error"]["message"]
    finally:
        api.close()
        edge.close()
        cloud.__exit__(None, None, None)


class SlowStream:
    """A pool's stream with its pieces 200 ms apart."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        for piece in self.stream:
            time.sleep(0.2)
            yield piece

    def close(self) -> None:
        self.stream.close()

    @property
    def result(self):
        return self.stream.result


class SlowPool(PrefixPool):
    """The API's prefix pool with slow streams that run to max_tokens (the end token does not stop
    them): a long generation for a client to walk away from."""

    def stream(self, request: GenerationRequest, *args) -> SlowStream:
        return SlowStream(super().stream(replace(request, stop_at_eos=False), *args))


@pytest.fixture(scope="module")
def slow_api(tiny_chat_split):
    """serve-edge over the tiny model with a tokenizer (a piece of text per token), slowed down."""
    with (
        BackgroundServer(tiny_chat_split / "cloud") as cloud,
        Edge(tiny_chat_split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)) as edge,
    ):
        config = APIConfig(model_name="tiny", spec="none")
        api = EdgeAPI(edge, config, SlowPool(edge, config.prefix_pool))
        try:
            with serving(api.app) as url:
                yield url
        finally:
            api.close()


def metrics(url) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return scrape_metrics(r.read().decode())


def wait_for(condition, timeout_s: float = 30.0) -> float:
    """Seconds until `condition()` held (a failed test if it did not within `timeout_s`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def send(url, body: bytes, length: int | None = None) -> socket.socket:
    """A raw POST /v1/completions that declares `length` bytes (default: the body's) and sends `body`."""
    where = urllib.parse.urlsplit(url)
    client = socket.create_connection((where.hostname, where.port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body
    )
    return client


def test_a_client_that_goes_away_stops_its_generation_streamed_or_not(slow_api):
    gone = 'splitlm_edge_requests_total{endpoint="/v1/completions",status="499"}'
    for stream in (False, True):
        body = json.dumps(
            {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "stream": stream}
        ).encode()
        client = send(slow_api, body)
        wait_for(lambda: metrics(slow_api)["splitlm_edge_num_requests_running"] == 1)
        time.sleep(0.5)  # some pieces out
        client.close()
        assert (
            wait_for(lambda: metrics(slow_api)["splitlm_edge_num_requests_running"] == 0) < 5
        )  # 400 tokens: 10 s or more
    before = metrics(slow_api)[gone]
    assert before >= 1  # the non-streamed one (the stream had its 200 by then)
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
    client = send(slow_api, body[:10], length=len(body))  # gone halfway through its body
    time.sleep(0.2)
    client.close()
    wait_for(lambda: metrics(slow_api)[gone] == before + 1)
    assert metrics(slow_api).get('splitlm_edge_errors_total{type="server_error"}', 0) == 0
    status, text = post(slow_api, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2


def test_an_internal_error_is_a_500_and_the_connection_stays_open(slow_api, monkeypatch):
    import http.client

    import splitlm.edge.api as api_module

    real = api_module.parse_completion

    def buggy(body, *args):
        if body.get("prompt") == "boom":
            raise RuntimeError("a bug")
        return real(body, *args)

    monkeypatch.setattr(api_module, "parse_completion", buggy)
    where = urllib.parse.urlsplit(slow_api)
    client = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    client.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "boom"}), headers)
    answer = client.getresponse()
    assert answer.status == 500 and json.loads(answer.read())["error"]["type"] == "server_error"
    client.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 2}), headers)
    answer = client.getresponse()  # the same keep-alive connection
    assert answer.status == 200 and json.loads(answer.read())["usage"]["completion_tokens"] == 2
    client.close()


def test_a_body_nested_past_the_recursion_limit_is_a_400(slow_api):
    req = urllib.request.Request(
        slow_api + "/v1/completions", data=b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["code"] == "invalid_json"


def test_a_prompt_no_context_holds_is_refused_before_it_is_tokenized(slow_api):
    """Tokenizing 20 MB would hold the tokenizer's lock, and every other request, for seconds."""
    status, text = post(slow_api, {"model": "tiny", "prompt": "a" * 1000, "max_tokens": 2})
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and "the prompt has 1000 and" in err["message"]
    start = time.monotonic()
    status, text = post(slow_api, {"model": "tiny", "prompt": "a" * 20_000_000, "max_tokens": 2})
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "20000000 characters" in err["message"] and time.monotonic() - start < 2


def test_a_grammar_engine_failure_is_the_edge_s_not_the_cloud_s():
    from splitlm.decoding.grammar import GrammarError
    from splitlm.edge.api_errors import cloud_failure

    err = cloud_failure(GrammarError("token 7 does not match the grammar"))
    assert err.status == 500 and err.code == "grammar_error" and "cloud" not in err.message
    assert cloud_failure(RuntimeError("connection lost")).status == 502
