"""Edge runtime: open a cloud session, run head and tail layers locally, decode.

    with Edge("split/edge", "ws://127.0.0.1:8765") as edge:
        result = edge.generate("Write a haiku about the sea.", max_new_tokens=64, chat=True)
        for piece in edge.stream("Hello"):
            print(piece, end="")

`Edge` is the user's API (generate, stream, conversations, encode/decode); what it is made of lives
in modules of their own: the layers behind one interface (`splitlm.edge.backends`), the connections
to the clouds (`splitlm.edge.connections`), the tokenizer and streamed text (`splitlm.edge.text`),
the drafters' state across requests (`splitlm.edge.drafting`) and the sessions
(`splitlm.edge.session`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from splitlm import SplitLMError
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.corpus import NgramModel
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.grammar import GrammarSpec, grammar_from_format
from splitlm.decoding.logprobs import LogprobRecorder
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter, spec_mode
from splitlm.decoding.request import DecodeRequest, GrammarStats, Speculation
from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecStats
from splitlm.edge.backends import load_model, make_backend
from splitlm.edge.connections import FAILOVER_TIMEOUT_S, ClientSettings, CloudConnections
from splitlm.edge.drafting import DraftState
from splitlm.edge.grammars import EdgeGrammars
from splitlm.edge.link import StepObserver
from splitlm.edge.onnx_runtime import parse_onnx_device
from splitlm.edge.prefill import PrefillCosts
from splitlm.edge.results import GenerationResult, GenerationStats, Stream, format_stats  # noqa: F401 (re-exported)
from splitlm.edge.session import SPEC_HEADROOM, EdgeSession, SessionSetup
from splitlm.edge.text import TextCodec, text_pieces
from splitlm.edge.vocab import VocabSubset, resolve_vocab
from splitlm.transport.client import PING_INTERVAL_S
from splitlm.transport.codecs import check_wire_dtype
from splitlm.transport.policy import CachePolicy

if TYPE_CHECKING:
    from splitlm.decoding.budget import StepBudget
    from splitlm.edge.conversation import Conversation

log = logging.getLogger(__name__)


def as_spec(spec: SpecConfig | str | None) -> SpecConfig:
    """A SpecConfig from a mode name (`splitlm.decoding.modes.SPEC_MODES`)."""
    try:
        if isinstance(spec, str):
            return SpecConfig(spec)
        return spec or SpecConfig()
    except ValueError as e:
        raise SplitLMError(str(e)) from None


def spec_label(spec: SpecConfig, sampling: SamplingConfig) -> str:
    """How a request decodes, for its stats: `auto`, `lookahead pipelined`, `none (sampling)`, ..."""
    return (
        spec.mode
        + (" pipelined" if spec.pipeline and spec.mode != "none" else "")
        + ("" if sampling.plain_greedy else " (sampling)")
    )


class Edge:
    """The edge side of a split model, connected to a cloud server (one of a list, to fail over to)."""

    def __init__(
        self,
        edge_dir: str | Path,
        cloud_url: str | list[str],
        wire_dtype: str = "auto",
        timeout_s: float = 60.0,
        *,
        cache_policy: str | None = "session",
        identity=None,
        cloud_key=None,
        known_hosts=None,
        tls_ca=None,
        rekey=None,
        vocab: str | VocabSubset | None = "all",
        device: str = "auto",
        dtype: str = "auto",
        failover_timeout_s: float = FAILOVER_TIMEOUT_S,
        ping_interval_s: float | None = PING_INTERVAL_S,
        prefill_chunk: int | str = "auto",
        edge_adapter: str | Path | None = None,
    ):
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
        self.observer: StepObserver | None = None  # sees the sessions' forwards and results (`splitlm.bench.trace`)
        self.edge_dir = Path(edge_dir)
        self.onnx = parse_onnx_device(device)  # None, or the precision of the ONNX Runtime graphs
        self.model, self.device = load_model(self.edge_dir, device, dtype, edge_adapter)
        self.cfg = self.model.cfg
        try:
            self.wire_dtype = check_wire_dtype(self.cfg.wire_dtype if wire_dtype == "auto" else wire_dtype)
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        self.text = TextCodec(self.edge_dir)  # the tokenizer, and the lock its users share
        self.tokenizer = self.text.tokenizer
        self.split_head = self.model.split_head
        self.vocab = resolve_vocab(vocab, self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.grammars = EdgeGrammars(self.text, self.cfg.vocab_size, self.cfg.eos_token_ids)  # constrained decoding
        self.backend = make_backend(self.model, self.vocab, self.device)  # what every session runs on the edge
        self.dtype = self.backend.dtype
        self.drafting = DraftState(self.edge_dir, self.model, self.device, self.text, self.backend.final_hidden)
        self.connections = CloudConnections(
            cloud_url,
            ClientSettings(
                self.model.manifest.fingerprint,
                timeout_s,
                identity,
                cloud_key,
                known_hosts,
                tls_ca,
                rekey,
                ping_interval_s,
            ),
            failover_timeout_s,
        )
        self.cloud_urls = self.connections.urls
        self.client = self.connections.connect()  # the first connection: fail early if the cloud cannot be reached
        self.connections.give(self.client)
        self.backend.connected(self.client, self.wire_dtype)

    def __enter__(self) -> Edge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.connections.close()

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + generated) a request may hold: the model's and the cloud's limit."""
        cloud = self.client.info.limits.max_tokens_per_session
        return min(self.cfg.max_position_embeddings, cloud or self.cfg.max_position_embeddings)

    def check_fits(self, prompt_tokens: int) -> None:
        """Refuse, before anything is sent, a prompt that leaves no room for one new token."""
        if prompt_tokens >= self.context_length:
            raise SplitLMError(
                f"the prompt has {prompt_tokens} tokens, but this model's context holds "
                f"{self.context_length} (prompt and answer together); shorten the prompt"
            )

    def corpus_documents(self) -> list[str]:
        """Local text for the `auto` drafter (`DraftState.corpus_documents`)."""
        return self.drafting.corpus_documents()

    def corpus_model(self) -> NgramModel | None:
        """The n-gram model of local text the `auto-window` drafter uses (`DraftState.corpus_model`)."""
        return self.drafting.corpus_model()

    def draft_memory(self, spec: SpecConfig) -> DraftMemory:
        """What the memory-keeping drafters keep across this edge's requests (`DraftState.draft_memory`)."""
        return self.drafting.draft_memory(spec)

    def open_session(self, cache_policy: str | CachePolicy | None = None) -> EdgeSession:
        """A cloud session of its own (a connection from the pool) with the edge's caches for it."""
        setup = SessionSetup(
            self.backend,
            self.connections,
            self.wire_dtype,
            self.cache_policy,
            self.model.manifest.head,
            self.prefill_chunk,
            self.prefill_costs,
            self.observer,
        )
        return EdgeSession(setup, cache_policy)

    def conversation(
        self,
        system: str | None = None,
        spec: SpecConfig | str | None = None,
        cache_policy: str | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Conversation:
        """A multi-turn chat that keeps its cloud session (and the authorised cache) across turns."""
        from splitlm.edge.conversation import Conversation

        return Conversation(self, system, as_spec(spec), cache_policy, sampling)

    @property
    def has_chat_template(self) -> bool:
        """Whether prompts can be wrapped in the model's chat template (what `--chat` defaults to)."""
        return self.text.has_chat_template

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return self.text.encode(prompt, chat)

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation [{"role": "system"|"user"|"assistant", "content": str}, ...] in the
        chat template, ending where the assistant's next answer begins; `tools`: function definitions,
        for a template that lays them out (`TextCodec.template_takes_tools`)."""
        return self.text.encode_messages(messages, tools)

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    def _drafter(self, spec: SpecConfig) -> tuple[Drafter, DraftMemory | None]:
        """The drafter of a request, and the memory it keeps across requests (None if it keeps none)."""
        mode = spec_mode(spec.mode)
        corpus = self.corpus_model() if mode.needs_corpus else None
        memory = self.draft_memory(spec) if mode.needs_memory else None
        text = self.grammars.text_view() if mode.needs_text else None
        try:
            return make_drafter(spec, corpus, memory, text), memory
        except ValueError as e:
            raise SplitLMError(str(e)) from None

    def _request_spec(self, n_prompt: int, max_new_tokens: int, spec: SpecConfig | None) -> SpecConfig:
        """Refuse a request that cannot run; its speculative configuration (`none` where the end of the
        context leaves no room for trees)."""
        if max_new_tokens < 1:
            raise SplitLMError("max_new_tokens must be at least 1")
        self.check_fits(n_prompt)
        if n_prompt + max_new_tokens + SPEC_HEADROOM > self.context_length:
            return SpecConfig("none")
        return spec or SpecConfig()

    def _speculation(
        self,
        spec: SpecConfig,
        sampling: SamplingConfig,
        constrained: bool,
        drafter: Drafter,
        budget: StepBudget,
        stats: SpecStats,
        session: EdgeSession,
    ) -> Speculation:
        """How a request drafts: not at all (one token per round trip) in mode `none` when constrained or
        sampled, pipelined where `spec` asks for it and the session allows it (not with a grammar), else
        a tree per step."""
        if spec.mode == "none" and (constrained or not sampling.plain_greedy):
            return Speculation(stats=stats)
        if spec.pipeline and spec.mode != "none" and session.pipelines and not constrained:
            return Speculation(drafter, budget, stats, pipeline=True, bet_drafter=self._drafter(spec)[0])
        return Speculation(drafter, budget, stats)

    def generate_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 128,
        stop_at_eos: bool = True,
        spec: SpecConfig | None = None,
        sampling: SamplingConfig | None = None,
        session: EdgeSession | None = None,
        cached: int = 0,
        *,
        logprobs: LogprobRecorder | None = None,
        grammar: GrammarSpec | None = None,
    ) -> Iterator[tuple[list[int], GenerationStats]]:
        """Decode; yields (new tokens of one step, live stats). Greedy (the default `sampling`): with
        `spec` mode `none` every step is one round trip and one token, other modes verify a drafted
        tree per step. With a temperature > 0 (or a repetition penalty) trees are verified by exact
        speculative sampling: the output is distributed as plain sampling; the same seed gives the
        same output for the same spec mode. Safe to call from several threads at once: each call
        has its own cloud connection.

        With `session` (kept open by the caller), the first `cached` prompt tokens are already in
        its caches; otherwise a session is opened and closed for this request. `logprobs` records
        each emitted token's log-probability (`splitlm.decoding.logprobs`; greedy steps then bring
        logits back instead of the screened head's tokens). `grammar`: the output matches it (`edge.grammars`)."""
        spec = self._request_spec(len(prompt_ids), max_new_tokens, spec)
        state = None if grammar is None else self.grammars.start(grammar)  # compiled before anything is sent
        sampling = sampling or SamplingConfig()
        eos = set(self.cfg.eos_token_ids) if stop_at_eos else set()
        # what a budget learns (link, compute cost, drafters' calibration) carries over between requests;
        # requests running at the same time each take their own
        budgets = self.drafting.budgets(spec, constrained=grammar is not None)
        budget, _ = budgets.take()
        own = session is None
        called = time.perf_counter()
        if own:
            session = self.open_session()
        session.stats = s = GenerationStats()
        s.prompt_tokens, s.cached_tokens = len(prompt_ids), cached
        s.spec_mode = spec_label(spec, sampling)
        spec_stats = SpecStats()
        try:
            drafter, memory = self._drafter(spec)  # built once, before the clock
            s.drafter = drafter.name
            produced: list[int] = []
            start = time.perf_counter()
            s.setup_s = start - called
            gstats = None if state is None else GrammarStats()
            speculation = self._speculation(spec, sampling, state is not None, drafter, budget, spec_stats, session)
            request = DecodeRequest(
                prompt_ids,
                max_new_tokens,
                eos,
                cached,
                sampling,
                logprobs,
                grammar=state,
                grammar_stats=gstats,
                speculation=speculation,
            )
            steps = decode(session, request)  # closed with this frame, as before: after the finally below
            for new in steps:
                if gstats is not None:
                    s.grammar = gstats.to_dict()
                produced += new
                if s.new_tokens == 0:
                    s.prefill_s = time.perf_counter() - start
                s.new_tokens += len(new)
                s.decode_s = time.perf_counter() - start - s.prefill_s
                if spec.mode != "none":
                    s.spec = {
                        **spec_stats.to_dict(),
                        "rtt_s": round(budget.rtt_s, 4),
                        "compute_c0_s": round(budget.compute.c0, 5),
                        "compute_c1_s": round(budget.compute.c1, 6),
                        "overhead_s": round(budget.overhead_s, 5),
                    }
                    s.count_drafts(spec_stats)
                yield new, s
            if memory is not None:
                memory.past.add(produced)  # the edge's own outputs, for later requests' retrieval
        finally:
            budgets.give(budget)
            if own:
                session.close()

    def run_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_at_eos: bool,
        spec: SpecConfig,
        sampling: SamplingConfig | None = None,
        stop: str | list[str] | None = None,
        session: EdgeSession | None = None,
        cached: int = 0,
        *,
        logprobs: LogprobRecorder | None = None,
        grammar: GrammarSpec | None = None,
    ) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (new text, None) while decoding, then (last text, result). Text that could be the
        start of a stop string is held back until it is not; at a stop string the text is cut
        (`splitlm.edge.text.text_pieces`)."""
        steps = self.generate_ids(
            prompt_ids, max_new_tokens, stop_at_eos, spec, sampling, session, cached, logprobs=logprobs, grammar=grammar
        )
        return text_pieces(
            steps, self.decode, prompt_ids, stop, set(self.cfg.eos_token_ids) if stop_at_eos else set(), logprobs
        )

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 128,
        chat: bool = False,
        stop_at_eos: bool = True,
        spec: SpecConfig | str | None = None,
        sampling: SamplingConfig | None = None,
        stop: str | list[str] | None = None,
        *,
        logprobs: LogprobRecorder | None = None,
        response_format=None,
    ) -> GenerationResult:
        """Generate from a prompt (text, or token ids). `stop`: stop strings (the text ends before the
        first one); `sampling`: temperature / top-p / top-k / seed (default greedy); `logprobs`: a
        `LogprobRecorder(top=k)` that receives each token's log-probability (also in `result.logprobs`);
        `response_format`: a JSON schema, pydantic class or `GrammarSpec` the output matches (`grammar_from_format`)."""
        *_, (_, result) = self.run_ids(
            self.text.prompt_ids(prompt, chat),
            max_new_tokens,
            stop_at_eos,
            as_spec(spec),
            sampling,
            stop,
            logprobs=logprobs,
            grammar=grammar_from_format(response_format),
        )
        return result

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 128,
        chat: bool = False,
        stop_at_eos: bool = True,
        spec: SpecConfig | str | None = None,
        sampling: SamplingConfig | None = None,
        stop: str | list[str] | None = None,
        session: EdgeSession | None = None,
        cached: int = 0,
        *,
        logprobs: LogprobRecorder | None = None,
        response_format=None,
    ) -> Stream:
        """Like `generate`, as text pieces (they join to its text); `session`, `cached`: see `generate_ids`."""
        return Stream(
            self.run_ids(
                self.text.prompt_ids(prompt, chat),
                max_new_tokens,
                stop_at_eos,
                as_spec(spec),
                sampling,
                stop,
                session,
                cached,
                logprobs=logprobs,
                grammar=grammar_from_format(response_format),
            )
        )
