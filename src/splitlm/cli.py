"""The `splitlm` command: one subcommand per job, each a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from splitlm import SplitLMError, __version__
from splitlm.model.device import add_device_arguments, dtype_name

DEFAULT_PORT = 8765


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with a readable error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_split(args) -> int:
    from splitlm.model.shards import split_model

    tail = args.tail if args.tail is not None else (0 if args.topology == "split-head" else 2)
    out = split_model(args.model, args.head, tail, args.out, args.dtype, args.topology, args.d_end,
                      max_file_mb=args.max_file_mb)
    print(f"wrote {out / 'edge'} and {out / 'cloud'}")
    return 0


def cmd_serve_cloud(args) -> int:
    import asyncio

    from splitlm.cloud.scheduler import BatchConfig
    from splitlm.cloud.server import CloudServer
    from splitlm.cloud.sessions import ServerLimits

    set_threads(args.threads)
    limits = ServerLimits(max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client,
                          max_tokens_per_session=args.max_tokens, idle_timeout_s=args.idle_timeout,
                          max_frame_bytes=args.max_frame_mb * 2**20, kv_budget_bytes=args.kv_budget_mb * 2**20,
                          ping_interval_s=args.ping_interval or None)
    options = dict(device=args.device, dtype=args.dtype, identity=args.identity, allowed_clients=args.clients,
                   tls_cert=args.tls_cert, tls_key=args.tls_key,
                   batch=BatchConfig(args.max_batch, args.max_batch_tokens, args.prefill_chunk))
    if args.ray is not None:
        from splitlm.cloud.ray_cloud import RayConfig, RayFrontDoor

        ray = RayConfig(None if args.ray == "local" else args.ray, args.replicas or 1, args.stages or 1,
                        args.actor_cpus, args.actor_gpus, args.threads or 1, args.lanes)
        server = RayFrontDoor(args.shard, limits, ray=ray, **options)
    elif args.replicas or args.stages or args.lanes:
        raise SplitLMError("--replicas, --stages and --lanes need --ray (the cloud on a Ray cluster)")
    else:
        server = CloudServer(args.shard, limits, **options)
    try:
        asyncio.run(server.serve(args.host, args.port))
    except OSError as e:
        raise SplitLMError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


def cmd_generate(args) -> int:
    from splitlm.edge import Edge

    set_threads(args.threads)
    sampling = sampling_config(args)
    with Edge(args.edge, args.cloud, wire_dtype=args.wire_dtype, **edge_security_kwargs(args)) as edge:
        stop_at_eos = not args.ignore_eos
        options = dict(chat=args.chat, stop_at_eos=stop_at_eos, spec=spec_arg(args), sampling=sampling, stop=args.stop)
        if args.json:
            result = edge.generate(args.prompt, args.max_new_tokens, **options)
            print(json.dumps({"text": result.text, "token_ids": result.token_ids, "prompt_tokens": len(result.prompt_ids),
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict(),
                              "edge": {"device": str(edge.device), "dtype": dtype_name(edge.dtype)}}))
            return 0
        stream = edge.stream(args.prompt, args.max_new_tokens, **options)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        print_stats(stream.result.stats)
    return 0


def api_key(args) -> str | None:
    """The bearer token local apps must send: --api-key-file, else $SPLITLM_API_KEY, else none."""
    import os

    if args.api_key_file:
        try:
            key = open(args.api_key_file).read().strip()
        except OSError as e:
            raise SplitLMError(f"cannot read the API key file {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise SplitLMError(f"the API key file {args.api_key_file} is empty")
        return key
    return os.environ.get("SPLITLM_API_KEY") or None


def cmd_serve_edge(args) -> int:
    from pathlib import Path

    from splitlm.edge import Edge
    from splitlm.edge.api import APIConfig, serve

    set_threads(args.threads)
    if not 0.0 <= args.default_temperature <= 2.0:
        raise SplitLMError(f"--default-temperature must be between 0 and 2, got {args.default_temperature}")
    config = APIConfig(model_name=args.model_name or Path(args.edge).resolve().parent.name, api_key=api_key(args),
                       spec=spec_arg(args), max_concurrent=args.max_concurrent,
                       default_temperature=args.default_temperature, default_max_tokens=args.default_max_tokens)
    with Edge(args.edge, args.cloud, wire_dtype=args.wire_dtype, **edge_security_kwargs(args)) as edge:
        if args.spec == "auto":
            edge.corpus_model()  # built once now, not in the first request
        print(f"serving model '{config.model_name}' on http://{args.host}:{args.port}/v1 "
              f"(cloud {args.cloud}{', API key required' if config.api_key else ''})", file=sys.stderr, flush=True)
        serve(edge, config, args.host, args.port)
    return 0


def cmd_chat(args) -> int:
    from splitlm.edge import Edge
    from splitlm.edge.chat import run_chat

    set_threads(args.threads)
    sampling = sampling_config(args)
    with Edge(args.edge, args.cloud, wire_dtype=args.wire_dtype, **edge_security_kwargs(args)) as edge:
        return run_chat(edge, system=args.system, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        spec=spec_arg(args))


def print_stats(s) -> None:
    print(f"[{s.spec_mode}: {s.new_tokens} tokens, {s.round_trips} round trips, {s.tokens_per_round_trip:.2f} tokens/round trip, "
          f"TTFT {s.prefill_s * 1000:.0f} ms, {s.tokens_per_s:.1f} tok/s, "
          f"up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} KiB{s.failover_note}]", file=sys.stderr)


def cmd_train_draft(args) -> int:
    from pathlib import Path

    from splitlm.decoding.train_draft import train_draft

    set_threads(args.threads)
    if not Path(args.edge).is_dir():
        raise SplitLMError(f"edge shard {args.edge} not found")
    report = train_draft(args.model, args.edge, max_tokens=args.max_tokens,
                         progress=lambda msg: print(f"[train-draft] {msg}", file=sys.stderr, flush=True))
    print(json.dumps(report))
    return 0


def cmd_warmup(args) -> int:
    from pathlib import Path

    from splitlm.decoding.warmup import WARMUP_FILE, build_warmup

    set_threads(args.threads)
    if (args.edge is None) == (args.out is None):
        raise SplitLMError("give exactly one of --edge DIR (writes DIR/warmup.jsonl.gz) and --out FILE")
    if args.edge is not None and not Path(args.edge).is_dir():
        raise SplitLMError(f"edge shard {args.edge} not found")
    out = Path(args.edge) / WARMUP_FILE if args.edge is not None else Path(args.out)
    report = build_warmup(args.model, out, limit=args.limit, batch=args.batch,
                          progress=lambda msg: print(f"[warmup] {msg}", file=sys.stderr, flush=True))
    print(json.dumps(report))
    return 0


def cmd_demo(args) -> int:
    from splitlm.demo import run_demo

    return run_demo(args.model, args.prompt, args.max_new_tokens, args.wire_dtype, device=args.device, dtype=args.dtype,
                    cloud_device=args.cloud_device or args.device, cloud_dtype=args.cloud_dtype or args.dtype)


def cmd_keygen(args) -> int:
    from splitlm.transport.keys import generate_identity, write_identity

    identity = generate_identity()
    key_path, pub_path = write_identity(args.out, identity, comment=args.comment, force=args.force)
    print(f"wrote {key_path} (private, mode 0600) and {pub_path}", file=sys.stderr)
    print(identity.fingerprint)
    return 0


# --- privacy audit (`audit`, `harden`) ---------------------------------------------------------

def comma_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return sorted(set(values))


def audit_documents(args) -> list[str]:
    from splitlm.audit.data import default_documents, read_documents

    return read_documents(args.corpus) if args.corpus else default_documents()


def cmd_audit(args) -> int:
    from splitlm.audit.defences import parse_defences
    from splitlm.audit.harden import HardenConfig
    from splitlm.audit.report import write_audit
    from splitlm.audit.run import AuditConfig, load_for_audit, run_audit

    set_threads(args.threads)
    config = AuditConfig(heads=args.head, tail=args.tail, attacks=[a.strip() for a in args.attacks.split(",") if a.strip()],
                         defences=parse_defences(args.defence), seq_len=args.seq_len,
                         max_train_tokens=args.max_train_tokens, max_eval_tokens=args.max_eval_tokens,
                         whitebox_tokens=args.whitebox_tokens, down_whitebox_tokens=args.down_whitebox_tokens,
                         candidates=args.candidates, probe_epochs=args.probe_epochs,
                         harden=HardenConfig(steps=args.harden_steps, margin=args.harden_margin), seed=args.seed)
    docs = audit_documents(args)
    model, encode, model_dir = load_for_audit(args.model)
    doc = run_audit(model, encode, docs, config)
    doc["model_name"] = model_dir.name
    for path in write_audit(doc, args.out, plots=not args.no_plot):
        print(f"wrote {path}")
    return 0


def cmd_harden(args) -> int:
    from pathlib import Path

    from splitlm.audit.harden import HardenConfig, harden_split

    set_threads(args.threads)
    config = HardenConfig(steps=args.steps, margin=args.margin, weight=args.weight, lr=args.lr, seed=args.seed)
    result = harden_split(args.model, args.head, args.tail, args.out, audit_documents(args), config,
                          max_train_tokens=args.max_train_tokens)
    (Path(args.out) / "harden.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def add_audit_parsers(sub) -> None:
    p = sub.add_parser("audit", help="privacy audit: how much text can the cloud recover from the activations?")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=comma_ints, default=[1, 2, 4, 8], help="head depths K to audit (default 1,2,4,8)")
    p.add_argument("--tail", type=non_negative_int, default=2, help="tail layers M (default 2)")
    p.add_argument("--corpus", nargs="+", metavar="FILE", default=None,
                   help="UTF-8 text files, one document each (default: Python's pydoc topics)")
    p.add_argument("--max-train-tokens", type=positive_int, default=32768, help="public text the probes learn from")
    p.add_argument("--max-eval-tokens", type=positive_int, default=1024, help="held-out tokens under attack")
    p.add_argument("--whitebox-tokens", type=positive_int, default=256, help="held-out tokens for the white-box search")
    p.add_argument("--down-whitebox-tokens", type=positive_int, default=128,
                   help="held-out tokens for the downlink white-box search")
    p.add_argument("--candidates", type=int_at_least(5), default=64, help="white-box candidate tokens per position")
    p.add_argument("--seq-len", type=int_at_least(2), default=32, help="tokens per sequence (default 32)")
    p.add_argument("--attacks", default="nn,lens,probe,whitebox", help="comma list of nn, lens, probe, whitebox")
    p.add_argument("--defence", default="none,noise:0.1,noise:1,quant:4",
                   help="comma list of none, noise:S, quant:B, harden[:STEPS] (default none,noise:0.1,noise:1,quant:4; "
                        "harden trains a private head per K: minutes each on a CPU)")
    p.add_argument("--harden-steps", type=positive_int, default=20)
    p.add_argument("--harden-margin", type=float, default=0.5, help="standardised distance harden aims for")
    p.add_argument("--probe-epochs", type=positive_int, default=2)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--out", required=True, help="output directory (report.md, audit.json, audit.png)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("harden", help="split a model with a private, hardened head (activations the public "
                                      "weights do not produce)")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="layers [0, K) stay on the edge (default 2)")
    p.add_argument("--tail", type=non_negative_int, default=2, help="layers [L-M, L) stay on the edge (default 2)")
    p.add_argument("--corpus", nargs="+", metavar="FILE", default=None,
                   help="UTF-8 text files to train on (default: Python's pydoc topics)")
    p.add_argument("--max-train-tokens", type=positive_int, default=32768)
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--margin", type=float, default=0.5, help="standardised distance to aim for (default 0.5)")
    p.add_argument("--weight", type=float, default=1.0, help="weight of the distance term against the KL term")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--out", required=True, help="output directory (gets edge/, cloud/ and harden.json)")
    p.set_defaults(func=cmd_harden)

# --- end of privacy audit ------------------------------------------------------------------------


def add_edge_security_options(p: argparse.ArgumentParser) -> None:
    """The edge's key options; pass `edge_security_kwargs(args)` on to `Edge(...)`."""
    p.add_argument("--identity", metavar="KEY", default=None,
                   help="this client's private key (from `splitlm keygen`; default: one kept in the config dir, "
                        "$SPLITLM_CONFIG or ~/.config/splitlm)")
    p.add_argument("--cloud-key", metavar="PUB|FINGERPRINT", default=None,
                   help="the cloud's public key file or SHA256: fingerprint to pin (default: trust on first use, "
                        "recorded in the known_hosts file)")
    p.add_argument("--known-hosts", metavar="FILE", default=None,
                   help="trust-on-first-use record (default: known_hosts in the config dir)")
    p.add_argument("--tls-ca", metavar="FILE", default=None,
                   help="CA certificate(s) that sign a wss:// cloud's certificate (default: the system's)")


