"""List the files and functions of splitlm that one decoding step passes through.

    .venv/bin/python benchmarks/token_trip.py                      # one `--spec auto` step, edge -> cloud -> edge
    .venv/bin/python benchmarks/token_trip.py --trip constrained   # one `auto` step under a JSON schema
    .venv/bin/python benchmarks/token_trip.py --trip pipelined     # one step of `auto` pipelined
    .venv/bin/python benchmarks/token_trip.py --trip all --markdown  # the three, as docs/development.md's tables
    .venv/bin/python benchmarks/token_trip.py --whole              # the whole step: drafting, the forward, verification
    .venv/bin/python benchmarks/token_trip.py --json               # the same as JSON

A tiny random Llama is split (2 + 2 edge layers) and served in this process; the edge generates over a
real encrypted WebSocket, and a profiler on every thread (the edge's, the server's event loop, its
scheduler and codec pools) records each splitlm function entered during the third step. A step starts
when the decoding loop hands it to the session (`EdgeSession.forward`, or `send` when steps are
pipelined) and ends when its result comes back to the loop (`forward` returns, or `receive` of that
step's flight: a pipelined step's window also holds the next step's drafting and send, which overlap
it). The prefill is the session's first step. `--whole` starts at the step's drafting and ends at
the next one's (`AutoDrafter.propose`).

The trips: `auto` (ids in, `--spec auto`), `constrained` (a chat model with a byte-level tokenizer,
`--spec auto` with `response_format` a JSON schema: the grammar walks and masks the tree) and
`pipelined` (`SpecConfig("auto", pipeline=True)`: two steps in flight).

Two lists come out. **The trip**: the functions that take or return the step's state in one of its typed
carriers (CARRIERS: the contract's `Forward`, `Frame` and `Result`, the edge's `Flight` and
`StepResult`, the cloud's `Job` and `Step`, and those of later layouts where this checkout has them),
alone or inside a list, tuple or dict of them: the hallway a reader follows. **Called on the way**:
every other splitlm function entered (layer math, crypto, codecs, metrics, cost fits, ...).
docs/development.md keeps both, so a change can see what it adds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

STEP = 3  # the traced step (the first ones warm the caches and the budget)
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")  # parts of their function (3.12 inlines most)
NESTING = 2  # how deep a carrier is looked for inside lists, tuples and dicts (list[tuple[Job, int]])

# (module, class) of the step's typed carriers; a pair this checkout lacks is skipped (layouts move:
# older ones kept `Flight` in edge/session.py; later ones add a step input, a pass plan, a request).
CARRIERS = (
    ("splitlm.transport.messages", "Forward"),
    ("splitlm.transport.messages", "Result"),
    ("splitlm.transport.frames", "Frame"),
    ("splitlm.decoding.step", "StepResult"),
    ("splitlm.decoding.step", "StepInput"),
    ("splitlm.decoding.step", "StepRequest"),
    ("splitlm.decoding.step", "Step"),
    ("splitlm.decoding", "DecodeRequest"),
    ("splitlm.decoding.request", "DecodeRequest"),
    ("splitlm.decoding.loop", "DecodeRequest"),
    ("splitlm.edge.link", "Flight"),
    ("splitlm.edge.session", "Flight"),
    ("splitlm.cloud.scheduler", "Job"),  # before issue 56 (then in cloud/runner.py)
    ("splitlm.cloud.sessions", "Step"),
    ("splitlm.cloud.runner", "Job"),
    ("splitlm.cloud.runner", "Step"),
    ("splitlm.cloud.runner", "Piece"),
    ("splitlm.cloud.runner", "PassPlan"),
    ("splitlm.cloud.runner", "Outputs"),
    ("splitlm.cloud.scheduler", "PassPlan"),
)

# the constrained trip's output: forced keys and punctuation, small choices, a bounded string
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "state": {"enum": ["open", "closed"]},
        "labels": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "state", "labels", "owner"],
    "additionalProperties": False,
}
END = "</s>"


def carrier_types(extra: list[str] = ()) -> tuple[list[type], list[str]]:
    """The carrier classes this checkout has (CARRIERS and `module:Class` names in `extra`), and the
    names it lacks."""
    found, missing = [], []
    for module, name in [*CARRIERS, *(tuple(e.split(":", 1)) for e in extra)]:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append(f"{module}:{name}")
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return found, missing


class Recorder:
    """A profile hook for every thread: (file, function) of each splitlm call while `on`, in the order
    first entered, and whether the function took or returned a carrier of the step's state."""

    def __init__(self, carriers: list[type]):
        self.on = False
        self.carriers = tuple(carriers)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.on = False
        self.calls: dict[str, dict[str, None]] = {}  # file -> functions (dicts: ordered sets)
        self.trip: dict[str, dict[str, None]] = {}

    def carries(self, value, depth: int = NESTING) -> bool:
        """`value` is a carrier, or a list, tuple, set or dict holding one (any element, `depth` deep)."""
        if isinstance(value, self.carriers):
            return True
        if depth <= 0 or isinstance(value, str | bytes | torch.Tensor):
            return False
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list | tuple | set | frozenset):
            return False
        return any(self.carries(v, depth - 1) for v in value)

    def arguments(self, frame) -> list:
        """The values of a call's parameters, *args and **kwargs included."""
        code, local = frame.f_code, frame.f_locals
        n = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:n])
        if code.co_flags & 0x04:  # CO_VARARGS
            names.append(code.co_varnames[n])
        if code.co_flags & 0x08:  # CO_VARKEYWORDS
            names.append(code.co_varnames[n + bool(code.co_flags & 0x04)])
        return [local.get(a) for a in names]

    def hook(self, frame, event, arg):
        if not self.on or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if "/splitlm/" not in path or "token_trip" in path or frame.f_code.co_name in COMPREHENSIONS:
            return
        rel, name = path[path.rindex("/splitlm/") + 1 :], frame.f_code.co_qualname
        carried = any(self.carries(a) for a in self.arguments(frame)) if event == "call" else self.carries(arg)
        with self.lock:
            self.calls.setdefault(rel, {})[name] = None
            if carried:
                self.trip.setdefault(rel, {})[name] = None


