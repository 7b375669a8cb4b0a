"""`splitlm chat`: a terminal chat that streams the answer and shows what each answer cost.

One `Conversation` (one cloud session) per history: each turn sends only what the caches lack,
as the cache policy allows (`--cache-policy`). Commands: /reset clears the history, /revoke wipes
the cloud's copy now, /exit (or Ctrl-D) quits; Ctrl-C stops an answer (the turn is then dropped).
"""

from __future__ import annotations

import sys

from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecConfig
from splitlm.edge.runtime import Edge, GenerationStats

PROMPT = "you> "
ANSWER = "bot> "


def stats_line(s: GenerationStats, context_tokens: int) -> str:
    return (f"[{s.new_tokens} tokens in {s.round_trips} round trips · {s.tokens_per_round_trip:.2f} tokens/round trip · "
            f"{s.tokens_per_s:.1f} tok/s · TTFT {s.prefill_s * 1000:.0f} ms · "
            f"up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} KiB · "
            f"context {context_tokens} tokens · {s.spec_mode}{s.failover_note}]")


def read_line() -> str | None:
    """The user's next line; None at end of input."""
    try:
        return input(PROMPT)
    except EOFError:
        print()
        return None
    except KeyboardInterrupt:
        print()
        return ""


def run_chat(edge: Edge, system: str | None = None, max_new_tokens: int = 256,
             sampling: SamplingConfig | None = None, spec: str | SpecConfig = "auto", out=None) -> int:
    out = out or sys.stdout
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    if getattr(spec, "mode", spec) == "auto" and (sampling is None or sampling.greedy):
        edge.corpus_model()  # built once, before the first answer
    print(f"splitlm chat: cloud {edge.client.url}, cache policy {edge.cache_policy}; /reset clears the history, "
          "/revoke wipes the cloud's copy, /exit or Ctrl-D quits, Ctrl-C stops an answer", file=out, flush=True)
    chat = edge.conversation(system, spec, sampling=sampling)
    try:
        while True:
            line = read_line()
            if line is None or line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                chat.close()
                chat = edge.conversation(system, spec, sampling=sampling)
                print("[history cleared]", file=out, flush=True)
                continue
            if line.strip() == "/revoke":
                chat.revoke()
                print("[the cloud's copy of this conversation is wiped; the next turn re-sends it]", file=out, flush=True)
                continue
            stream = chat.stream(line, max_new_tokens)
            print(ANSWER, end="", file=out, flush=True)
            try:
                for piece in stream:
                    print(piece, end="", file=out, flush=True)
            except KeyboardInterrupt:
                stream.close()
                print(" [stopped; this turn is not kept]", file=out, flush=True)
            else:
                print(file=out)
                result = stream.result
                print(stats_line(result.stats, len(result.prompt_ids) + len(result.token_ids)), file=out, flush=True)
    finally:
        chat.close()