def edge_security_kwargs(args) -> dict:
    """Keyword arguments for `Edge(...)` from the options of `add_edge_options` (keys, trust, what the
    cloud may keep and which tokens may be emitted)."""
    kwargs = {name: getattr(args, name, None) for name in ("identity", "cloud_key", "known_hosts", "tls_ca",
                                                             "cache_policy", "device", "dtype")}
    ping = getattr(args, "ping_interval", 20.0)
    return {**kwargs, "vocab": getattr(args, "vocab", None) or "all",
            "failover_timeout_s": getattr(args, "failover_timeout", 30.0), "ping_interval_s": ping or None}


def cache_policy_arg(text: str) -> str:
    from splitlm.transport.policy import CachePolicy

    try:
        return str(CachePolicy.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


WIRE_CHOICES = ["auto", "fp32", "fp16", "bf16", "int8", "fp8"]


def add_draft_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="self", metavar="self|self-raw|PATH",
                   help="--spec draft: the edge's own layers (self: with the adapter of `train-draft` if there is "
                        "one; self-raw: without), or a small model of the same vocabulary (default self)")


def spec_arg(args):
    """The SpecConfig of --spec, --draft and --pipeline."""
    from dataclasses import replace

    from splitlm.edge.runtime import as_spec

    spec = as_spec(f"draft:{args.draft}" if args.spec == "draft" else args.spec)
    return replace(spec, pipeline=args.pipeline)


