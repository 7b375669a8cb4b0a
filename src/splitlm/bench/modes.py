"""Decoding modes the benchmark compares, and the lazily loaded resources they share.

A mode is one function `run(ctx, prompt_ids, max_new_tokens) -> ModeRun`, registered with
`@mode(...)`. Later modes (ngram, lookahead, auto, hf-pld, ...) add one function here:

    @mode("ngram", network=True, help="n-gram speculative decoding through the split model")
    def run_ngram(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
        ...  # use ctx.edge (connected through the emulated WAN) and fill a ModeRun

Modes only generate and time; correctness (exact match, agreement) is scored by the suite.
Everything heavy is loaded on first use, so a process that runs one mode holds only what that
mode needs (the memory probe relies on this). All modes decode greedily and stop at the
model's end-of-sequence ids or after `max_new_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from splitlm import SplitLMError
from splitlm.decoding.request import GrammarStats
from splitlm.decoding.step import StepInput
from splitlm.edge.request import GenerationRequest


@dataclass
class ModeRun:
    """One prompt through one mode. Timings and bytes of the decoding phase exclude the prefill."""

    token_ids: list[int]  # generated ids
    ttft_s: float  # prompt in -> first token out (the prefill step)
    decode_s: float  # end of the prefill step -> last token out
    steps: int  # decoding steps after the prefill step (round trips for network modes)
    first_tokens: int = 1  # tokens out of the prefill step (decoding tokens = the rest)
    round_trips: int = 0  # cloud round trips while decoding (0 for local modes)
    network_s: float = 0.0  # round-trip time minus cloud compute and (de)serialisation
    cloud_s: float = 0.0  # the cloud's compute, as it reports it
    edge_s: float = 0.0  # compute on this machine (for local modes: all of it)
    serialize_s: float = 0.0  # frame and tensor encoding/decoding on the edge
    bytes_up: int = 0
    bytes_down: int = 0
    prefill_bytes_up: int = 0
    prefill_bytes_down: int = 0
    pipelined: int = 0  # decoding steps sent while the step before was in flight (mode pipelined)
    discarded: int = 0  # of those, steps whose reply was dropped (the bet failed, or the step guessed nothing)
    missed: int = 0  # of those, steps dropped because the bet failed
    spec_steps: int = 0  # speculative modes: verification steps, and the tree nodes (root included) and
    tree_nodes: int = 0  # lookahead-window tokens they sent in all
    window_tokens: int = 0
    grammar: GrammarStats | None = None  # `+json` modes: forced tokens, mask cost


@dataclass
class Mode:
    name: str
    network: bool  # True: runs through the cloud (and the emulated WAN); False: on this machine only
    run: Callable[[BenchContext, list[int], int], ModeRun]
    help: str = ""


MODES: dict[str, Mode] = {}
ALIASES = {"local": "local-hf", "sequential": "split-seq", "seq": "split-seq"}


def mode(name: str, network: bool, help: str = "") -> Callable:
    """Register a decoding mode under `name`."""

    def register(fn: Callable[[BenchContext, list[int], int], ModeRun]):
        MODES[name] = Mode(name, network, fn, help)
        return fn

    return register


def parse_modes(text: str) -> list[str]:
    """'local-hf,split-seq' -> ['local-hf', 'split-seq'] (aliases resolved, duplicates dropped)."""
    names: list[str] = []
    for raw in text.split(","):
        raw = raw.strip()
        if not raw:
            continue
        name = ALIASES.get(raw, raw)
        if name not in MODES:
            known = ", ".join([*MODES, *(f"{a} (= {n})" for a, n in ALIASES.items())])
            raise SplitLMError(f"unknown benchmark mode {raw!r}; known modes: {known}")
        if name not in names:
            names.append(name)
    if not names:
        raise SplitLMError("no benchmark modes given (e.g. --modes local-hf,split-seq)")
    return names


class BenchContext:
    """The resources modes use, each loaded on first access.

    `model_dir`: the full model (Hugging Face directory); `edge_dir`: the edge shard;
    `cloud_url`: where the edge connects (the WAN emulator, or the cloud itself at RTT 0).
    """

    def __init__(
        self,
        model_dir: str | Path,
        edge_dir: str | Path,
        cloud_url: str | None,
        wire_dtype: str = "fp16",
        vocab: str = "all",
        device: str = "auto",
        dtype: str = "auto",
    ):
        self.model_dir, self.edge_dir = Path(model_dir), Path(edge_dir)
        self.cloud_url, self.wire_dtype, self.vocab = cloud_url, wire_dtype, vocab
        self.device, self.dtype = device, dtype  # the edge's (the reference model runs on the CPU in fp32)
        self.schemas: dict[tuple[int, ...], dict] = {}  # prompt ids -> the JSON schema its answer must match
        self.answer_lengths: dict[tuple[int, ...], int] = {}  # prompt ids -> its last constrained answer's length

    @cached_property
    def eos_ids(self) -> set[int]:
        from splitlm.model.config import ModelConfig
        from splitlm.model.loading import read_hf_config

        return set(ModelConfig.from_hf(read_hf_config(self.model_dir)).eos_token_ids)

    @cached_property
    def hf(self):
        """The full model in `transformers` (fp32, eval mode), shared by contexts in one process."""
        from splitlm.model.loading import load_hf

        return load_hf(str(self.model_dir))

    @cached_property
    def hf_cache_kwarg(self) -> str:
        """The KV cache argument of the model's forward: `cache` in transformers 5, else `past_key_values`."""
        import inspect

        return "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"

    @cached_property
    def edge(self):
        """The edge runtime, connected to `cloud_url`."""
        from splitlm.edge import Edge, EdgeConfig
        from splitlm.transport.keys import default_identity

        if self.cloud_url is None:
            raise SplitLMError("this benchmark mode needs a cloud server, but none was started")
        # the bench's own cloud process runs with the default cloud identity: pin it
        return Edge(
            self.edge_dir,
            self.cloud_url,
            EdgeConfig(
                wire_dtype=self.wire_dtype,
                cloud_key=default_identity("cloud").fingerprint,
                vocab=self.vocab,
                device=self.device,
                dtype=self.dtype,
            ),
        )

    def set_cloud_url(self, url: str | None) -> None:
        """Point the edge at another address (another emulated RTT); it reconnects on next use."""
        if "edge" in self.__dict__:
            self.__dict__.pop("edge").close()
        self.cloud_url = url

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of parameters held by what has been loaded so far."""
        loaded = {"hf": self.__dict__.get("hf"), "edge": getattr(self.__dict__.get("edge"), "model", None)}
        return {
            name: m.weight_bytes()
            if hasattr(m, "weight_bytes")
            # (an ONNX edge: its graphs)
            else sum(p.numel() * p.element_size() for p in m.parameters())
            for name, m in loaded.items()
            if m is not None
        }

    def close(self) -> None:
        self.set_cloud_url(None)


@mode("local-hf", network=False, help="the full model in transformers on this machine, no network")
def run_local_hf(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    import torch
    from transformers import DynamicCache

    model, eos = ctx.hf, ctx.eos_ids
    cache = {ctx.hf_cache_kwarg: DynamicCache()}
    ids: list[int] = []
    with torch.inference_mode():
        start = time.perf_counter()
        x = torch.tensor([prompt_ids])  # [1, T]
        while True:  # logits_to_keep=1: only the last position's logits, as `generate` does
            logits = model(input_ids=x, use_cache=True, logits_to_keep=1, **cache).logits  # [1, 1, V]
            ids.append(int(logits[0, -1].argmax()))
            if len(ids) == 1:
                ttft = time.perf_counter() - start
            if ids[-1] in eos or len(ids) >= max_new_tokens:
                break
            x = torch.tensor([[ids[-1]]])
        decode_s = time.perf_counter() - start - ttft
    return ModeRun(ids, ttft, decode_s, steps=len(ids) - 1, edge_s=decode_s)


@mode("split-seq", network=True, help="naive split decoding: one cloud round trip per token")
def run_split_seq(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    return run_edge(ctx, prompt_ids, max_new_tokens)


@mode("ngram", network=True, help="speculative: n-gram (prompt lookup) token trees through the split model")
def run_ngram(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    from splitlm.decoding.modes import SpecConfig

    return run_edge(ctx, prompt_ids, max_new_tokens, SpecConfig("ngram"))


@mode("lookahead", network=True, help="speculative: lookahead (Jacobi window + n-gram pool) through the split model")
def run_lookahead(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    from splitlm.decoding.modes import SpecConfig

    return run_edge(ctx, prompt_ids, max_new_tokens, SpecConfig("lookahead"))


def spec_mode(name: str, help: str, **spec) -> None:
    """Register a bench mode that decodes through the split model with SpecConfig(**spec)."""

    def run(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
        from splitlm.decoding.modes import SpecConfig

        return run_edge(ctx, prompt_ids, max_new_tokens, SpecConfig(**spec, memory=name))

    mode(name, network=True, help=help)(run)


spec_mode(
    "auto",
    "speculative: retrieval, recycled and head drafts merged, the tree sized from the link and the measured cost curve",
    mode="auto",
)
spec_mode(
    "auto-zerocost",
    "auto with the cloud's per-token cost emulated as zero (a GPU cloud): trees up to 128 nodes",
    mode="auto",
    cost="zero",
)
spec_mode(
    "auto-nowarmup",
    "auto without the bundled warm-up answers: retrieval and the recycled table's seed read "
    "only the pydoc topics, the context and past outputs (what retrieval of the model's own answers adds)",
    mode="auto",
    warmup=False,
)
spec_mode(
    "auto-nohead",
    "auto without the trained draft head: retrieval, recycling and prompt copies only (what the head adds)",
    mode="auto",
    head=False,
)
spec_mode(
    "auto-pipelined",
    "auto, pipelined: the next step is drafted and sent while one is in flight",
    mode="auto",
    pipeline=True,
)
spec_mode("recycle", "speculative: recycled top-k successor trees only", mode="recycle")
spec_mode(
    "suffix",
    "speculative: suffix-automaton / suffix-array retrieval only (context, corpus, past outputs)",
    mode="suffix",
)
spec_mode("head", "speculative: the trained draft head only (`splitlm train-head`)", mode="head")
spec_mode(
    "auto-window", "speculative: the older combination (n-gram, corpus n-grams, lookahead window)", mode="auto-window"
)
spec_mode(
    "auto-nowindow", "speculative: the older combination without its lookahead window", mode="auto-window", window=0
)
spec_mode(
    "pipelined",
    "speculative, pipelined: the next step is drafted and sent while one is in flight (drafter as auto-nowindow)",
    mode="auto-window",
    pipeline=True,
    window=0,
)


def json_mode(name: str, help: str, **spec) -> None:
    """Register a bench mode that decodes with SpecConfig(**spec), constrained to each prompt's JSON schema
    (`ctx.schemas`; any JSON object for a prompt without one)."""

    def run(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
        from splitlm.decoding.grammar import GrammarSpec
        from splitlm.decoding.modes import SpecConfig

        schema = ctx.schemas.get(tuple(prompt_ids))
        grammar = GrammarSpec.json_schema(schema) if schema else GrammarSpec.json_object()
        run = run_edge(ctx, prompt_ids, max_new_tokens, SpecConfig(**spec, memory=name), grammar)
        ctx.answer_lengths[tuple(prompt_ids)] = len(run.token_ids)
        return run

    mode(name, network=True, help=help)(run)


json_mode(
    "auto+json",
    "auto constrained to the prompt's JSON schema: rejected drafts pruned, forced tokens ride "
    "as certain nodes (docs/structured-outputs.md)",
    mode="auto",
)
json_mode(
    "none+json",
    "constrained sequential decoding: one token per round trip, the best the prompt's JSON schema allows",
    mode="none",
)


@mode(
    "auto-json-length",
    network=True,
    help="unconstrained auto stopped at the length of the constrained answer "
    "to the same prompt (list it after a +json mode): the two compared on the same number of tokens",
)
def run_auto_json_length(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    from splitlm.decoding.modes import SpecConfig

    length = ctx.answer_lengths.get(tuple(prompt_ids))
    if length is None:
        raise SplitLMError(
            "mode auto-json-length stops at the length of a constrained answer: list a +json mode before it in --modes"
        )
    return run_edge(ctx, prompt_ids, length, SpecConfig("auto", memory="auto-json-length"))


@mode("hf-pld", network=False, help="baseline: transformers' prompt lookup decoding on the full model (no network)")
def run_hf_pld(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int) -> ModeRun:
    """`generate(prompt_lookup_num_tokens=10)`; its steps are the model's forward passes after the first."""
    import torch

    model, eos = ctx.hf, sorted(ctx.eos_ids)
    forwards = 0
    first_token_at: list[float] = []

    def count(*_):
        nonlocal forwards
        forwards += 1
        if forwards == 1:
            first_token_at.append(time.perf_counter())

    hook = model.register_forward_hook(count)
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                prompt_lookup_num_tokens=10,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else None,
            )
            end = time.perf_counter()
    finally:
        hook.remove()
    ids = out[0, len(prompt_ids) :].tolist()
    ttft = first_token_at[0] - start
    return ModeRun(ids, ttft, end - start - ttft, steps=max(forwards - 1, 0), edge_s=end - start - ttft)


