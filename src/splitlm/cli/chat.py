"""`splitlm chat`: a terminal chat that streams the answer and shows what each answer cost.

One `Conversation` (one cloud session) per history: each turn sends only what the caches lack,
as the cache policy allows (`--cache-policy`). Commands: /reset clears the history, /revoke wipes
the cloud's copy now, /help lists them, /exit (or Ctrl-D) quits; Ctrl-C stops an answer (the turn
is then dropped). Any other line starting with `/` is refused as an unknown command (start it with
`//` to send it as text). Piped input is echoed after the prompt, so a transcript reads as one.
"""

from __future__ import annotations

import sys
from typing import TextIO

from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge.runtime import Edge, GenerationStats

PROMPT = "you> "
ANSWER = "bot> "
COMMANDS = {
    "/reset": "clear the history (a new cloud session)",
    "/revoke": "wipe the cloud's copy now",
    "/help": "list the commands",
    "/exit": "quit (also /quit, Ctrl-D)",
}


def stats_line(s: GenerationStats, context_tokens: int) -> str:
    return (
        f"[{s.new_tokens} tokens in {s.round_trips} round trips · {s.tokens_per_round_trip:.2f} tokens/round trip · "
        f"{s.tokens_per_s:.1f} tok/s · TTFT {s.prefill_s * 1000:.0f} ms · "
        f"up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} KiB · "
        f"context {context_tokens} tokens · {s.spec_mode}{s.failover_note}]"
    )


def read_line() -> str | None:
    """The user's next line; None at end of input."""
    try:
        line = input(PROMPT)
    except EOFError:
        print()
        return None
    except KeyboardInterrupt:
        print()
        return ""
    if not sys.stdin.isatty():
        print(line, flush=True)  # input() echoes only what a terminal typed
    return line


class TerminalChat:
    """One conversation in the terminal: its commands, and its answers streamed with their cost."""

    def __init__(
        self,
        edge: Edge,
        system: str | None,
        max_new_tokens: int,
        sampling: SamplingConfig | None,
        spec: str | SpecConfig,
        out: TextIO,
    ):
        self.edge, self.system, self.max_new_tokens = edge, system, max_new_tokens
        self.sampling, self.spec, self.out = sampling, spec, out
        self.chat = edge.conversation(system, spec, sampling=sampling)

    def say(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)

    def command(self, line: str) -> bool:
        """Run `line` if it is a command (/reset, /revoke, /help, or an unknown one); whether it was one."""
        word = line.strip()
        if word == "/reset":
            self.chat.close()
            self.chat = self.edge.conversation(self.system, self.spec, sampling=self.sampling)
            self.say("[history cleared]")
        elif word == "/revoke":
            self.chat.revoke()
            self.say("[the cloud's copy of this conversation is wiped; the next turn re-sends it]")
        elif word == "/help":
            self.say("\n".join(f"  {name:<8} {what}" for name, what in COMMANDS.items()))
        elif line.startswith("/") and not line.startswith("//"):
            self.say(f"[unknown command {line.split()[0]}; /help lists the commands, // sends a line starting with /]")
        else:
            return False
        return True

    def answer(self, text: str) -> None:
        """Stream the answer to `text`, then its cost; Ctrl-C stops it (the turn is not kept)."""
        stream = self.chat.stream(text, self.max_new_tokens)
        self.say(ANSWER, end="")
        try:
            for piece in stream:
                self.say(piece, end="")
        except KeyboardInterrupt:
            stream.close()
            self.say(" [stopped; this turn is not kept]")
        else:
            print(file=self.out)
            result = stream.result
            self.say(stats_line(result.stats, len(result.prompt_ids) + len(result.token_ids)))

    def run(self) -> int:
        """Read lines until /exit, /quit or the end of input; the conversation is closed at the end."""
        try:
            while True:
                line = read_line()
                if line is None or line.strip() in ("/exit", "/quit"):
                    return 0
                if not line.strip() or self.command(line):
                    continue
                self.answer(line[1:] if line.startswith("//") else line)
        finally:
            self.chat.close()


def run_chat(
    edge: Edge,
    system: str | None = None,
    max_new_tokens: int = 256,
    sampling: SamplingConfig | None = None,
    spec: str | SpecConfig = "auto",
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    if getattr(spec, "mode", spec) == "auto" and (sampling is None or sampling.greedy):
        edge.drafting.draft_memory(
            SpecConfig("auto") if isinstance(spec, str) else spec
        )  # built once, before the first answer
    print(
        f"splitlm chat: cloud {edge.client.url}, cache policy {edge.cache_policy}; /reset clears the history, "
        "/revoke wipes the cloud's copy, /help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops an answer",
        file=out,
        flush=True,
    )
    return TerminalChat(edge, system, max_new_tokens, sampling, spec, out).run()