def add_pipeline_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", action="store_true",
                   help="pipelined speculation: draft and send the next step while one is in flight, betting on "
                        "its likeliest path (rolled back on a miss; same output). Pays at high RTT")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, still several tokens per round trip with --spec "
                        "(exact speculative sampling: the output is distributed as plain sampling)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the context (default 1: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample among the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="same seed, same sampled output")


def sampling_config(args):
    from splitlm.decoding.sampling import SamplingConfig

    try:
        return SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise SplitLMError(str(e)) from None


CLOUD_HELP = "cloud URL ws://HOST:PORT; several, comma-separated, to fail over to (docs/failover.md)"


def add_edge_options(p: argparse.ArgumentParser) -> None:
    add_device_arguments(p, what="the edge's layers")
    p.add_argument("--failover-timeout", type=float, default=30.0, metavar="S",
                   help="how long a request keeps trying to reach a cloud after losing one (default 30)")
    p.add_argument("--ping-interval", type=float, default=20.0, metavar="S",
                   help="keepalive pings; a link that answers none for as long is dead (default 20, 0 = off)")
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_CHOICES,
                   help="activation codec on the wire (default auto: fp16, bf16 for Gemma; int8 and fp8 use "
                        "per-row scales)")
    p.add_argument("--cache-policy", type=cache_policy_arg, default="session", metavar="{none,session,window:N,sealed}",
                   help="what the cloud may keep between requests (default session; see README, cache policies)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads for this process")
    add_vocab_option(p)
    add_edge_security_options(p)


