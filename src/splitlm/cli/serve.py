"""The servers (`serve-cloud`, `serve-edge`) and their keys (`keygen`)."""

from __future__ import annotations

import logging

from splitlm import SplitLMError
from splitlm.cli.options import (
    CLOUD_HELP,
    DEFAULT_PORT,
    add_edge_options,
    add_pipeline_option,
    add_spec_option,
    non_negative_float,
    non_negative_int,
    open_edge,
    port_number,
    positive_int,
    set_threads,
    spec_arg,
)
from splitlm.model.device import add_device_arguments

log = logging.getLogger(__name__)


def cmd_serve_cloud(args) -> int:
    import asyncio

    from splitlm.cloud.scheduler import BatchConfig
    from splitlm.cloud.server import CloudServer, ServerSettings
    from splitlm.cloud.sessions import ServerLimits

    set_threads(args.threads)
    limits = ServerLimits(
        max_sessions=args.max_sessions,
        max_sessions_per_client=args.max_sessions_per_client,
        max_tokens_per_session=args.max_tokens,
        idle_timeout_s=args.idle_timeout,
        max_frame_bytes=args.max_frame_mb * 2**20,
        kv_budget_bytes=args.kv_budget_mb * 2**20,
        ping_interval_s=args.ping_interval or None,
        malloc_trim_s=args.malloc_trim_s,
    )
    settings = ServerSettings(
        device=args.device,
        dtype=args.dtype,
        identity=args.identity,
        allowed_clients=args.clients,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        batch=BatchConfig(args.max_batch, args.max_batch_tokens, args.prefill_chunk),
    )
    if args.ray is not None:
        from splitlm.cloud.ray_cloud import RayConfig, RayFrontDoor

        ray = RayConfig(
            None if args.ray == "local" else args.ray,
            args.replicas or 1,
            args.stages or 1,
            args.actor_cpus,
            args.actor_gpus,
            args.threads or 1,
            args.lanes,
        )
        server = RayFrontDoor(args.shard, limits, settings, ray)
    elif args.replicas or args.stages or args.lanes:
        raise SplitLMError("--replicas, --stages and --lanes need --ray (the cloud on a Ray cluster)")
    else:
        server = CloudServer(args.shard, limits, settings)
    try:
        asyncio.run(server.serve(args.host, args.port))
    except OSError as e:
        raise SplitLMError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
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

    from splitlm.edge.api import APIConfig
    from splitlm.edge.api_serve import serve

    set_threads(args.threads)
    if not 0.0 <= args.default_temperature <= 2.0:
        raise SplitLMError(f"--default-temperature must be between 0 and 2, got {args.default_temperature}")
    config = APIConfig(
        model_name=args.model_name or Path(args.edge).resolve().parent.name,
        api_key=api_key(args),
        spec=spec_arg(args),
        max_concurrent=args.max_concurrent,
        default_temperature=args.default_temperature,
        default_max_tokens=args.default_max_tokens,
        prefix_pool=prefix_pool_limits(args),
    )
    with open_edge(args) as edge:
        if args.spec == "auto":
            edge.drafting.draft_memory(config.spec)  # built once now, not in the first request
        serve(edge, config, args.host, args.port)
    return 0


def prefix_pool_limits(args):
    """The prefix pool's limits from --prefix-pool, --prefix-pool-mb and --prefix-pool-ttl."""
    from splitlm.edge.prefix_pool import PoolLimits

    return PoolLimits(args.prefix_pool, args.prefix_pool_mb, args.prefix_pool_ttl)


def cmd_keygen(args) -> int:
    from splitlm.transport.keys import generate_identity, write_identity

    identity = generate_identity()
    key_path, pub_path = write_identity(args.out, identity, comment=args.comment, force=args.force)
    log.info(f"wrote {key_path} (private, mode 0600) and {pub_path}")
    print(identity.fingerprint)
    return 0