class StepWindow:
    """Turns the recorder on for the session's `step`-th step: a `forward` call, or a `send` until
    `receive` (or `discard`) of the flight it returned. Calls made inside another one of these (a
    forward built of send and receive, a streamed prefill) are part of it, not steps of their own."""

    def __init__(self, rec: Recorder, step: int):
        self.rec, self.step = rec, step
        self.started, self.depth = 0, 0
        self.flight = None
        self.traced = False
        self.discarded = False

    def begin(self) -> bool:
        self.started += 1
        if self.started != self.step:
            return False
        self.rec.on = self.traced = True
        return True

    def wrap_forward(self, forward: Callable) -> Callable:
        def counted_forward(session, *a, **k):
            if self.depth:
                return forward(session, *a, **k)
            self.depth += 1
            mine = self.begin()
            try:
                return forward(session, *a, **k)
            finally:
                self.depth -= 1
                if mine:
                    self.rec.on = False

        return counted_forward

    def wrap_send(self, send: Callable) -> Callable:
        def counted_send(session, *a, **k):
            if self.depth:
                return send(session, *a, **k)
            self.depth += 1
            mine = self.begin()
            try:
                flight = send(session, *a, **k)
            except BaseException:
                if mine:
                    self.rec.on = False
                raise
            finally:
                self.depth -= 1
            if mine:
                self.flight = flight
            return flight

        return counted_send

    def wrap_take(self, take: Callable, discards: bool) -> Callable:
        def counted_take(session, *a, **k):
            if self.depth:
                return take(session, *a, **k)
            flight = a[0] if a else next(iter(k.values()), None)
            self.depth += 1
            try:
                return take(session, *a, **k)
            finally:
                self.depth -= 1
                if self.flight is not None and flight is self.flight:
                    self.rec.on, self.flight = False, None
                    self.discarded = discards

        return counted_take

    @contextmanager
    def installed(self):
        """The session's methods counted while inside (the methods this checkout's session has)."""
        from splitlm.edge.session import EdgeSession

        wrappers = {
            "forward": self.wrap_forward,
            "send": self.wrap_send,
            "receive": lambda f: self.wrap_take(f, discards=False),
            "discard": lambda f: self.wrap_take(f, discards=True),
        }
        saved = {name: getattr(EdgeSession, name) for name in wrappers if hasattr(EdgeSession, name)}
        try:
            for name, method in saved.items():
                setattr(EdgeSession, name, wrappers[name](method))
            yield self
        finally:
            for name, method in saved.items():
                setattr(EdgeSession, name, method)


