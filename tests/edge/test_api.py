"""`splitlm serve-edge` driven by the official `openai` client: greedy output against transformers,
streaming against non-streaming, stop strings, seeded sampling, concurrency, errors, metrics."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import hf_greedy, scrape_metrics
from splitlm.cloud.local import free_port, wait_healthy

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

KEY = "test-key-123"
MODEL = "smol"


@pytest.fixture(scope="module")
def api(bundled_split, bundled_server, tmp_path_factory):
    """One serve-edge process (fp32 wire, so greedy output equals transformers') for the module."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve-edge") / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitlm",
                "serve-edge",
                "--edge",
                str(bundled_split / "edge"),
                "--cloud",
                bundled_server.url,
                "--port",
                str(port),
                "--model-name",
                MODEL,
                "--spec",
                "ngram",
                "--wire-dtype",
                "fp32",
                "--threads",
                "1",
            ],
            env={**os.environ, "SPLITLM_API_KEY": KEY},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        try:
            wait_healthy(port, proc, timeout_s=120)
        except Exception:
            pytest.fail(f"serve-edge did not start:\n{log.read_text()}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def stream_chat(client, **kwargs):
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_greedy_chat_matches_transformers_streamed_or_not(client, bundled_hf):
    hf, tok = bundled_hf
    messages = [{"role": "user", "content": "Name three fruits."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    ids = chat_ids(tok, messages)
    expected = hf_greedy(hf, ids, 16)
    assert reply.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected)
    assert reply.usage.total_tokens == len(ids) + len(expected)
    text, finish, usage = stream_chat(
        client, model=MODEL, messages=messages, temperature=0, max_tokens=16, stream_options={"include_usage": True}
    )
    assert text == reply.choices[0].message.content
    assert finish == reply.choices[0].finish_reason
    assert usage.completion_tokens == reply.usage.completion_tokens


def test_completions_with_stop_strings(client):
    prompt = "Monday, Tuesday, Wednesday,"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # cut somewhere inside what greedy decoding produces
    cut = text[: text.index(stop)]
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=["\u2603never", stop]
    )
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == cut  # the stop string's beginning was held back
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt="Once upon a time", temperature=1.5, top_p=0.95, seed=seed, max_tokens=10
            )
            .choices[0]
            .text
        )

    first = sample(5)
    assert sample(5) == first
    assert any(sample(seed) != first for seed in (6, 7))


def test_two_concurrent_streams_do_not_mix(client):
    prompts = ["Count from one to ten in words:", "List the colours of the rainbow:"]
    solo = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=14).choices[0].text for p in prompts
    ]
    assert solo[0] != solo[1]
    out, spans = [None, None], [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        barrier.wait()
        pieces, times = [], []
        for chunk in client.completions.create(
            model=MODEL, prompt=prompts[i], temperature=0, max_tokens=14, stream=True
        ):
            pieces.append(chunk.choices[0].text)
            times.append(time.monotonic())
        out[i], spans[i] = "".join(pieces), (times[1], times[-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert out == solo
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # they really streamed at the same time


def error_body(exc):
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=2), "n"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(max_tokens=10**6), "messages"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ],
)
def test_bad_requests_get_openai_errors(client, kwargs, param):
    args = {**dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4), **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    err = error_body(e.value)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_unknown_model_wrong_key_bad_json_and_unknown_route(api, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert error_body(e.value)["code"] == "model_not_found"
    intruder = openai.OpenAI(base_url=api + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        intruder.models.list()
    assert error_body(e.value)["code"] == "invalid_api_key"
    basic = urllib.request.Request(api + "/v1/models", headers={"Authorization": "Basic dTpw"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(basic, timeout=10)
    assert (
        e.value.code == 401 and "must read 'Bearer KEY', not 'Basic'" in json.loads(e.value.read())["error"]["message"]
    )
    for path, data, status in [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/nothing", b"{}", 404),
        ("/v1/completions", b'{"model": "smol", "prompt": 3}', 400),
    ]:
        req = urllib.request.Request(api + path, data=data, headers={"Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status
        assert json.loads(e.value.read())["error"]["message"]


def test_metrics(api, client):
    client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", temperature=-1)
    with urllib.request.urlopen(api + "/metrics", timeout=10) as r:
        values = scrape_metrics(r.read().decode())
    assert values['splitlm_edge_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values['splitlm_edge_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert values['splitlm_edge_errors_total{type="invalid_request_error"}'] >= 1
    assert values["splitlm_edge_generation_tokens_total"] >= 3
    assert values["splitlm_edge_round_trips_total"] >= 3
    assert values['splitlm_edge_e2e_request_latency_seconds_count{endpoint="/v1/completions"}'] >= 1
    assert values['splitlm_edge_bytes_total{direction="up"}'] > 0
    assert values["splitlm_edge_num_requests_running"] == 0


def test_spec_decode_counters_of_a_repetitive_request(api, client):
    """A request that makes the model repeat moves vLLM's speculative-decoding counters consistently."""

    def scrape():
        with urllib.request.urlopen(api + "/metrics", timeout=10) as r:
            return scrape_metrics(r.read().decode())

    def spec(v, name):
        return sum(x for k, x in v.items() if k.startswith(f"splitlm_edge_spec_decode_num_{name}_total"))

    before = scrape()
    reply = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,", temperature=0, max_tokens=24
    )
    after = scrape()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["splitlm_edge_generation_tokens_total"] == reply.usage.completion_tokens
    assert delta["splitlm_edge_prompt_tokens_total"] == reply.usage.prompt_tokens
    drafts, proposed = spec(delta, "drafts"), spec(delta, "draft_tokens")
    accepted, per_pos = spec(delta, "accepted_tokens"), spec(delta, "accepted_tokens_per_pos")
    assert 0 < drafts <= delta["splitlm_edge_round_trips_total"] - 1 and 0 < accepted <= proposed
    assert per_pos == accepted
    assert accepted / drafts > 1  # the ngram drafter predicts the repetition several tokens deep
    assert delta["splitlm_edge_time_to_first_token_seconds_count"] == 1
    assert after["splitlm_edge_num_requests_waiting"] == 0 and after["splitlm_edge_num_requests_running"] == 0


def test_a_client_that_goes_away_stops_its_generation(api, client, bundled_server):
    def in_flight():
        with urllib.request.urlopen(api + "/metrics", timeout=10) as r:
            return scrape_metrics(r.read().decode())["splitlm_edge_num_requests_running"]

    stream = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=1000, stream=True
    )
    next(iter(stream))
    assert in_flight() == 1
    stream.close()
    deadline = time.monotonic() + 20
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight() == 0  # long before 1000 tokens
    with urllib.request.urlopen(api + "/metrics", timeout=10) as r:  # its cloud session was closed or pooled
        pooled = scrape_metrics(r.read().decode())["splitlm_edge_prefix_pool_sessions"]
    assert len(bundled_server.server.sessions.sessions) == pooled <= 4


def test_bundled_tool_round_trip_and_json(client):
    """The bundled model through serve-edge: a required call (parallel allowed) whose arguments follow
    the schema, its result sent back as `role: tool`, a final answer."""
    import jsonschema

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[weather], tool_choice="required", temperature=0, max_tokens=120
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "sky": "sunny"}'}
        for c in choice.message.tool_calls
    ]
    final = client.chat.completions.create(
        model=MODEL,
        messages=[*ask, choice.message.model_dump(exclude_none=True), *results],
        tools=[weather],
        temperature=0,
        max_tokens=24,
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert final.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt
