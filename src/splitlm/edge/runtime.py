"""Edge runtime: open a cloud session, run head and tail layers locally, decode.

    with Edge("split/edge", "ws://127.0.0.1:8765") as edge:
        result = edge.generate("Write a haiku about the sea.", max_new_tokens=64, chat=True)
        for piece in edge.stream("Hello"):
            print(piece, end="")
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitlm import SplitLMError
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.corpus import NgramModel, default_corpus_documents
from splitlm.decoding.head import HeadRunner, load_head
from splitlm.decoding.pipeline import pipelined_decode
from splitlm.decoding.sampling import SamplingConfig, sample_decode
from splitlm.decoding.speculative import SpecConfig, SpecStats, make_drafter, speculative_decode
from splitlm.decoding.suffix import SuffixIndex
from splitlm.decoding.warmup import find_warmup, read_warmup
from splitlm.edge.adapters import apply_edge_adapter
from splitlm.edge.onnx_runtime import OnnxEdge, parse_onnx_device
from splitlm.edge.prefill import PrefillCosts
from splitlm.edge.results import GenerationResult, Stream, format_stats  # noqa: F401 (re-exported)
from splitlm.edge.session import SPEC_HEADROOM, EdgeSession, GenerationStats
from splitlm.edge.vocab import VocabSubset, resolve_vocab
from splitlm.model.device import describe, resolve_device, resolve_dtype, to_device
from splitlm.model.shards import load_edge
from splitlm.model.splithead import edge_logits
from splitlm.transport.client import PING_INTERVAL_S, CloudClient, CloudError
from splitlm.transport.codecs import check_wire_dtype, wire_nbytes
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Open
from splitlm.transport.policy import CachePolicy

if TYPE_CHECKING:
    from splitlm.edge.conversation import Conversation

log = logging.getLogger(__name__)


FAILOVER_TIMEOUT_S = 30.0  # how long a session keeps trying to reach a cloud after losing its own
FAILOVER_BACKOFF_S = 0.05  # the first wait between rounds of the cloud list; doubles up to the max
FAILOVER_BACKOFF_MAX_S = 2.0


def parse_cloud_urls(urls: str | list[str]) -> list[str]:
    """Cloud URLs from a list or a comma-separated string."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip() for u in items if u.strip()]
    if not out:
        raise SplitLMError("no cloud URL given")
    return out


class Pool:
    """Objects that serve one request at a time: take an idle one, or make a new one."""

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._idle: list = []
        self._lock = threading.Lock()

    def take(self) -> tuple[object, bool]:
        """(object, whether it was idle in the pool rather than just made)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._make(), False

    def give(self, obj) -> None:
        with self._lock:
            self._idle.append(obj)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}, ...]) in the tokenizer's chat template,
    ready for the assistant's next turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text, or one user turn in the tokenizer's chat template."""
    if not chat:
        return tokenizer(prompt).input_ids
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}])


