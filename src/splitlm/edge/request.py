"""What one generation asks for (`GenerationRequest`): the prompt, how much to write, how to decode
and where to stop. `Edge.generate`, `Edge.stream`, `Edge.run_ids` and `PrefixPool.stream` take it.

    edge.generate(GenerationRequest("Name a fruit.", 32, chat=True, spec="auto", stop=["."]))
    edge.generate("Name a fruit.", 32, chat=True)   # the short form of the common options
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from splitlm import SplitLMError
from splitlm.decoding.grammar import GrammarSpec, grammar_from_format
from splitlm.decoding.logprobs import LogprobRecorder
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig


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


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. `prompt`: text, or token ids (taken as they are); `chat`: wrap text in the
    model's chat template; `spec`: the speculative mode (`splitlm.decoding.modes`, default `auto`'s
    config); `sampling`: temperature / top-p / top-k / seed (default greedy); `stop`: stop strings
    (the text ends before the first one); `logprobs`: a `LogprobRecorder(top=k)` that receives each
    token's log-probability (also in `result.logprobs`); `response_format`: a JSON schema, pydantic
    class or `GrammarSpec` the output matches (`splitlm.decoding.grammar.grammar_from_format`)."""

    prompt: str | list[int]
    max_new_tokens: int = 128
    chat: bool = False
    stop_at_eos: bool = True
    spec: SpecConfig | str | None = None
    sampling: SamplingConfig | None = None
    stop: str | list[str] | None = None
    logprobs: LogprobRecorder | None = None
    response_format: Any = None

    def spec_config(self) -> SpecConfig:
        return as_spec(self.spec)

    def grammar(self) -> GrammarSpec | None:
        return grammar_from_format(self.response_format)


def request_of(
    prompt: str | list[int] | GenerationRequest,
    max_new_tokens: int | None = None,
    chat: bool | None = None,
    stop_at_eos: bool | None = None,
    spec: SpecConfig | str | None = None,
    sampling: SamplingConfig | None = None,
) -> GenerationRequest:
    """The request of `Edge.generate`'s short form (a prompt and the common options), or the request given."""
    short = (max_new_tokens, chat, stop_at_eos, spec, sampling)
    if isinstance(prompt, GenerationRequest):
        if any(option is not None for option in short):
            raise SplitLMError("a GenerationRequest carries its own options: pass it alone")
        return prompt
    default = GenerationRequest(prompt)
    return GenerationRequest(
        prompt,
        default.max_new_tokens if max_new_tokens is None else max_new_tokens,
        default.chat if chat is None else chat,
        default.stop_at_eos if stop_at_eos is None else stop_at_eos,
        spec,
        sampling,
    )
