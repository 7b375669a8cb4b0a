"""What a generation returns: the result, a stream of text pieces, and the one-line summary of
its cost that `generate`, `chat` and the demo print."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

from splitlm.edge.session import GenerationStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    prompt_ids: list[int] = field(default_factory=list)


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
    return (f"[{s.spec_mode}: {s.new_tokens} tokens, {s.round_trips} round trips, "
            f"{s.tokens_per_round_trip:.2f} tokens/round trip, TTFT {s.prefill_s * 1000:.0f} ms, "
            f"{s.tokens_per_s:.1f} tok/s, up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} KiB{s.failover_note}]")


def print_stats(s: GenerationStats, file: TextIO | None = None) -> None:
    print(format_stats(s), file=file or sys.stderr)