def find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` may not be shown yet: an incomplete UTF-8 sequence
    (decoded as U+FFFD) or the beginning of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


def as_spec(spec: SpecConfig | str | None) -> SpecConfig:
    """A SpecConfig from a mode name, or `draft:SOURCE` (SOURCE: self, self-raw or a model path)."""
    try:
        if isinstance(spec, str):
            mode, _, draft = spec.partition(":")
            return SpecConfig(mode, draft=draft or "self") if mode == "draft" else SpecConfig(spec)
        return spec or SpecConfig()
    except ValueError as e:
        raise SplitLMError(str(e)) from None


class Edge:
    """The edge side of a split model, connected to a cloud server (one of a list, to fail over to)."""

    def __init__(self, edge_dir: str | Path, cloud_url: str | list[str], wire_dtype: str = "auto",
                 timeout_s: float = 60.0, *,
                 cache_policy: str | None = "session", identity=None, cloud_key=None, known_hosts=None, tls_ca=None,
                 rekey=None, vocab: str | VocabSubset | None = "all", device: str = "auto", dtype: str = "auto",
                 failover_timeout_s: float = FAILOVER_TIMEOUT_S, ping_interval_s: float | None = PING_INTERVAL_S,
                 prefill_chunk: int | str = "auto", edge_adapter: str | Path | None = None):
        """cloud_url: one URL, or several (a list, or comma-separated) that serve the same cloud shard:
        when the connection or the cloud dies mid-request, a session reconnects (the same or the next
        one, with backoff, for at most `failover_timeout_s` seconds) and replays what the cloud lost
        (`EdgeSession.failover`); the output is the same as without the fault.
        ping_interval_s: keepalive pings both ways (a link that answers none for as long is dead); None = off.
        identity, cloud_key, known_hosts, tls_ca, rekey: see `splitlm.transport.client.CloudClient`
        (defaults: the client identity in the config dir, trust-on-first-use of the cloud's key).
        wire_dtype `auto`: fp16, or bf16 for Gemma, whose activations exceed fp16's range.
        cache_policy: what the cloud may keep between requests (`splitlm.transport.policy`): none,
        session, window:N or sealed; each session may choose its own.
        vocab: the token ids the model may emit (`splitlm.edge.vocab`): all, en, zh or an allow-list
        file; a split-head cloud computes partial logits for these only.
        device, dtype: where the edge's layers run and in which precision (`splitlm.model.device`;
        default auto: CUDA in bf16 where present, else the CPU in fp32); `onnx` or `onnx:int8`: the graphs of
        `splitlm export-onnx` in ONNX Runtime on the CPU (`splitlm.edge.onnx_runtime`).
        prefill_chunk: how a prompt goes up (`splitlm.edge.prefill`): `auto` streams it in pipelined
        chunks when the measured link and compute say that is sooner; N: in chunks of N tokens;
        0: in one forward (in chunks one after another only where the cloud's limits demand it).
        edge_adapter: a `peft` LoRA adapter directory of the full model, merged into the edge's layers
        (`splitlm.edge.adapters`); it must touch only modules the edge holds, and never leaves the edge."""
        try:
            self.cache_policy = CachePolicy.parse(cache_policy or "session")  # parsed once, here
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        if prefill_chunk != "auto" and (type(prefill_chunk) is not int or prefill_chunk < 0):
            raise SplitLMError(f"prefill_chunk must be auto or a number of tokens >= 0, not {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.prefill_costs = PrefillCosts()  # what each stage of a streamed prefill costs, as measured
        self.edge_dir = Path(edge_dir)
        self.onnx = parse_onnx_device(device)  # None, or the precision of the ONNX Runtime graphs
        if self.onnx:  # ONNX Runtime on the CPU; the caches stay torch tensors in host memory
            if dtype not in (None, "auto", "fp32"):
                raise SplitLMError(f"--device {device} sets the precision itself (onnx or onnx:int8); drop --dtype {dtype}")
            if edge_adapter:
                raise SplitLMError("--edge-adapter is merged into the graphs at export: "
                                   "`splitlm export-onnx --edge DIR --edge-adapter PATH`")
            self.device = torch.device("cpu")
            self.model = OnnxEdge(self.edge_dir, self.onnx)
        else:
            self.device = resolve_device(device)
            self.model = load_edge(self.edge_dir, self.device, resolve_dtype(dtype, self.device))
            if edge_adapter:
                apply_edge_adapter(self.model, edge_adapter)
        if wire_dtype == "auto":
            wire_dtype = self.model.cfg.wire_dtype
        try:
            self.wire_dtype = check_wire_dtype(wire_dtype)
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        self.dtype = torch.float32 if self.onnx else next(self.model.parameters()).dtype
        self.cfg = self.model.cfg
        self.tokenizer = self._load_tokenizer()
        self.split_head = self.model.split_head
        self.vocab = resolve_vocab(vocab, self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.allowed = None if self.vocab.everything else to_device(self.vocab.allowed, self.device)  # [V] bool
        self.max_logit_rows: int | None = None  # split-head: rows of logits one RESULT may hold
        if self.split_head:  # W[ids, :d], kept for the session's life (a view when every id is allowed)
            self._vocab_ids = None if self.vocab.everything else to_device(self.vocab.ids, self.device)
            w = self.model.end_weight
            self._w_end = w if self._vocab_ids is None else w.index_select(0, self._vocab_ids)
        if not self.split_head and not self.onnx:
            self.model.greedy_head()  # decides once whether its bf16 screen pays on this machine
        log.debug("edge %s: layers on %s", self.edge_dir,
                 f"ONNX Runtime (CPU) {self.onnx}" if self.onnx else describe(self.device, self.dtype))
        self._corpus: NgramModel | None = None
        self._corpus_ids: list[list[int]] | None = None
        self._suffix_index: SuffixIndex | None = None
        self._memories: dict[tuple, DraftMemory] = {}
        self._drafts: dict[str, object] = {}
        self._budgets: dict[tuple, Pool] = {}
        self._lock = threading.Lock()  # the pools' table, the corpus model, the tokenizer
        self.cloud_urls = parse_cloud_urls(cloud_url)
        self._url = 0  # the URL new connections try first (the last one that worked)
        self.failover_timeout_s = failover_timeout_s
        self._connect_args = dict(fingerprint=self.model.manifest.fingerprint, timeout_s=timeout_s,
                                  identity=identity, cloud_key=cloud_key, known_hosts=known_hosts, tls_ca=tls_ca,
                                  rekey=rekey, ping_interval_s=ping_interval_s, ping_timeout_s=ping_interval_s)
        self._connections: set[CloudClient] = set()
        self._clients = Pool(self._connect)
        self.client = self._connect()  # the first connection: fail early if the cloud cannot be reached
        self._clients.give(self.client)
        if self.split_head:
            frame = min(self.client.max_frame_bytes,
                        self.client.info.limits.max_frame_bytes or self.client.max_frame_bytes)
            per_row = wire_nbytes(self.wire_dtype, [1, self.vocab.size]) + \
                wire_nbytes(self.wire_dtype, [1, self.model.manifest.d_end])
            self.max_logit_rows = max(1, (frame - 4096) // per_row)  # the cloud keeps 4 KiB for metadata and framing

    def _connect(self, after: str | None = None, open_timeout_s: float | None = None) -> CloudClient:
        """A connection to the first cloud that answers, starting with the one that worked last (or,
        with `after`, the URL after that one: a failover tries the next server first)."""
        n = len(self.cloud_urls)
        first = (self.cloud_urls.index(after) + 1) % n if after in self.cloud_urls else self._url
        args = dict(self._connect_args)
        if open_timeout_s is not None:
            args["timeout_s"] = min(args["timeout_s"], max(open_timeout_s, 0.1))
        for i in range(n):
            k = (first + i) % n
            try:
                client = CloudClient(self.cloud_urls[k], **args)
            except CloudError as e:
                if not e.retryable or i == n - 1:
                    raise
                log.info("%s", e)
                continue
            if open_timeout_s is not None:
                client.timeout_s = self._connect_args["timeout_s"]
            self._url = k
            with self._lock:
                self._connections.add(client)
            return client
        raise AssertionError("unreachable")

    def reconnect(self, cache_policy: CachePolicy, vocab: bytes | None, after: str,
                  deadline: float) -> tuple[CloudClient, int]:
        """A new connection and session after `after` failed: the next cloud first, then round the list
        again, with exponential backoff and jitter between rounds, until `deadline` (time.monotonic())."""
        delay = FAILOVER_BACKOFF_S
        while True:
            client = None
            try:
                client = self._connect(after, deadline - time.monotonic())
                return client, client.open(Open(self.wire_dtype, cache_policy, vocab)).session
            except CloudError as e:
                if client is not None:  # reached but refused: the next round starts after it
                    self._drop_client(client)
                    after = client.url
                if not (e.retryable or e.code == ErrorCode.CAPACITY):  # a full cloud: try the next
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CloudError(f"failover gave up after {self.failover_timeout_s:g} s: {e}", e.code) from None
                log.info("no cloud yet (%s); retrying in %.2f s", e, delay)
                time.sleep(min(left, delay * random.uniform(0.5, 1.5)))
                delay = min(FAILOVER_BACKOFF_MAX_S, delay * 2)

    def _drop_client(self, client: CloudClient) -> None:
        with self._lock:
            self._connections.discard(client)
        client.close()

    def _open_cloud_session(self, cache_policy: CachePolicy, vocab: bytes | None = None) -> tuple[CloudClient, int]:
        """A connection of this thread's own and a new cloud session on it (failing over, as `reconnect`,
        when the cloud cannot be reached or the idle connection had gone stale)."""
        after = None
        try:
            client, _ = self._clients.take()
        except CloudError as e:
            if not e.retryable:
                raise
        else:
            try:
                return client, client.open(Open(self.wire_dtype, cache_policy, vocab)).session
            except CloudError as e:
                self._drop_client(client)
                if not e.retryable:
                    raise
                after = client.url
        return self.reconnect(cache_policy, vocab, after, time.monotonic() + self.failover_timeout_s)

    def split_head_logits(self, out: dict[str, torch.Tensor], n_rows: int) -> torch.Tensor:
        """Logits [R, V] from a split-head RESULT: h[:d] [R, d] and partial logits [R, S]."""
        h_end, z = out["hidden"], out.get("logits")
        d, s = self.model.manifest.d_end, self.vocab.size
        if z is None or h_end.shape != (n_rows, d) or z.shape != (n_rows, s):
            raise SplitLMError(f"the cloud's split-head RESULT does not hold {n_rows} rows of h[:{d}] and {s} logits")
        return edge_logits(self.model, to_device(h_end, self.device), to_device(z, self.device), self._vocab_ids,
                           self._w_end)

    def _load_tokenizer(self):
        if not (self.edge_dir / "tokenizer.json").is_file() and not (self.edge_dir / "tokenizer.model").is_file():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.edge_dir)

    def __enter__(self) -> Edge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for client in connections:
            client.close()

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + generated) a request may hold: the model's and the cloud's limit."""
        cloud = self.client.info.limits.max_tokens_per_session
        return min(self.cfg.max_position_embeddings, cloud or self.cfg.max_position_embeddings)

    def check_fits(self, prompt_tokens: int) -> None:
        """Refuse, before anything is sent, a prompt that leaves no room for one new token."""
        if prompt_tokens >= self.context_length:
            raise SplitLMError(f"the prompt has {prompt_tokens} tokens, but this model's context holds "
                               f"{self.context_length} (prompt and answer together); shorten the prompt")

    def corpus_documents(self) -> list[str]:
        """Local text for the `auto` drafter: Python's pydoc topics and, when there is one for this
        model, a warm-up file of its own answers (`splitlm warmup`; bundled for the default model)."""
        docs = default_corpus_documents()
        warmup = find_warmup(self.edge_dir, self.model.manifest.model_hash)
        return docs + (read_warmup(warmup) if warmup is not None else [])

    def corpus_ids(self) -> list[list[int]]:
        """The local text's documents as token ids (tokenized once; none without a tokenizer)."""
        with self._lock:
            if self._corpus_ids is None:
                self._corpus_ids = [] if self.tokenizer is None else \
                    self.tokenizer(self.corpus_documents(), add_special_tokens=False).input_ids
            return self._corpus_ids

    def corpus_model(self) -> NgramModel | None:
        """The n-gram model of local text the `auto-window` drafter uses (built once, a few s; needs the tokenizer)."""
        if self.tokenizer is None:
            return None
        docs = self.corpus_ids()
        with self._lock:
            if self._corpus is None:
                self._corpus = NgramModel([tok for doc in docs for tok in doc])
            return self._corpus

    def draft_memory(self, spec: SpecConfig) -> DraftMemory:
        """What the `recycle`, `suffix`, `head` and `auto` drafters keep across this edge's requests, one per
        speculative configuration: built on first use (the corpus's suffix index and the recycled table's
        seed: a few s), the trained head loaded if the shard has one. Never sent."""
        docs = self.corpus_ids()
        with self._lock:
            if self._suffix_index is None:
                self._suffix_index = SuffixIndex(docs)
            key = (spec.mode, spec.max_nodes, spec.cost)
            if key not in self._memories:
                # the head reads the final hidden state: split-head and ONNX edges have none
                head = None if self.split_head or self.onnx else load_head(self.edge_dir, self.model.manifest.model_hash)
                runner = None
                if head is not None:
                    scale = self.cfg.embed_scale
                    runner = HeadRunner(head.to(self.device), self.model.embed_tokens.weight, self.model.head_weight, scale)
                self._memories[key] = DraftMemory.seeded(self._suffix_index, runner)
            return self._memories[key]

    def draft_lm(self, draft: str):
        """The draft model of `--spec draft` (loaded once per edge; its caches are per request)."""
        from splitlm.decoding.draft import make_draft_lm

        if self.onnx and draft in ("self", "self-raw"):
            raise SplitLMError(f"--spec draft --draft {draft} runs the edge's torch layers; with --device onnx "
                               "use --spec auto, ngram or lookahead, or a draft model path")
        with self._lock:
            if draft not in self._drafts:
                self._drafts[draft] = make_draft_lm(draft, self.model, self.edge_dir)
            return self._drafts[draft]

    def open_session(self, cache_policy: str | CachePolicy | None = None) -> EdgeSession:
        return EdgeSession(self, cache_policy)

    def conversation(self, system: str | None = None, spec: SpecConfig | str | None = None,
                     cache_policy: str | None = None, sampling: SamplingConfig | None = None) -> Conversation:
        """A multi-turn chat that keeps its cloud session (and the authorised cache) across turns."""
        from splitlm.edge.conversation import Conversation

        return Conversation(self, system, as_spec(spec), cache_policy, sampling)

    @property
    def has_chat_template(self) -> bool:
        """Whether prompts can be wrapped in the model's chat template (what `--chat` defaults to)."""
        return self.tokenizer is not None and bool(self.tokenizer.chat_template)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise SplitLMError(f"{self.edge_dir} has no tokenizer; pass token ids instead of text")
        if chat and not self.tokenizer.chat_template:
            raise SplitLMError("this model's tokenizer has no chat template; drop --chat")
        with self._lock:
            return encode_prompt(self.tokenizer, prompt, chat)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation [{"role": "system"|"user"|"assistant", "content": str}, ...] in the
        chat template, ending where the assistant's next answer begins."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise SplitLMError("this model's tokenizer has no chat template")
        with self._lock:
            return encode_messages(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list | tuple) else self.encode(prompt, chat)
        if not ids:
            raise SplitLMError("the prompt is empty")
        return ids

    def _budget_pool(self, spec: SpecConfig) -> Pool:
        with self._lock:
            key = (spec.mode, spec.max_nodes, spec.window, spec.pipeline, spec.cost)
            if key not in self._budgets:
                self._budgets[key] = Pool(lambda: StepBudget(max_nodes=spec.budget_nodes, fixed_nodes=spec.max_nodes,
                                                             cost=spec.cost))
            return self._budgets[key]

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 128, stop_at_eos: bool = True,
                     spec: SpecConfig | None = None, sampling: SamplingConfig | None = None,
                     session: EdgeSession | None = None,
                     cached: int = 0) -> Iterator[tuple[list[int], GenerationStats]]:
        """Decode; yields (new tokens of one step, live stats). Greedy (the default `sampling`): with
        `spec` mode `none` every step is one round trip and one token, other modes verify a drafted
        tree per step. With a temperature > 0 (or a repetition penalty) trees are verified by exact
        speculative sampling: the output is distributed as plain sampling; the same seed gives the
        same output for the same spec mode. Safe to call from several threads at once: each call
        has its own cloud connection.

        With `session` (kept open by the caller), the first `cached` prompt tokens are already in
        its caches; otherwise a session is opened and closed for this request."""
        if max_new_tokens < 1:
            raise SplitLMError("max_new_tokens must be at least 1")
        self.check_fits(len(prompt_ids))
        sampling = sampling or SamplingConfig()
        spec = spec or SpecConfig()
        if len(prompt_ids) + max_new_tokens + SPEC_HEADROOM > self.context_length:
            spec = SpecConfig("none")  # the end of the context leaves no room for trees
        eos = set(self.cfg.eos_token_ids) if stop_at_eos else set()
        # what a budget learns (link, compute cost, drafters' calibration) carries over between requests;
        # requests running at the same time each take their own
        budgets = self._budget_pool(spec)
        budget, _ = budgets.take()
        own = session is None
        if own:
            session = self.open_session()
        session.stats = s = GenerationStats()
        s.prompt_tokens, s.cached_tokens = len(prompt_ids), cached
        s.spec_mode = spec.mode + (" pipelined" if spec.pipeline and spec.mode != "none" else "") + \
            ("" if sampling.plain_greedy else " (sampling)")
        spec_stats = SpecStats()
        try:
            # built once, before the clock
            corpus = self.corpus_model() if spec.mode == "auto-window" else None
            memory = self.draft_memory(spec) if spec.mode in ("recycle", "suffix", "head", "auto") else None
            draft_lm = self.draft_lm(spec.draft) if spec.mode == "draft" else None
            try:
                drafter = make_drafter(spec, corpus, draft_lm, memory)
            except ValueError as e:
                raise SplitLMError(str(e)) from None
            produced: list[int] = []
            start = time.perf_counter()
            if spec.mode == "none" and not sampling.plain_greedy:
                steps = sample_decode(session, prompt_ids, max_new_tokens, eos, sampling, cached=cached)
            elif spec.pipeline and spec.mode != "none" and session.pipelines:
                steps = pipelined_decode(session, prompt_ids, max_new_tokens, eos, drafter,
                                         budget, spec_stats, cached=cached, sampling=sampling)
            else:
                steps = speculative_decode(session, prompt_ids, max_new_tokens, eos, drafter,
                                           budget, spec_stats, adaptive=spec.mode == "auto-window", cached=cached,
                                           sampling=sampling)
            for new in steps:
                produced += new
                if s.new_tokens == 0:
                    s.prefill_s = time.perf_counter() - start
                s.new_tokens += len(new)
                s.decode_s = time.perf_counter() - start - s.prefill_s
                if spec.mode != "none":
                    s.spec = {**spec_stats.to_dict(), "rtt_s": round(budget.rtt_s, 4),
                              "compute_c0_s": round(budget.compute.c0, 5),
                              "compute_c1_s": round(budget.compute.c1, 6),
                              "overhead_s": round(budget.overhead_s, 5)}
                yield new, s
            if memory is not None:
                memory.past.add(produced)  # the edge's own outputs, for later requests' retrieval
        finally:
            budgets.give(budget)
            if own:
                session.close()

    def _run(self, prompt, max_new_tokens, chat, stop_at_eos, spec, sampling,
             stop) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (new text, None) while decoding, then (last text, result). Text that could be the
        start of a stop string is held back until it is not; at a stop string the text is cut."""
        return self.run_ids(self._prompt_ids(prompt, chat), max_new_tokens, stop_at_eos, spec, sampling, stop)

    def run_ids(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool, spec: SpecConfig,
                sampling: SamplingConfig | None = None, stop: str | list[str] | None = None,
                session: EdgeSession | None = None, cached: int = 0) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (new text, None) while decoding, then (last text, result); see `_run`."""
        stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
        ids: list[int] = []
        text, sent = "", 0  # decoded text; how much of it was yielded
        stats = GenerationStats()
        finish = "length"
        steps = self.generate_ids(prompt_ids, max_new_tokens, stop_at_eos, spec, sampling, session, cached)
        try:
            for tokens, live_stats in steps:
                ids.extend(tokens)
                stats = live_stats
                text = self.decode(ids)
                cut = find_stop(text, stops)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                safe = len(text) - held_back(text, stops)
                if safe > sent:
                    yield text[sent:safe], None
                    sent = safe
        finally:
            steps.close()
        if finish != "stop" and stop_at_eos and ids and ids[-1] in self.cfg.eos_token_ids:
            finish = "stop"
        yield text[sent:], GenerationResult(text, ids, stats, finish, prompt_ids)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False,
                 stop_at_eos: bool = True, spec: SpecConfig | str | None = None,
                 sampling: SamplingConfig | None = None, stop: str | list[str] | None = None) -> GenerationResult:
        """Generate from a prompt (text, or token ids). `stop`: stop strings (the text ends before the
        first one); `sampling`: temperature / top-p / top-k / seed (default greedy)."""
        *_, (_, result) = self._run(prompt, max_new_tokens, chat, stop_at_eos, as_spec(spec), sampling, stop)
        return result

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool = False,
               stop_at_eos: bool = True, spec: SpecConfig | str | None = None,
               sampling: SamplingConfig | None = None, stop: str | list[str] | None = None) -> Stream:
        """Like `generate`, as text pieces; the pieces join to the text `generate` returns."""
        return Stream(self._run(prompt, max_new_tokens, chat, stop_at_eos, as_spec(spec), sampling, stop))
