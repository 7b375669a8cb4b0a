"""Edge runtime: open a cloud session, run head and tail layers locally, decode.

    with Edge("split/edge", "ws://127.0.0.1:8765", EdgeConfig(wire_dtype="fp32")) as edge:
        result = edge.generate("Write a haiku about the sea.", max_new_tokens=64, chat=True)
        for piece in edge.stream(GenerationRequest("Hello", stop=["."])):
            print(piece, end="")

`Edge` is the user's API (generate, stream, conversations; `edge.text` encodes and decodes); what it is made of lives
in modules of their own: the layers behind one interface (`splitlm.edge.backends`), the connections
to the clouds (`splitlm.edge.connections`), the tokenizer and streamed text (`splitlm.edge.text`),
the drafters' state across requests (`splitlm.edge.drafting`) and the sessions
(`splitlm.edge.session`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from splitlm import SplitLMError
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.request import DecodeRequest, GrammarStats, Speculation
from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecStats
from splitlm.edge.backends import load_model, make_backend
from splitlm.edge.config import EdgeConfig
from splitlm.edge.connections import CloudConnections
from splitlm.edge.drafting import DraftState
from splitlm.edge.grammars import EdgeGrammars
from splitlm.edge.link import StepObserver
from splitlm.edge.onnx_runtime import parse_onnx_device
from splitlm.edge.prefill import PrefillCosts
from splitlm.edge.request import GenerationRequest, as_spec, request_of, spec_label
from splitlm.edge.results import GenerationResult, GenerationStats, Stream, format_stats  # noqa: F401 (re-exported)
from splitlm.edge.session import SPEC_HEADROOM, EdgeSession, SessionSetup
from splitlm.edge.text import TextCodec, text_pieces
from splitlm.edge.vocab import resolve_vocab
from splitlm.transport.client import CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.policy import CachePolicy

if TYPE_CHECKING:
    from splitlm.decoding.budget import StepBudget
    from splitlm.edge.conversation import Conversation

log = logging.getLogger(__name__)

__all__ = ["Edge", "EdgeConfig", "GenerationRequest", "GenerationResult", "GenerationStats", "Stream", "as_spec"]


class Edge:
    """The edge side of a split model, connected to a cloud server (one of a list, to fail over to)."""

    def __init__(self, edge_dir: str | Path, cloud_url: str | list[str], config: EdgeConfig | None = None):
        """cloud_url: one URL, or several (a list, or comma-separated) that serve the same cloud shard:
        when the connection or the cloud dies mid-request, a session reconnects (the same or the next
        one, with backoff, for at most `config.failover_timeout_s` seconds) and replays what the cloud
        lost (`EdgeSession.failover`); the output is the same as without the fault. `config`: how it
        connects and runs its layers (`splitlm.edge.config.EdgeConfig`; default: its defaults)."""
        self.config = config = config or EdgeConfig()
        self.cache_policy = config.policy()  # parsed once, here
        self.prefill_chunk = config.prefill_chunk
        self.prefill_costs = PrefillCosts()  # what each stage of a streamed prefill costs, as measured
        self.observer: StepObserver | None = None  # sees the sessions' forwards and results (`splitlm.bench.trace`)
        self.edge_dir = Path(edge_dir)
        self.onnx = parse_onnx_device(config.device)  # None, or the precision of the ONNX Runtime graphs
        self.model, self.device = load_model(self.edge_dir, config.device, config.dtype, config.edge_adapter)
        self.cfg = self.model.cfg
        self.wire_dtype = config.wire(self.cfg.wire_dtype)
        self.text = TextCodec(self.edge_dir)  # the tokenizer, and the lock its users share
        self.tokenizer = self.text.tokenizer
        self.split_head = self.model.split_head
        self.vocab = resolve_vocab(config.vocab, self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.grammars = EdgeGrammars(self.text, self.cfg.vocab_size, self.cfg.eos_token_ids)  # constrained decoding
        self.backend = make_backend(self.model, self.vocab, self.device)  # what every session runs on the edge
        self.dtype = self.backend.dtype
        self.drafting = DraftState(self.edge_dir, self.model, self.device, self.text, self.backend.final_hidden)
        settings = config.client_settings(self.model.manifest.fingerprint)
        self.connections = CloudConnections(cloud_url, settings, config.failover_timeout_s, config.capacity_timeout_s)
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
        """Refuse, before anything is sent, a prompt that leaves no room for one new token, or one that
        the cloud's whole KV budget (HELLO_OK) could never hold (`EXCEEDS_BUDGET`, as the cloud would)."""
        if prompt_tokens >= self.context_length:
            raise SplitLMError(
                f"the prompt has {prompt_tokens} tokens, but this model's context holds "
                f"{self.context_length} (prompt and answer together); shorten the prompt"
            )
        budget = self.client.info.limits.kv_budget_entries
        if budget is not None and prompt_tokens + 1 > budget:
            raise CloudError(
                f"cloud error EXCEEDS_BUDGET: the prompt needs {prompt_tokens + 1} cache entries on the cloud, "
                f"but its whole KV budget holds {budget}: it can never fit there",
                ErrorCode.EXCEEDS_BUDGET,
            )

    def open_session(self, cache_policy: str | CachePolicy | None = None) -> EdgeSession:
        """A cloud session of its own (a connection from the pool) with the edge's caches for it."""
        return EdgeSession(SessionSetup.of(self), cache_policy)

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

    def _drafter(self, spec: SpecConfig) -> tuple[Drafter, DraftMemory | None]:
        """The drafter of a request, and the memory it keeps across requests (`DraftState.drafter`)."""
        return self.drafting.drafter(spec, self.grammars)

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
        self, request: GenerationRequest, session: EdgeSession | None = None, cached: int = 0
    ) -> Iterator[tuple[list[int], GenerationStats]]:
        """Decode `request` (its prompt as token ids, or text encoded as `chat` says; `stop` strings are
        `run_ids`' business); yields (new tokens of one step, live stats). Greedy (the default `sampling`): with
        `spec` mode `none` every step is one round trip and one token, other modes verify a drafted
        tree per step. With a temperature > 0 (or a repetition penalty) trees are verified by exact
        speculative sampling: the output is distributed as plain sampling; the same seed gives the
        same output for the same spec mode. Safe to call from several threads at once: each call
        has its own cloud connection.

        With `session` (kept open by the caller), the first `cached` prompt tokens are already in
        its caches; otherwise a session is opened and closed for this request. `logprobs` records
        each emitted token's log-probability (`splitlm.decoding.logprobs`; greedy steps then bring
        logits back instead of the screened head's tokens). `response_format`: the output matches it
        (`edge.grammars`)."""
        prompt_ids = self.text.prompt_ids(request.prompt, request.chat)
        max_new_tokens, logprobs = request.max_new_tokens, request.logprobs
        spec = self._request_spec(len(prompt_ids), max_new_tokens, request.spec_config())
        grammar = request.grammar()
        state = None if grammar is None else self.grammars.start(grammar)  # compiled before anything is sent
        sampling = request.sampling or SamplingConfig()
        eos = set(self.cfg.eos_token_ids) if request.stop_at_eos else set()
        # what a budget learns (link, compute cost, drafters' calibration) carries over between requests;
        # requests running at the same time each take their own
        budgets = self.drafting.budgets(spec, constrained=grammar is not None)
        budget, _ = budgets.take()
        own = session is None
        called = time.perf_counter()
        if own:
            session = self.open_session()
        session.stats = s = GenerationStats()
        spec_stats = SpecStats()
        s.spec = None if spec.mode == "none" else spec_stats
        s.prompt_tokens, s.cached_tokens = len(prompt_ids), cached
        s.spec_mode = spec_label(spec, sampling)
        try:
            drafter, memory = self._drafter(spec)  # built once, before the clock
            s.drafter = drafter.name
            produced: list[int] = []
            start = time.perf_counter()
            s.setup_s = start - called
            gstats = s.grammar = None if state is None else GrammarStats()
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
                produced += new
                if s.new_tokens == 0:
                    s.prefill_s = time.perf_counter() - start
                s.new_tokens += len(new)
                s.decode_s = time.perf_counter() - start - s.prefill_s
                if spec.mode != "none":
                    s.link = budget.estimate()
                    s.count_drafts(spec_stats)
                yield new, s
            if memory is not None:
                memory.past.add(produced)  # the edge's own outputs, for later requests' retrieval
        finally:
            budgets.give(budget)
            if own:
                session.close()

    def run_ids(
        self, request: GenerationRequest, session: EdgeSession | None = None, cached: int = 0
    ) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (new text, None) while decoding, then (last text, result). Text that could be the
        start of a stop string is held back until it is not; at a stop string the text is cut
        (`splitlm.edge.text.text_pieces`). `session`, `cached`: see `generate_ids`."""
        prompt_ids = self.text.prompt_ids(request.prompt, request.chat)
        steps = self.generate_ids(replace(request, prompt=prompt_ids, chat=False), session, cached)
        eos = set(self.cfg.eos_token_ids) if request.stop_at_eos else set()
        return text_pieces(steps, self.text.decode, prompt_ids, request.stop, eos, request.logprobs)

    def generate(
        self,
        prompt: str | list[int] | GenerationRequest,
        max_new_tokens: int | None = None,
        chat: bool | None = None,
        stop_at_eos: bool | None = None,
        spec: SpecConfig | str | None = None,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        """Generate what a `GenerationRequest` asks for; or, the short form, from a prompt (text, or token
        ids) with the common options (defaults as the request's: 128 tokens, no chat template, stop at EOS)."""
        *_, (_, result) = self.run_ids(request_of(prompt, max_new_tokens, chat, stop_at_eos, spec, sampling))
        return result

    def stream(
        self,
        prompt: str | list[int] | GenerationRequest,
        max_new_tokens: int | None = None,
        chat: bool | None = None,
        stop_at_eos: bool | None = None,
        spec: SpecConfig | str | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Stream:
        """Like `generate`, as text pieces (they join to its text)."""
        return Stream(self.run_ids(request_of(prompt, max_new_tokens, chat, stop_at_eos, spec, sampling)))