def add_serve_cloud(sub) -> None:
    """The `serve-cloud` command's parser."""
    p = sub.add_parser("serve-cloud", help="serve a cloud shard over WebSocket")
    p.add_argument("--shard", required=True, help="the cloud shard directory (DIR/cloud)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="port to listen on (0: any free one)")
    p.add_argument("--max-sessions", type=positive_int, default=64, help="open sessions of all clients together")
    p.add_argument("--max-sessions-per-client", type=positive_int, default=8, help="open sessions per client key")
    p.add_argument("--max-tokens", type=positive_int, default=8192, help="KV entries per session")
    p.add_argument(
        "--max-frame-mb",
        type=positive_int,
        default=64,
        metavar="MB",
        help="largest frame a client may send, in MiB (larger ones are refused)",
    )
    p.add_argument(
        "--idle-timeout",
        type=non_negative_float,
        default=300.0,
        metavar="S",
        help="free a session unused this many seconds (its edge is told PREEMPTED and replays its "
        "context when it comes back; default 300, 0 = never)",
    )
    p.add_argument(
        "--malloc-trim-s",
        type=non_negative_float,
        default=30.0,
        metavar="S",
        help="give the host memory the cloud freed back to the system this often (glibc malloc_trim; "
        "default 30, 0 = never)",
    )
    p.add_argument(
        "--ping-interval",
        type=non_negative_float,
        default=20.0,
        metavar="S",
        help="keepalive pings; a connection that answers none for as long is closed (default 20, 0 = off)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=16,
        help="sessions whose steps share one pass of the layers (1 = one request at a time)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=non_negative_int,
        default=0,
        help="token rows per pass: decoding steps first, prompt chunks fill the rest (a larger token tree "
        "runs alone); default 0 = by device: 64 on a CPU (measured: larger passes cost more per row), "
        "2048 on an accelerator",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=64,
        help="prompt rows per pass (all prompts together); longer prompts run in chunks, after the "
        "other sessions' decoding steps (default 64: measured on a 2-core CPU, docs/devices.md)",
    )
    p.add_argument(
        "--kv-budget-mb",
        type=non_negative_int,
        default=0,
        metavar="MB",
        help="KV cache memory of all sessions in MiB; when full, sessions are preempted (idle ones "
        "first; never an older running one for a younger), else CAPACITY; a request larger than the whole "
        "budget gets EXCEEDS_BUDGET (docs/protocol.md 8.1) "
        "(default 0 = automatic: 90%% of the free device memory on CUDA, a quarter of the RAM on a CPU)",
    )
    p.add_argument(
        "--identity",
        metavar="KEY",
        default=None,
        help="the cloud's private key (from `splitlm keygen`; default: cloud.key in the config dir, "
        "created on first use)",
    )
    p.add_argument(
        "--clients",
        metavar="FILE",
        default=None,
        help="allowed client public keys, one per line (default: any client may connect, still encrypted)",
    )
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="serve wss:// with this certificate (chain)")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the TLS certificate's private key")
    add_device_arguments(p, what="the middle layers")
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the layers on a Ray cluster (docs/scale-out.md): ADDRESS of its head (HOST:PORT or auto); "
        "without one, a Ray instance started here. Needs the ray extra (pip install 'splitlm[ray]')",
    )
    p.add_argument(
        "--replicas", type=positive_int, default=None, help="--ray: copies of the whole pipeline (default 1)"
    )
    p.add_argument(
        "--stages",
        type=positive_int,
        default=None,
        help="--ray: pipeline stages per replica, each an actor holding a contiguous range of layers (default 1)",
    )
    p.add_argument(
        "--lanes",
        type=positive_int,
        default=None,
        help="--ray: passes in flight per replica, each session in one (default: one per stage)",
    )
    p.add_argument(
        "--actor-cpus", type=non_negative_float, default=0.0, help="--ray: CPUs each actor reserves (default 0)"
    )
    p.add_argument(
        "--actor-gpus",
        type=non_negative_float,
        default=None,
        help="--ray: GPUs each actor reserves (default: 1 where the cluster has GPUs, else 0)",
    )
    p.set_defaults(func=cmd_serve_cloud)


def add_keygen(sub) -> None:
    """The `keygen` command's parser."""
    p = sub.add_parser("keygen", help="create a key pair: PREFIX.key (private) and PREFIX.pub")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.key (mode 0600) and PREFIX.pub")
    p.add_argument("--comment", default=None, help="comment at the end of the .pub line (default NAME@HOST)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_keygen)


def add_serve_edge(sub) -> None:
    """The `serve-edge` command's parser."""
    p = sub.add_parser("serve-edge", help="serve an OpenAI-compatible API on this machine (the edge)")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    p.add_argument(
        "--model-name", default=None, help="the model id clients ask for (default: the name of the split directory)"
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=None,
        help="require 'Authorization: Bearer KEY' with the key in FILE (or set $SPLITLM_API_KEY)",
    )
    add_pipeline_option(p)
    add_spec_option(p, "speculative decoding (greedy, or exact speculative sampling)")
    p.add_argument("--max-concurrent", type=positive_int, default=4, help="requests generating at once (default 4)")
    p.add_argument(
        "--default-temperature",
        type=float,
        default=1.0,
        help="temperature of requests that give none (default 1.0, as OpenAI's API)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=2048,
        help="max_tokens of requests that give none (default 2048, less if the context is shorter)",
    )
    p.add_argument(
        "--prefix-pool",
        type=non_negative_int,
        default=4,
        metavar="N",
        help="conversation states kept between requests, so that a prompt extending one prefills only "
        "the rest (docs/prefix-reuse.md; default 4, 0 = no reuse)",
    )
    p.add_argument(
        "--prefix-pool-mb",
        type=non_negative_int,
        default=256,
        metavar="MB",
        help="memory the pooled states may hold on each side, the edge's and the cloud's (default 256)",
    )
    p.add_argument(
        "--prefix-pool-ttl",
        type=non_negative_float,
        default=300.0,
        metavar="S",
        help="a pooled state idle this long is closed and the cloud drops its cache (default 300, 0 = no limit)",
    )
    add_edge_options(p)
    p.set_defaults(func=cmd_serve_edge)
