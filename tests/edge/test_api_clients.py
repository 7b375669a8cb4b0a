"""serve-edge driven by real clients over a real cloud: the `openai` SDK (`chat.completions.parse`
with a pydantic model, a tool round trip, streamed tool calls, logprobs) and `langchain-openai`
(`with_structured_output`, `bind_tools`). The model is a tiny random Llama with a byte-level
tokenizer: its choices are noise, so the grammar alone makes the answers valid."""

import contextlib
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from conftest import CHAT_TEMPLATE, make_tiny_llama, serving
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.api import APIConfig, EdgeAPI

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
MODEL = "tiny"


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    colour: Literal["red", "green", "blue"]
    member: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def save_tokenizer(path):
    """A byte-level tokenizer (256 tokens) with an end token (256) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<eos>"})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


@contextlib.contextmanager
def serving_v1(app):
    with serving(app) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    from splitlm.model.shards import split_model

    path = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-tools"), seed=11, vocab_size=257, eos_token_id=256, max_position_embeddings=2048
    )
    save_tokenizer(path)
    split = split_model(str(path), head=2, tail=2, out=tmp_path_factory.mktemp("tiny-tools-split"))
    with (
        BackgroundServer(split / "cloud") as cloud,
        Edge(split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)) as edge,
    ):
        api = EdgeAPI(edge, APIConfig(model_name=MODEL, spec="auto", default_temperature=0.0))
        try:
            with serving_v1(api.app) as url:
                yield url
        finally:
            api.close()


@pytest.fixture(scope="module")
def client(api_url):
    return openai.OpenAI(base_url=api_url, api_key="none", max_retries=0, timeout=120)


def test_parse_returns_the_pydantic_model(client):
    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Ada, 36."}], response_format=Person, max_tokens=200
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, Person) and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), Person.model_json_schema())


def test_a_bad_schema_is_a_400_naming_it(client):
    for fmt, param in [
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
            "response_format",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
            "response_format.json_schema.schema",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt)
        assert e.value.body["param"] == param, e.value.body


def check_call(call, tool):
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_round_trip(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8
    )
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    assert final.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt


def test_named_calls_streamed_as_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=300, parallel_tool_calls=False
    )
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and whole.choices[0].message.content is None
    for c in calls:
        check_call(c, WEATHER)
    streamed, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=300,
        parallel_tool_calls=False,
        stream=True,
    ):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == ""
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in calls
    ]


def test_logprobs_streamed_or_not(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=12, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kwargs)
    entries = reply.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == reply.choices[0].message.content
    assert len(entries) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert e.top_logprobs[0].bytes == e.bytes and e.logprob == pytest.approx(tops[0])  # greedy: the likeliest
    streamed = [
        e
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for c in chunk.choices
        if c.logprobs
        for e in c.logprobs.content
    ]
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)  # other trees
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "P", "schema": Person.model_json_schema() | {"additionalProperties": False}},
    }
    constrained = client.chat.completions.create(response_format=fmt, **{**kwargs, "max_tokens": 200})
    entries = constrained.choices[0].logprobs.content  # the unmasked distribution: forced tokens too
    assert b"".join(bytes(e.bytes) for e in entries).decode() == constrained.choices[0].message.content
    assert all(e.logprob <= 0 for e in entries) and len(entries) == constrained.usage.completion_tokens - 1
    completion = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, logprobs=2, temperature=0)
    lp = completion.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_langchain_structured_output_and_bind_tools(api_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=api_url, api_key="none", model=MODEL, temperature=0, max_tokens=200, max_retries=0
    )
    person = llm.with_structured_output(Person).invoke("Ada, 36, likes green.")
    assert isinstance(person, Person)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