@contextmanager
def drafting_window(rec: Recorder, step: int):
    """`--whole`: on from the `step`-th `AutoDrafter.propose` to the next one."""
    from splitlm.decoding.auto import AutoDrafter

    propose, count = AutoDrafter.propose, [0]
    window = StepWindow(rec, step)

    def counted_propose(self, *a, **k):
        count[0] += 1
        rec.on = count[0] == step
        window.traced = window.traced or rec.on
        return propose(self, *a, **k)

    AutoDrafter.propose = counted_propose
    try:
        yield window
    finally:
        AutoDrafter.propose = propose
        rec.on = False


def tiny_config(vocab_size: int = 256, eos: int = 2, bos: int = 1):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )


def save_byte_tokenizer(path: Path) -> tuple[int, int]:
    """A byte-level tokenizer (one token per byte) with an end token; returns (size, end id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END)
    fast.save_pretrained(path)
    return len(fast), fast.convert_tokens_to_ids(END)


def make_split(root: Path, tokenizer: bool = False) -> Path:
    """The tiny model split head=2 tail=2 under `root` (with `tokenizer`: a byte-level one, so that the
    edge can take text and a grammar can read the tokens' bytes)."""
    from transformers import LlamaForCausalLM

    from splitlm.model.shards import split_model

    model_dir = root / "model"
    torch.manual_seed(0)
    if tokenizer:
        size, end = save_byte_tokenizer(model_dir)
        cfg = tiny_config(size, eos=end, bos=end)
    else:
        cfg = tiny_config()
    LlamaForCausalLM(cfg).eval().save_pretrained(model_dir)
    return split_model(str(model_dir), head=2, tail=2, out=root / "split")


@dataclass
class Trip:
    """One traced generation: its name, its title in the Markdown, whether its model has a tokenizer,
    and how the edge generates (the one place the tool calls the edge's API)."""

    name: str
    title: str
    tokenizer: bool
    generate: Callable


def auto_step(edge):
    edge.generate(list(range(3, 40)), max_new_tokens=24, stop_at_eos=False, spec="auto")


def constrained_step(edge):
    from splitlm.edge.request import GenerationRequest

    prompt = 'Ticket: {"id": 12, "state": "open"} Again: '
    edge.generate(GenerationRequest(prompt, max_new_tokens=64, spec="auto", response_format=SCHEMA))


def pipelined_step(edge):
    from splitlm.decoding.modes import SpecConfig

    edge.generate(list(range(3, 40)), max_new_tokens=24, stop_at_eos=False, spec=SpecConfig("auto", pipeline=True))


TRIPS = {
    "auto": Trip("auto", "one `auto` step", False, auto_step),
    "constrained": Trip("constrained", "one constrained `auto` step (a JSON schema)", True, constrained_step),
    "pipelined": Trip("pipelined", "one pipelined `auto` step", False, pipelined_step),
}


@dataclass
class Traced:
    """One trip's record: the functions on the trip and every one entered, file by file."""

    trip: Trip
    whole: bool
    on_trip: dict[str, list[str]]
    entered: dict[str, list[str]]
    warnings: list[str] = field(default_factory=list)

    @property
    def rest(self) -> dict[str, list[str]]:
        out = {f: [n for n in names if n not in self.on_trip.get(f, [])] for f, names in self.entered.items()}
        return {f: names for f, names in out.items() if names}

    def counts(self) -> dict[str, int]:
        return {
            "trip_files": len(self.on_trip),
            "trip_functions": sum(map(len, self.on_trip.values())),
            "all_files": len(self.entered),
            "all_functions": sum(map(len, self.entered.values())),
        }


def trace(trip: Trip, rec: Recorder, root: Path, whole: bool, step: int = STEP) -> Traced:
    """Generate `trip` on a fresh split, server and edge; the recorder on during the traced step."""
    from splitlm.cloud.server import BackgroundServer
    from splitlm.edge.runtime import Edge

    split = make_split(root / trip.name, trip.tokenizer)
    rec.reset()
    # the prefill is the session's first step: decoding step N is the session's step N + 1
    window = drafting_window(rec, step) if whole else StepWindow(rec, step + 1).installed()
    with ExitStack() as stack:
        w = stack.enter_context(window)
        server = stack.enter_context(BackgroundServer(split / "cloud"))
        edge = stack.enter_context(Edge(split / "edge", server.url))
        trip.generate(edge)
    rec.on = False
    if not w.traced:
        raise SystemExit(f"token_trip: the {trip.name} generation ended before step {step}")
    warnings = ["the traced flight was rolled back (discarded), not received"] if w.discarded else []
    return Traced(trip, whole, listing(rec.trip), listing(rec.calls), warnings)


def listing(calls: dict[str, dict[str, None]]) -> dict[str, list[str]]:
    return {f: list(names) for f, names in calls.items()}


def short_names(names: list[str]) -> list[str]:
    """Grouped by class in the order first entered, a class's methods after its first by their own
    names: `A.f`, `h`, `A.g` -> `A.f`, `g`, `h`."""
    groups: dict[str, list[str]] = {}
    for name in names:
        cls, _, method = name.rpartition(".")
        groups.setdefault(cls, []).append(method)
    return [f"{cls}.{m}" if cls and i == 0 else m for cls, methods in groups.items() for i, m in enumerate(methods)]


def layer(path: str) -> str:
    """The layer a file belongs to: the contract (messages and the client), the wire (the rest of
    transport), else its package (edge, cloud, decoding, model, ...)."""
    parts = path.split("/")
    if parts[0] == "transport":
        return "contract" if parts[-1] in ("messages.py", "client.py") else "wire"
    return parts[0].removesuffix(".py")


def markdown(t: Traced) -> str:
    """The trip as docs/development.md's table: files in the order the trip first entered them."""
    c = t.counts()
    what = "the whole step" if t.whole else "the trip"
    lines = [
        f"**{t.trip.title}**: {what} passes {c['trip_files']} files, {c['trip_functions']} functions; "
        f"{c['all_files']} files, {c['all_functions']} functions are entered in all.",
        "",
        "| layer | file | functions on the trip |",
        "|---|---|---|",
    ]
    for path, names in t.on_trip.items():
        rel = path.removeprefix("splitlm/")
        lines.append(f"| {layer(rel)} | `{rel}` | {', '.join(f'`{n}`' for n in short_names(names))} |")
    off = sorted(p.removeprefix("splitlm/") for p in t.rest if p not in t.on_trip)
    lines += ["", "Called on the way, in files off the trip: " + ", ".join(f"`{p}`" for p in off) + "."]
    return "\n".join(lines)


def as_text(t: Traced) -> str:
    c = t.counts()
    lines = [f"== {t.trip.title} ==", "The trip (functions that take or return the step's typed carriers):"]
    lines += [f"  {f}: {', '.join(sorted(names))}" for f, names in sorted(t.on_trip.items())]
    lines.append("Called on the way:")
    lines += [f"  {f}: {', '.join(sorted(names))}" for f, names in sorted(t.rest.items())]
    lines += [f"warning: {w}" for w in t.warnings]
    lines.append(
        f"trip: {c['trip_files']} files, {c['trip_functions']} functions; "
        f"every splitlm function entered: {c['all_files']} files, {c['all_functions']} functions"
    )
    return "\n".join(lines)


def sorted_listing(calls: dict[str, list[str]]) -> dict[str, list[str]]:
    return {f: sorted(calls[f]) for f in sorted(calls)}


def as_json(t: Traced) -> dict:
    return {
        "trip_name": t.trip.name,
        **t.counts(),
        "trip": sorted_listing(t.on_trip),
        "called_on_the_way": sorted_listing(t.rest),
        "warnings": t.warnings,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trip", choices=[*TRIPS, "all"], default="auto", help="which step to trace (default: auto)")
    p.add_argument("--whole", action="store_true", help="the whole step (drafting and verification), not the trip")
    p.add_argument("--step", type=int, default=STEP, help=f"the decoding step traced (default {STEP})")
    p.add_argument(
        "--carrier", action="append", default=[], metavar="MODULE:CLASS", help="another carrier of the step's state"
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--markdown", action="store_true", help="print each trip as a Markdown table")
    args = p.parse_args()
    carriers, missing = carrier_types(args.carrier)
    rec = Recorder(carriers)
    trips = list(TRIPS.values()) if args.trip == "all" else [TRIPS[args.trip]]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPLITLM_CONFIG"] = str(Path(tmp) / "config")  # throw-away identities, not the user's
        threading.setprofile(rec.hook)
        sys.setprofile(rec.hook)
        try:
            traced = [trace(trip, rec, Path(tmp), args.whole, args.step) for trip in trips]
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            rec.on = False
    found = [f"{c.__module__}:{c.__qualname__}" for c in carriers]
    if args.json:
        print(json.dumps({"carriers": found, "carriers_missing": missing, "trips": [as_json(t) for t in traced]}))
        return
    render = markdown if args.markdown else as_text
    print("\n\n".join(render(t) for t in traced))
    print(f"\ncarriers: {', '.join(found)}; not in this checkout: {', '.join(missing) or 'none'}", file=sys.stderr)


if __name__ == "__main__":
    main()
