"""`splitlm demo`: split the bundled model (cached), start a cloud server, stream an answer."""

from __future__ import annotations

from splitlm.cloud.local import cloud_process
from splitlm.model.loading import log
from splitlm.model.shards import cached_split

DEMO_PROMPT = "In three short sentences, explain why sending text to a cloud model can leak private data."
WARMUP_PROMPT = "Write a Python function that returns the largest of three numbers."
WARMUP_TOKENS = 48


def run_demo(model: str = "default", prompt: str | None = None, max_new_tokens: int = 96,
             wire_dtype: str = "auto", rtt_ms: float = 80.0, spec: str = "auto", device: str = "auto",
             dtype: str = "auto", cloud_device: str = "auto", cloud_dtype: str = "auto") -> int:
    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.edge import Edge
    from splitlm.edge.results import print_stats
    from splitlm.transport.keys import default_identity

    split_dir = cached_split(model)
    cloud_key = default_identity("cloud").fingerprint  # the server below uses this identity; pin it
    log("splitlm demo: starting a cloud server on loopback (it holds only the middle layers)")
    with cloud_process(split_dir / "cloud", cloud_device, cloud_dtype) as port:
        import torch

        torch.set_num_threads(1)
        log(f"splitlm demo: the edge reaches it through an emulated WAN link with {rtt_ms:.0f} ms round trips")
        with WanEmulator(("127.0.0.1", port), WanConfig(rtt_ms=rtt_ms)) as wan, \
                Edge(split_dir / "edge", wan.url_for("ws"), wire_dtype=wire_dtype, cloud_key=cloud_key, device=device,
                     dtype=dtype) as edge:
            # The step budget of `auto` learns the link's round trip and the cloud's cost per token from the
            # steps it runs (an edge that has served a request knows them); a first request starts untrained
            # and drafts too little. One short request first, as `bench` does before it measures.
            log("splitlm demo: one short warm-up request first, so that the speculation budget knows the link "
                "(not shown)")
            edge.generate(WARMUP_PROMPT, WARMUP_TOKENS, chat=True, spec=spec)
            prompt = prompt or DEMO_PROMPT
            print(f"> {prompt}\n", flush=True)
            stream = edge.stream(prompt, max_new_tokens, chat=True, spec=spec)
            for piece in stream:
                print(piece, end="", flush=True)
            print("\n")
            fast = stream.result.stats
            print_stats(fast)
            log("splitlm demo: the same request with sequential decoding (one round trip per token) ...")
            slow = edge.generate(prompt, max_new_tokens, chat=True, spec="none").stats
            print_stats(slow)
            if slow.tokens_per_s > 0:
                log(f"splitlm demo: {spec} speculative decoding: {fast.tokens_per_round_trip:.2f} tokens per round "
                    f"trip, {fast.tokens_per_s / slow.tokens_per_s:.2f}x the sequential tok/s, same tokens")
                log("splitlm demo: one prose answer; `splitlm bench` averages 20 prompts (code gains most, prose "
                    "least) on an idle machine: docs/results.md")
    return 0
