"""List the files and functions of splitlm that one `--spec auto` decoding step passes through.

    .venv/bin/python benchmarks/token_trip.py            # the trip: the step's forward, edge -> cloud -> edge
    .venv/bin/python benchmarks/token_trip.py --whole    # the whole step: drafting, the forward, verification
    .venv/bin/python benchmarks/token_trip.py --json     # the same as JSON

A tiny random Llama is split (2 + 2 edge layers) and served in this process; the edge generates with
`--spec auto` over a real encrypted WebSocket, and a profiler on every thread (the edge's, the server's
event loop, its scheduler and codec pools) records each splitlm function entered during the third step.
The trip starts when the decoding loop hands the drafted tree to the session (`EdgeSession.forward`) and
ends when the step's result comes back to the loop; `--whole` starts at the step's drafting and ends at
the next one's.

Two lists come out. **The trip**: the functions that take or return the step's state in one of its typed
carriers (the contract's `Forward`, `Frame` and `Result`, the edge's `Flight` and `StepResult`, the
cloud's `Job` and `Step`, or a list of them): the hallway a reader follows. **Called on the way**:
every other splitlm function entered (layer math, crypto, codecs, metrics, cost fits, ...).
docs/development.md keeps both, so a change can see what it adds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import torch

STEP = 3  # the traced step (the first ones warm the caches and the budget)


CARRIERS = (
    ("splitlm.transport.messages", "Forward"),
    ("splitlm.transport.messages", "Result"),
    ("splitlm.transport.frames", "Frame"),
    ("splitlm.decoding.step", "StepResult"),
    ("splitlm.edge.link", "Flight"),
    ("splitlm.edge.session", "Flight"),
    ("splitlm.cloud.scheduler", "Job"),  # before issue 56 (then in cloud/runner.py)
    ("splitlm.cloud.sessions", "Step"),
    ("splitlm.cloud.runner", "Job"),
    ("splitlm.cloud.runner", "Step"),
    ("splitlm.cloud.runner", "Piece"),
    ("splitlm.cloud.runner", "PassPlan"),
    ("splitlm.cloud.runner", "Outputs"),
)


def carrier_types() -> tuple[type, ...]:
    """The carrier classes this checkout has (older ones kept `Flight` in edge/session.py)."""
    import importlib

    found = []
    for module, name in CARRIERS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


class Recorder:
    """A profile hook for every thread: (file, function) of each splitlm call while `on`, and whether
    the function took or returned a carrier of the step's state."""

    def __init__(self):
        self.on = False
        self.carriers = carrier_types()
        self.calls: dict[str, set[str]] = defaultdict(set)
        self.trip: dict[str, set[str]] = defaultdict(set)
        self.lock = threading.Lock()

    def carries(self, value) -> bool:
        if isinstance(value, list | tuple) and value:
            value = value[0]
        return isinstance(value, self.carriers)

    def hook(self, frame, event, arg):
        if not self.on or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if "/splitlm/" not in path or "token_trip" in path:
            return
        rel, name = path[path.rindex("/splitlm/") + 1 :], frame.f_code.co_qualname
        if event == "call":
            code = frame.f_code
            args = [frame.f_locals.get(a) for a in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
            carried = any(self.carries(a) for a in args)
        else:
            carried = self.carries(arg)
        with self.lock:
            self.calls[rel].add(name)
            if carried:
                self.trip[rel].add(name)


def make_split(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from splitlm.model.shards import split_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(root / "model")
    return split_model(str(root / "model"), head=2, tail=2, out=root / "split")


def trace(whole: bool) -> Recorder:
    from splitlm.cloud.server import BackgroundServer
    from splitlm.decoding.auto import AutoDrafter
    from splitlm.edge.runtime import Edge
    from splitlm.edge.session import EdgeSession

    rec = Recorder()
    counts = {"propose": 0, "forward": 0}
    if whole:
        propose = AutoDrafter.propose

        def counted_propose(self, *a, **k):
            counts["propose"] += 1
            rec.on = counts["propose"] == STEP
            return propose(self, *a, **k)

        AutoDrafter.propose = counted_propose
    else:
        forward = EdgeSession.forward

        def counted_forward(self, *a, **k):
            counts["forward"] += 1  # the prefill is forward 1: step N is forward N + 1
            rec.on = counts["forward"] == STEP + 1
            try:
                return forward(self, *a, **k)
            finally:
                rec.on = False

        EdgeSession.forward = counted_forward

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPLITLM_CONFIG"] = str(Path(tmp) / "config")  # throw-away identities, not the user's
        threading.setprofile(rec.hook)
        sys.setprofile(rec.hook)
        try:
            split = make_split(Path(tmp))
            with BackgroundServer(split / "cloud") as server, Edge(split / "edge", server.url) as edge:
                edge.generate(list(range(3, 40)), max_new_tokens=24, stop_at_eos=False, spec="auto")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            rec.on = False
    return rec


def listing(calls: dict[str, set[str]]) -> dict[str, list[str]]:
    return {f: sorted(calls[f]) for f in sorted(calls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--whole", action="store_true", help="the whole step (drafting and verification), not the trip")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args()
    rec = trace(args.whole)
    trip = listing(rec.trip)
    rest = listing(
        {f: rec.calls[f] - rec.trip.get(f, set()) for f in rec.calls if rec.calls[f] - rec.trip.get(f, set())}
    )
    every = listing(rec.calls)
    counts = {
        "trip_files": len(trip),
        "trip_functions": sum(map(len, trip.values())),
        "all_files": len(every),
        "all_functions": sum(map(len, every.values())),
    }
    if args.json:
        print(json.dumps({**counts, "trip": trip, "called_on_the_way": rest}, indent=1))
        return
    print("The trip (functions that take or return the step's typed carriers):")
    for f, names in trip.items():
        print(f"  {f}: {', '.join(names)}")
    print("Called on the way:")
    for f, names in rest.items():
        print(f"  {f}: {', '.join(names)}")
    print(
        f"trip: {counts['trip_files']} files, {counts['trip_functions']} functions; "
        f"every splitlm function entered: {counts['all_files']} files, {counts['all_functions']} functions"
    )


if __name__ == "__main__":
    main()
