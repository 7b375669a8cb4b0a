"""List the files and functions of splitlm that one `--spec auto` decoding step passes through.

    .venv/bin/python benchmarks/token_trip.py            # the trip: the step's forward, edge -> cloud -> edge
    .venv/bin/python benchmarks/token_trip.py --whole    # the whole step: drafting, the forward, verification
    .venv/bin/python benchmarks/token_trip.py --json     # the same as JSON

A tiny random Llama is split (2 + 2 edge layers) and served in this process; the edge generates with
`--spec auto` over a real encrypted WebSocket, and a profiler on every thread (the edge's, the server's
event loop, its scheduler and codec pools) records each splitlm function entered during the third step.
The trip starts when the decoding loop hands the drafted tree to the session (`EdgeSession.forward`) and
ends when the step's result comes back to the loop; `--whole` starts at the step's drafting and ends at
the next one's. docs/development.md keeps the list, so a change can see what it adds.
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


class Recorder:
    """A profile hook for every thread: (file, function) of each splitlm call while `on`."""

    def __init__(self):
        self.on = False
        self.calls: dict[str, set[str]] = defaultdict(set)
        self.lock = threading.Lock()

    def hook(self, frame, event, arg):
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if "/splitlm/" not in path or "token_trip" in path:
            return
        rel = path[path.rindex("/splitlm/") + 1:]
        with self.lock:
            self.calls[rel].add(frame.f_code.co_qualname)


def make_split(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from splitlm.model.shards import split_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--whole", action="store_true", help="the whole step (drafting and verification), not the trip")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args()
    rec = trace(args.whole)
    files = sorted(rec.calls)
    if args.json:
        print(json.dumps({"files": len(files), "functions": sum(len(v) for v in rec.calls.values()),
                          "calls": {f: sorted(rec.calls[f]) for f in files}}, indent=1))
        return
    for f in files:
        print(f"{f}: {', '.join(sorted(rec.calls[f]))}")
    print(f"{len(files)} files, {sum(len(v) for v in rec.calls.values())} functions")


if __name__ == "__main__":
    main()
