"""Multi-turn chat over one cloud session: each turn sends only the tokens its caches lack.

    with Edge("split/edge", url, EdgeConfig(cache_policy="sealed")) as edge:
        chat = edge.conversation()
        print(chat.say("Name a colour.").text)
        print(chat.say("And another one?").text)

Each turn renders the whole conversation with the chat template, finds the longest prefix already
in the session's caches, crops the caches to it (the template may render a finished answer
differently from the tokens that were generated) and feeds the rest. Under the cache policy
`none` (or after `revoke`) the cloud holds nothing, and the edge re-sends the history's hidden
states as context rows; the edge's own caches always hold the whole conversation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from splitlm import SplitLMError
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge.request import GenerationRequest
from splitlm.edge.results import GenerationResult, Stream

log = logging.getLogger(__name__)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """`edge`: the `splitlm.edge.Edge` whose model and cloud connection the turns use."""

    def __init__(
        self,
        edge,
        system: str | None = None,
        spec: SpecConfig | None = None,
        cache_policy: str | None = None,
        sampling: SamplingConfig | None = None,
    ):
        if edge.tokenizer is None or not edge.tokenizer.chat_template:
            raise SplitLMError("a conversation needs a tokenizer with a chat template")
        self.edge, self.spec, self.sampling = edge, spec or SpecConfig(), sampling
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.session = edge.open_session(cache_policy)
        self.cached: list[int] = []  # the tokens in the session's caches, in order
        self.turns: list[GenerationResult] = []

    def render(self) -> list[int]:
        return self.edge.text.encode_messages(self.messages)

    def _turn(self, user: str, max_new_tokens: int) -> Iterator[tuple[str, GenerationResult | None]]:
        self.messages.append({"role": "user", "content": user})
        ids = self.render()
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)  # at least one token to feed
        if keep < len(self.cached):
            self.session.crop(keep)
        result = None
        try:
            request = GenerationRequest(ids, max_new_tokens, spec=self.spec, sampling=self.sampling)
            for delta, result in self.edge.run_ids(request, self.session, keep):
                yield delta, result
        except BaseException:  # interrupted (stream closed, Ctrl-C, an error): as if the turn never happened
            self.messages.pop()
            self._undo(keep)
            raise
        # the caches hold the context except its last token (see splitlm.decoding.loop.decode)
        self.cached = (ids + result.token_ids)[:-1]
        self.messages.append({"role": "assistant", "content": result.text})
        self.turns.append(result)

    def _undo(self, keep: int) -> None:
        """Crop both sides' caches back to the turn's start (`keep` tokens); a session that cannot
        be cropped (its cloud refused) is replaced by a fresh one, which the next turn refills."""
        self.cached = self.cached[:keep]
        try:
            self.session.abandon(keep)
        except Exception as e:
            log.warning("reopening the conversation's session after an interrupted turn: %s", e)
            try:
                self.session.close()
            except Exception:  # noqa: S110 - the old session is gone either way
                pass
            self.session = self.edge.open_session(self.session.policy)
            self.cached = []

    def say(self, user: str, max_new_tokens: int = 256) -> GenerationResult:
        """One turn: the answer to `user`, given everything said before."""
        *_, (_, result) = self._turn(user, max_new_tokens)
        return result

    def stream(self, user: str, max_new_tokens: int = 256) -> Stream:
        return Stream(self._turn(user, max_new_tokens))

    def revoke(self) -> None:
        """Wipe the cloud's copy of this conversation now; the next turn re-sends what it needs."""
        self.session.revoke()

    def tighten(self, cache_policy: str) -> None:
        self.session.tighten(cache_policy)

    def close(self) -> None:
        self.session.close()