def add_vocab_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", default="all", metavar="{all,en,zh,FILE}",
                   help="the token ids the model may emit: all (default), en (Latin script, digits, punctuation, "
                        "code symbols), zh (en + Chinese), or a file of allowed ids; a split-head cloud computes "
                        "logits for these only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"splitlm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("split", help="split a model into an edge shard and a cloud shard")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="layers [0, K) stay on the edge (default 2)")
    p.add_argument("--tail", type=non_negative_int, default=None,
                   help="layers [L-M, L) stay on the edge (default 2; split-head: 0)")
    p.add_argument("--topology", default="tail-local", choices=["tail-local", "split-head"],
                   help="tail-local (default): the edge keeps the last layers and the LM head; split-head: the cloud "
                        "runs every layer from K on and part of the LM head, the edge completes the logits")
    p.add_argument("--d-end", type=positive_int, default=None, metavar="D",
                   help="split-head: the LM head's columns [0, D) stay on the edge (default: half the hidden size)")
    p.add_argument("--out", required=True, help="output directory (gets edge/ and cloud/)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="dtype the shards store (default auto: the checkpoint's own; the built-in models are fp32)")
    p.add_argument("--max-file-mb", type=positive_int, default=512, metavar="MB",
                   help="largest weight file of each shard, in MiB (default 512; a larger tensor gets a file of its "
                        "own); the split reads and writes one tensor at a time")
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("serve-cloud", help="serve a cloud shard over WebSocket")
    p.add_argument("--shard", required=True, help="the cloud shard directory (DIR/cloud)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=non_negative_int, default=DEFAULT_PORT)
    p.add_argument("--max-sessions", type=positive_int, default=64)
    p.add_argument("--max-sessions-per-client", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=8192, help="KV entries per session")
    p.add_argument("--max-frame-mb", type=positive_int, default=64)
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session expires")
    p.add_argument("--ping-interval", type=float, default=20.0, metavar="S",
                   help="keepalive pings; a connection that answers none for as long is closed (default 20, 0 = off)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--max-batch", type=positive_int, default=16,
                   help="sessions whose steps share one pass of the layers (1 = one request at a time)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=2048,
                   help="token rows per pass (a larger token tree runs alone)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256,
                   help="rows of one causal request (a prefill) per pass; longer ones run in chunks, "
                        "interleaved with other sessions' steps")
    p.add_argument("--kv-budget-mb", type=non_negative_int, default=0, metavar="MB",
                   help="KV cache memory of all sessions in MiB; beyond it OPEN/FORWARD get CAPACITY "
                        "(default 0 = automatic: 90%% of the free device memory on CUDA, a quarter of the RAM on a CPU)")
    p.add_argument("--identity", metavar="KEY", default=None,
                   help="the cloud's private key (from `splitlm keygen`; default: cloud.key in the config dir, "
                        "created on first use)")
    p.add_argument("--clients", metavar="FILE", default=None,
                   help="allowed client public keys, one per line (default: any client may connect, still encrypted)")
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="serve wss:// with this certificate (chain)")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the TLS certificate's private key")
    add_device_arguments(p, what="the middle layers")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the layers on a Ray cluster (docs/scale-out.md): ADDRESS of its head (HOST:PORT or auto); "
                        "without one, a Ray instance started here. Needs the ray extra (pip install 'splitlm[ray]')")
    p.add_argument("--replicas", type=positive_int, default=None, help="--ray: copies of the whole pipeline (default 1)")
    p.add_argument("--stages", type=positive_int, default=None,
                   help="--ray: pipeline stages per replica, each an actor holding a contiguous range of layers (default 1)")
    p.add_argument("--lanes", type=positive_int, default=None,
                   help="--ray: passes in flight per replica, each session in one (default: one per stage)")
    p.add_argument("--actor-cpus", type=float, default=0.0, help="--ray: CPUs each actor reserves (default 0)")
    p.add_argument("--actor-gpus", type=float, default=None,
                   help="--ray: GPUs each actor reserves (default: 1 where the cluster has GPUs, else 0)")
    p.set_defaults(func=cmd_serve_cloud)

    p = sub.add_parser("keygen", help="create a key pair: PREFIX.key (private) and PREFIX.pub")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.key (mode 0600) and PREFIX.pub")
    p.add_argument("--comment", default=None, help="comment at the end of the .pub line (default NAME@HOST)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("generate", help="generate text through a cloud server")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    add_draft_option(p)
    add_pipeline_option(p)
    p.add_argument("--spec", default="auto", choices=["none", "ngram", "lookahead", "auto", "draft"],
                   help="speculative decoding: several tokens per round trip, same greedy output (default auto)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the text before this string (repeatable)")
    add_sampling_options(p)
    add_edge_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve-edge", help="serve an OpenAI-compatible API on this machine (the edge)")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--model-name", default=None,
                   help="the model id clients ask for (default: the name of the split directory)")
    p.add_argument("--api-key-file", metavar="FILE", default=None,
                   help="require 'Authorization: Bearer KEY' with the key in FILE (or set $SPLITLM_API_KEY)")
    add_draft_option(p)
    add_pipeline_option(p)
    p.add_argument("--spec", default="auto", choices=["none", "ngram", "lookahead", "auto", "draft"],
                   help="speculative decoding (greedy, or exact speculative sampling) (default auto)")
    p.add_argument("--max-concurrent", type=positive_int, default=4, help="requests generating at once (default 4)")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature of requests that give none (default 1.0, as OpenAI's API)")
    p.add_argument("--default-max-tokens", type=positive_int, default=2048,
                   help="max_tokens of requests that give none (default 2048, less if the context is shorter)")
    add_edge_options(p)
    p.set_defaults(func=cmd_serve_edge)

    p = sub.add_parser("chat", help="chat in the terminal through a cloud server (streams, shows stats)")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per answer (default 256)")
    add_sampling_options(p)
    add_draft_option(p)
    add_pipeline_option(p)
    p.add_argument("--spec", default="auto", choices=["none", "ngram", "lookahead", "auto", "draft"],
                   help="speculative decoding (greedy, or exact speculative sampling) (default auto)")
    add_edge_options(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("train-draft", help="fit the self-draft's adapter from the full model on local text")
    p.add_argument("--model", default="default", help="the model the edge shard was split from")
    p.add_argument("--edge", required=True, help="the edge shard directory; the adapter is written into it")
    p.add_argument("--max-tokens", type=positive_int, default=8000, help="training tokens (default 8000)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.set_defaults(func=cmd_train_draft)

    p = sub.add_parser("warmup", help="generate the model's answers to generic requests, a corpus for the "
                                      "auto drafter (bundled for the default model)")
    p.add_argument("--model", default="default", help="the full model (HF directory, .gguf or built-in name)")
    p.add_argument("--edge", default=None, help="edge shard directory: write its warmup.jsonl.gz, used from then on")
    p.add_argument("--out", default=None, help="or: write the file here")
    p.add_argument("--limit", type=positive_int, default=None, help="first N prompts only (of about 1150)")
    p.add_argument("--batch", type=positive_int, default=16, help="prompts generated together (default 16)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("demo", help="split the bundled model, start a local cloud, stream an answer")
    p.add_argument("--model", default="default")
    p.add_argument("--prompt", default=None, help="question to ask (default: a built-in one)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_CHOICES)
    add_device_arguments(p, what="the edge's (and, unless --cloud-device says otherwise, the cloud's) layers")
    add_device_arguments(p, "cloud", what="the cloud's layers")
    p.set_defaults(func=cmd_demo)

    add_audit_parsers(sub)

    p = sub.add_parser("bench", help="benchmark split decoding behind an emulated WAN")
    from splitlm.bench.suite import add_bench_arguments, bench_main

    add_bench_arguments(p)
    p.set_defaults(func=bench_main)

    p = sub.add_parser("loadtest", help="many edges against one cloud behind an emulated WAN: batched vs --max-batch 1")
    from splitlm.bench.loadtest import add_loadtest_arguments, loadtest_main

    add_loadtest_arguments(p)
    p.set_defaults(func=loadtest_main)

    try:
        from splitlm.bench.wan import add_wan_arguments, wan_main
    except ImportError:
        pass
    else:
        p = sub.add_parser("wan", help="emulate a wide-area link: a delaying TCP proxy")
        add_wan_arguments(p)
        p.set_defaults(func=wan_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve-cloud" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    try:
        return args.func(args) or 0
    except SplitLMError as e:
        print(f"splitlm: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad values found after argument parsing (addresses, ranges)
        print(f"splitlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
