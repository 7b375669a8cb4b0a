"""The API over a tiny model (token-id prompts) when the cloud goes away: 502 with an OpenAI-style
error body, streamed or not, and the server keeps serving once the cloud is back."""

import json
import urllib.error
import urllib.request

import pytest

from conftest import serving
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge
from splitlm.edge.api import APIConfig, EdgeAPI

uvicorn = pytest.importorskip("uvicorn")


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
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
    edge = Edge(tiny_split / "edge", cloud.url, wire_dtype="fp32", cloud_key=cloud.fingerprint, failover_timeout_s=2.0)
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
