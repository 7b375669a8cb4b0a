"""`splitlm loadtest`: many edges against one cloud behind an emulated WAN.

    splitlm loadtest --sessions 16 --rtt-ms 80 --max-new-tokens 32          # batched vs --max-batch 1
    splitlm loadtest --edge split/edge --cloud ws://HOST:8765 --sessions 8 --json   # a running cloud

Set-up: without `--cloud`, two clouds are started in turn from the edge shard's sibling `cloud/`,
each a `splitlm serve-cloud --threads 1` subprocess: `--max-batch N` (batched) and `--max-batch 1`
(one request per pass, the cloud before the scheduler), so both are measured in one run and the
machine's noise hits both. With `--ray-replicas R --ray-stages S` the second one is instead the
cloud on a local Ray instance (`serve-cloud --ray --replicas R --stages S`, docs/scale-out.md).
With `--cloud URL` the edges use that cloud (one configuration). A WAN
emulator thread of this process delays each direction by RTT/2. The N edge sessions are **threads**
of this process sharing one `Edge` (its connection pool gives each session its own connection and
cloud session), each torch op on 1 thread; torch releases the GIL, so the sessions' edge compute
overlaps on the machine's cores.

Per configuration:
1. steady decoding: the N sessions start together (a barrier) and each generates
   `--max-new-tokens` greedy tokens from its prompt (`benchmarks/prompts.json`, in turn):
   aggregate tok/s (all tokens / wall time), per-session tok/s, TTFT, step latency p50/p95/p99
   (time between a session's consecutive decoding steps), errors, and how many sessions' tokens
   equal their single-session output (each prompt alone beforehand, no emulator);
2. prefill interference (`--prefill-tokens`, default 2048; 0 skips it): N-1 sessions decode; once
   each has made a few steps, one more session sends a prompt of that many tokens. Reported: the
   decoders' p50 step latency before the prefill, the p50 and the worst step that overlapped it,
   the worst step's delay over the p50, and the prefill's own time.

Results: a table on stdout (`--json`: the JSON document instead) and `OUT/loadtest-<timestamp>.json`,
with `speedup` (batched / max-batch 1 aggregate tok/s) or, with `--ray-replicas`, `ray_vs_single_process`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from splitlm import SplitLMError
from splitlm.bench.load_sessions import SessionRun, concurrently, decode, interference, steady
from splitlm.bench.prompts import Prompt
from splitlm.bench.setup import DEFAULT_OUT
from splitlm.progress import track
from splitlm.result_files import write_result

log = logging.getLogger(__name__)

SCHEMA = "splitlm.loadtest/1"
WARMUP_TOKENS = 2


@dataclass
class LoadConfig:
    sessions: int = 8
    max_new_tokens: int = 32
    rtt_ms: float = 80.0
    max_batch: int = 16  # the batched configuration's --max-batch (the baseline is 1)
    spec: str = "none"  # the sessions' decoding mode (none = one token per round trip)
    prefill_tokens: int = 2048  # the interfering prompt's length (0 = skip phase 2)
    prefill_chunk: int = 64  # the clouds' --prefill-chunk (clouds started here)
    wire_dtype: str = "fp32"  # fp32: outputs comparable bit for bit with the single-session run
    model: str = "default"
    head: int = 2
    tail: int | None = None
    edge: str = ""  # a pre-split edge shard (its cloud is the sibling cloud/); "" = split --model here
    cloud: str = ""  # a running cloud's URL; "" = start clouds from the edge's sibling cloud shard
    ray_replicas: int = 0  # > 0: the second configuration is the Ray cloud (replicas x stages), not --max-batch 1
    ray_stages: int = 1
    prompts: str = ""
    out: str = str(DEFAULT_OUT)
    json: bool = False


def long_prompt_ids(tokenizer, n: int, vocab_size: int) -> list[int]:
    """n tokens of ordinary text (Python's pydoc topics, which every Python has); without a tokenizer
    (test models), n ids."""
    if tokenizer is None:
        return [(5 * i) % (vocab_size - 3) + 3 for i in range(n)]
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text[: n * 8]).input_ids[:n]


@contextlib.contextmanager
def cloud_url(cloud_dir: Path, extra: list[str] | None, url: str):
    """`url` as given, or a cloud started here with `extra` serve-cloud arguments."""
    if extra is None:
        yield url
        return
    from splitlm.cloud.local import cloud_process

    timeout = 600.0 if "--ray" in extra else 120.0  # a Ray cloud's actors load their layers first
    with cloud_process(cloud_dir, "cpu", "fp32", extra, timeout_s=timeout) as port:
        yield f"ws://127.0.0.1:{port}"


def session_edges(stack: contextlib.ExitStack, edge_dir: Path, url: str, config: LoadConfig) -> list:
    """An `Edge` for each of the sessions: one shared by all while the cloud's per-client session limit
    (HELLO_OK) allows `config.sessions`, else as many as it takes, each with an identity generated here
    (a cloud with an allow-list of clients refuses those: raise its limit instead)."""
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.transport.keys import generate_identity

    def edge(identity=None):
        cfg = EdgeConfig(wire_dtype=config.wire_dtype, device="cpu", dtype="fp32", identity=identity)
        return stack.enter_context(Edge(edge_dir, url, cfg))

    first = edge()
    per_key = first.client.info.limits.max_sessions_per_client or config.sessions
    keys = [first] + [edge(generate_identity()) for _ in range(1, -(-config.sessions // per_key))]
    if len(keys) > 1:
        log.info(f"[loadtest] the cloud allows {per_key} sessions per client: {len(keys)} client keys")
    return [keys[i % len(keys)] for i in range(config.sessions)]


def run_config(
    name: str,
    cloud: str,
    edge_dir: Path,
    config: LoadConfig,
    prompts: list[list[int]],
    reference: list[list[int]],
    spec,
) -> dict:
    from splitlm.bench.wan import WanConfig, WanEmulator

    log.info(f"[loadtest] {name}: {config.sessions} sessions at {config.rtt_ms:g} ms RTT")
    with contextlib.ExitStack() as stack:
        url = cloud
        if config.rtt_ms > 0:
            host, _, port = cloud.split("://", 1)[1].rstrip("/").rpartition(":")
            wan = stack.enter_context(
                WanEmulator(upstream=(host.strip("[]"), int(port)), config=WanConfig(config.rtt_ms, seed=0))
            )
            url = wan.url_for("ws")
        edges = session_edges(stack, edge_dir, url, config)
        concurrently(edges, prompts, WARMUP_TOKENS, spec)  # connections opened, caches warm (not counted)
        result = {"name": name, **steady(concurrently(edges, prompts, config.max_new_tokens, spec), reference)}
        result["client_keys"] = len({id(e) for e in edges})
        if config.prefill_tokens:
            edge = edges[-1]
            long = long_prompt_ids(edge.tokenizer, config.prefill_tokens, edge.cfg.vocab_size)
            decoders = prompts[:-1] or prompts
            result["prefill_interference"] = interference(
                edges, edge, decoders, long, config.max_new_tokens, spec, config.prefill_chunk
            )
    lat = result["step_latency_ms"]
    log.info(
        f"[loadtest] {name}: {result['aggregate_tok_s']} tok/s, step p50 {lat['p50']} ms, p99 {lat['p99']} ms, "
        f"identical {result['identical_outputs']}/{result['sessions']}, errors {result['errors']}"
    )
    return result


def run_loadtest(config: LoadConfig) -> dict:
    import torch

    if config.sessions < 1 or config.max_new_tokens < 1 or config.max_batch < 1:
        raise SplitLMError("--sessions, --max-new-tokens and --max-batch must be at least 1")
    if config.ray_replicas < 0 or config.ray_stages < 1:
        raise SplitLMError("--ray-replicas must be >= 0 and --ray-stages >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(config)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (tests) keeps its own setting


def shard_dirs(config: LoadConfig) -> tuple[Path, Path]:
    """(edge shard, cloud shard): `--edge`'s and its sibling `cloud/`, or a split of `--model` made here."""
    from splitlm.bench.setup import BenchConfig, resolve_split
    from splitlm.model.loading import resolve_model

    if config.edge:  # no reference model needed: outputs are compared with the single-session run
        edge_dir, cloud_dir = Path(config.edge), Path(config.edge).parent / "cloud"
        if not (edge_dir / "manifest.json").is_file():
            raise SplitLMError(f"--edge {edge_dir}: not an edge shard (no manifest.json)")
    else:
        split_dir, _ = resolve_split(
            BenchConfig(model=config.model, head=config.head, tail=config.tail), resolve_model(config.model)
        )
        edge_dir, cloud_dir = split_dir / "edge", split_dir / "cloud"
    if not config.cloud and not (cloud_dir / "manifest.json").is_file():
        raise SplitLMError(f"no cloud shard in {cloud_dir}: pass --cloud URL to use a running cloud")
    return edge_dir, cloud_dir


def cloud_configs(config: LoadConfig) -> tuple[list[str], list[tuple[str, list[str] | None]]]:
    """(the baseline's serve-cloud arguments, the configurations measured: (name, their arguments;
    None = the running `--cloud`))."""
    # one client key for all sessions (they share an Edge): lift the per-client session limit
    n = config.sessions + 2
    chunk = [
        "--prefill-chunk",
        str(config.prefill_chunk),
        "--max-sessions-per-client",
        str(n),
        "--max-sessions",
        str(max(64, n)),
    ]
    baseline = ["--max-batch", "1", *chunk]
    batched = ["--max-batch", str(config.max_batch), *chunk]
    if config.cloud:
        return baseline, [("cloud", None)]
    if config.ray_replicas:  # the single-process cloud next to the Ray cloud, same scheduler settings
        ray = ["--ray", "--replicas", str(config.ray_replicas), "--stages", str(config.ray_stages), *batched]
        return baseline, [("batched", batched), (f"ray-{config.ray_replicas}x{config.ray_stages}", ray)]
    return baseline, [("batched", batched), ("max-batch-1", baseline)]


def session_prompts(edge, prompt_set: list[Prompt], sessions: int) -> list[list[int]]:
    """The sessions' prompts: the prompt set's in turn (token ids for a test model without a tokenizer)."""
    from splitlm.bench.prompts import tokenize

    if edge.tokenizer is not None:
        tokenize(prompt_set, edge.tokenizer)
        ids = [p.ids for p in prompt_set]
    else:  # a test model without a tokenizer: prompts of token ids
        ids = [[(7 * i + 3 * j) % (edge.cfg.vocab_size - 3) + 3 for j in range(3 + i % 5)] for i in range(8)]
    return [ids[i % len(ids)] for i in range(sessions)]


def references(edge, prompts: list[list[int]], config: LoadConfig, spec) -> list[list[int]]:
    """Each session's tokens when it runs alone (what the concurrent runs must reproduce)."""
    log.info(f"[loadtest] reference: each of {config.sessions} prompts alone")
    reference = []
    for p in track(prompts, "loadtest: references", unit="session"):
        run = SessionRun()
        decode(edge, p, config.max_new_tokens, spec, run)
        if run.error:
            raise SplitLMError(f"the single-session reference failed: {run.error}")
        reference.append(run.tokens)
    return reference


def loadtest_doc(config: LoadConfig, started: float, results: list[dict]) -> dict:
    """The result document: the first configuration's figures at the top, every configuration's in
    `configurations`, and their ratio."""
    doc = {
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
        "config": asdict(config),
        "cpu_count": os.cpu_count(),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "threads": {
            "cloud": "serve-cloud --threads 1",
            "edges": "one thread per session in this process, torch on 1 thread",
        },
        **{k: v for k, v in results[0].items() if k != "name"},
        "configurations": results,
    }
    if len(results) == 2 and results[0]["aggregate_tok_s"] and results[1]["aggregate_tok_s"]:
        first, second = results[0]["aggregate_tok_s"], results[1]["aggregate_tok_s"]
        if config.ray_replicas:
            doc["ray_vs_single_process"] = round(second / first, 2)
        else:
            doc["speedup"] = round(first / second, 2)
    return doc


def _run(config: LoadConfig) -> dict:
    from splitlm.bench.prompts import default_prompts_path, load_prompts
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.edge.runtime import as_spec

    spec = as_spec(config.spec)
    prompt_set = load_prompts(config.prompts or default_prompts_path())
    edge_dir, cloud_dir = shard_dirs(config)
    baseline, configs = cloud_configs(config)
    with (
        cloud_url(cloud_dir, None if config.cloud else baseline, config.cloud) as url,
        Edge(edge_dir, url, EdgeConfig(wire_dtype=config.wire_dtype, device="cpu", dtype="fp32")) as edge,
    ):
        prompts = session_prompts(edge, prompt_set, config.sessions)
        reference = references(edge, prompts, config, spec)
    started = time.time()
    results = []
    for name, extra in track(configs, "loadtest", unit="cloud"):
        with cloud_url(cloud_dir, extra, config.cloud) as url:
            results.append({**run_config(name, url, edge_dir, config, prompts, reference, spec), "cloud_args": extra})
    return loadtest_doc(config, started, results)


def write_results(doc: dict, out: str | Path) -> list[Path]:
    """Write `loadtest-<started>.json`; returns its path in a list."""
    return write_result(out, "loadtest", doc, stamp=doc["started"].replace(":", "")).paths


def markdown(doc: dict) -> str:
    lines = [
        "| cloud | sessions | tok/s | per session | TTFT p50 s | step p50 / p95 / p99 ms | errors | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["configurations"]:
        lat = r["step_latency_ms"]
        lines.append(
            f"| {r['name']} | {r['sessions']} | {r['aggregate_tok_s']} | {r['per_session_tok_s']} | "
            f"{r['ttft_s']['p50']} | {lat['p50']} / {lat['p95']} / {lat['p99']} | {r['errors']} | "
            f"{r['identical_outputs']}/{r['sessions']} |"
        )
    if any("prefill_interference" in r for r in doc["configurations"]):
        lines += [
            "",
            "| cloud | prefill tokens | prefill s | decode p50 before ms | p50 during | max during | "
            "max delay ms | one chunk's compute ms | delay in chunks |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["configurations"]:
            p = r.get("prefill_interference")
            if p:
                lines.append(
                    f"| {r['name']} | {p['prefill_tokens']} | {p['prefill_s']} | {p['decode_p50_before_ms']} |"
                    f" {p['decode_p50_during_ms']} | {p['decode_max_during_ms']} | {p['max_delay_ms']} |"
                    f" {p['chunk_compute_ms']} ({p['chunk_tokens']} tokens) | {p['max_delay_chunks']} |"
                )
    if "speedup" in doc:
        lines += ["", f"aggregate tok/s batched / max-batch 1: {doc['speedup']}x"]
    if "ray_vs_single_process" in doc:
        lines += ["", f"aggregate tok/s Ray cloud / single-process cloud: {doc['ray_vs_single_process']}x"]
    return "\n".join(lines)
