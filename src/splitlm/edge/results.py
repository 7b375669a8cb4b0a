"""What a generation returns: its costs (`GenerationStats`), the result, a stream of text pieces, and
the one-line summary of its cost that `generate`, `chat` and the demo print."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitlm.decoding.budget import LinkEstimate
    from splitlm.decoding.logprobs import TokenLogprob
    from splitlm.decoding.request import GrammarStats
    from splitlm.decoding.speculative import SpecStats


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the session's caches (later turns of a conversation)
    new_tokens: int = 0
    round_trips: int = 0  # all cloud round trips, prefill included
    prefill_round_trips: int = 1  # more when the prompt exceeds the cloud's tokens per forward
    setup_s: float = 0.0  # before the prompt goes in: the cloud session opened, the drafter built
    prefill_s: float = 0.0  # prompt in -> first token out (time to first token, less `setup_s`)
    decode_s: float = 0.0  # after the first token
    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0  # round-trip time minus the cloud's compute
    cloud_compute_s: float = 0.0
    edge_compute_s: float = 0.0
    serialize_s: float = 0.0  # frame and tensor encoding/decoding on the edge
    failovers: int = 0  # connections lost (or clouds gone) mid-request, survived by replay (`EdgeSession.failover`)
    failover_s: float = 0.0  # from the fault seen to the replayed requests sent again (reconnect, new session)
    failover_stall_s: float = 0.0  # for each fault: the interrupted step's first send to its reply after the replay
    preemptions: int = 0  # the cloud had freed the session (PREEMPTED): reopened and replayed (`replay.failover`)
    spec_mode: str = "none"
    drafter: str = ""  # the drafter's name: `auto(suffix+recycle+head)` says what `auto` merged (the head included)
    spec: SpecStats | None = None  # speculative decoding: tree sizes chosen, acceptance (None under `none`)
    link: LinkEstimate | None = None  # what the step budget measured of the link and the pass (None under `none`)
    # vLLM's speculative-decoding counters (`splitlm.decoding.speculative.SpecStats`; zero under `none`)
    drafts: int = 0  # verified steps that carried drafted tokens
    draft_tokens: int = 0  # drafted tokens verified (roots and lookahead windows excluded)
    accepted_tokens: int = 0  # of those, accepted (bonus tokens excluded)
    accepted_per_position: list[int] = field(default_factory=list)  # [depth - 1]: drafts accepted that deep
    grammar: GrammarStats | None = None  # constrained decoding: rejected drafts, forced tokens (None: unconstrained)

    def count_drafts(self, spec: SpecStats) -> None:
        """Take the speculative-decoding counters of the request's loop (`spec`)."""
        self.drafts, self.draft_tokens, self.accepted_tokens = spec.drafts, spec.draft_tokens, spec.accepted_drafts
        self.accepted_per_position = list(spec.accepted_per_position)

    @property
    def failover_note(self) -> str:
        """`, 1 failover (0.19 s)` when the request survived faults (`, 2 preemptions` when the cloud
        freed its session and it replayed), else empty (for stats lines)."""
        note = f", {self.failovers} failover{'s' if self.failovers > 1 else ''} ({self.failover_s:.2f} s)"
        preempted = f", {self.preemptions} preemption{'s' if self.preemptions > 1 else ''}"
        return (note if self.failovers else "") + (preempted if self.preemptions else "")

    @property
    def decode_round_trips(self) -> int:
        return max(0, self.round_trips - self.prefill_round_trips)

    @property
    def tokens_per_round_trip(self) -> float:
        """Tokens produced by decoding steps per decoding round trip (prefill excluded)."""
        return (self.new_tokens - 1) / self.decode_round_trips if self.decode_round_trips else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        """As JSON: `spec` holds the speculative counters and the link estimate, `grammar` the grammar's."""
        spec = {} if self.spec is None else self.spec.to_dict()
        return {
            **asdict(self),
            "spec": spec | ({} if self.link is None else asdict(self.link)),
            "grammar": {} if self.grammar is None else self.grammar.to_dict(),
            "tokens_per_round_trip": round(self.tokens_per_round_trip, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # with a `LogprobRecorder`: one per generated id


class Stream:
    """Iterate for text pieces as they are generated; `.result` holds the full result afterwards.

    Built on a run that yields (text delta, None) and last (delta, the full result)."""

    def __init__(self, run: Iterator[tuple[str, GenerationResult | None]]):
        self.result: GenerationResult | None = None
        self._pieces = self._text(run)

    def _text(self, run) -> Iterator[str]:
        try:
            for delta, result in run:
                if result is not None:
                    self.result = result
                if delta:
                    yield delta
        finally:
            run.close()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        """Stop generating (the cloud session is closed)."""
        self._pieces.close()


def format_stats(s: GenerationStats) -> str:
    """One line: mode, tokens, round trips, tokens per round trip, TTFT, speed, bytes."""
    drafters = s.drafter.partition("(")[2].rstrip(")")  # auto(suffix+recycle+head) -> suffix+recycle+head
    return (
        f"[{s.spec_mode}{f' with {drafters}' if drafters else ''}: {s.new_tokens} tokens, {s.round_trips} round trips, "
        f"{s.tokens_per_round_trip:.2f} tokens/round trip, TTFT {s.prefill_s * 1000:.0f} ms, "
        f"{s.tokens_per_s:.1f} tok/s, up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} "
        f"KiB{s.failover_note}]"
    )