def run_edge(ctx: BenchContext, prompt_ids: list[int], max_new_tokens: int, spec=None, grammar=None) -> ModeRun:
    """Decode through `ctx.edge` (with the speculative config `spec` and the `GrammarSpec` `grammar`, if
    given) and time it."""
    from dataclasses import replace

    request = GenerationRequest(prompt_ids, max_new_tokens, stop_at_eos=True, spec=spec, response_format=grammar)
    ids: list[int] = []
    prefill = stats = None
    for new, stats in ctx.edge.generate_ids(request):
        ids.extend(new if isinstance(new, list) else [new])  # one step's tokens (older API: one id)
        if prefill is None:
            prefill = replace(stats)  # a snapshot: the stats after the prefill round trip only
            first_tokens = len(ids)
    run = decode_phase(ids, prefill, stats)
    run.first_tokens = first_tokens
    if (spec := stats.spec) is not None:
        run.pipelined, run.discarded, run.missed = spec.pipelined, spec.discarded, spec.missed
        run.spec_steps, run.tree_nodes, run.window_tokens = spec.steps, spec.tree_nodes, spec.window_tokens
    run.grammar = stats.grammar
    return run


def decode_phase(ids: list[int], prefill, final) -> ModeRun:
    """A ModeRun from the edge's GenerationStats after the prefill (`prefill`) and at the end (`final`)."""
    return ModeRun(
        token_ids=ids,
        ttft_s=final.prefill_s,
        decode_s=final.decode_s,
        steps=final.round_trips - prefill.round_trips,
        round_trips=final.round_trips - prefill.round_trips,
        network_s=final.network_s - prefill.network_s,
        cloud_s=final.cloud_compute_s - prefill.cloud_compute_s,
        edge_s=final.edge_compute_s - prefill.edge_compute_s,
        serialize_s=final.serialize_s - prefill.serialize_s,
        bytes_up=final.bytes_up - prefill.bytes_up,
        bytes_down=final.bytes_down - prefill.bytes_down,
        prefill_bytes_up=prefill.bytes_up,
        prefill_bytes_down=prefill.bytes_down,
    )


def teacher_forced_agreement(ctx: BenchContext, prompt_ids: list[int], reference: list[int]) -> tuple[int, int]:
    """Feed prompt + reference[:-1] through the split model in one round trip; count the positions
    whose argmax equals the reference's next token. Returns (matches, positions)."""
    if not reference:
        return 0, 0
    session = ctx.edge.open_session()
    try:
        logits = session.forward(StepInput(prompt_ids + reference[:-1])).out  # [T_prompt + n - 1, V]
    finally:
        session.close()
    predicted = logits[len(prompt_ids) - 1 :].argmax(-1).tolist()  # [n]
    return sum(int(p == r) for p, r in zip(predicted, reference, strict=True)), len(reference)
