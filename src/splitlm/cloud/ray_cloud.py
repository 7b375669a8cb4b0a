"""The cloud on a Ray cluster: R replicas of an S-stage pipeline behind WebSocket front doors.

    splitlm serve-cloud --shard split/cloud --ray [ADDRESS] --replicas 2 --stages 2

Each replica is S Ray actors (plain actors, not Ray Serve: docs/scale-out.md says why): stage 0
(`cloud.ray_replica.ReplicaHead`) holds the replica's sessions, its batching scheduler and the
first range of layers; stages 1..S-1 (`cloud.ray_stage.StageWorker`) the others, each with its own
KV caches. Where the cluster has GPUs every actor asks for one (`num_gpus`). Actors are named
(`splitlm-<fingerprint>-r<R>-s<S>` in namespace `splitlm`), so a second front door started with
the same shard and `--ray ADDRESS` attaches to the same replicas instead of starting new ones.

The front door (`RayFrontDoor`) is the single-process server's WebSocket side (`cloud.servicer`:
handshake, encryption, limits on frames) with its request table's handlers replaced by a route:
OPEN goes to the replica with the least load (open sessions, then queued token rows; among replicas
whose stages all answer), every later request of the session to the same replica (sticky).
Replies carry the replica's incarnation; when a replica loses a stage or its stage 0 dies (a call
fails, the monitor's poll fails or reports a new incarnation), the front door closes the WebSocket
connections of that replica's sessions (close code 1011), which the edge's failover (issue 19)
answers by reconnecting, opening a new session (placed on a live replica) and replaying; Ray
restarts the dead actor.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.cloud.budget import KVBudget
from splitlm.cloud.ray_replica import Failure, Load, Lost, ReplicaHead, Reply
from splitlm.cloud.ray_stage import StageSpec, StageWorker, read_cloud_shard, stage_ranges
from splitlm.cloud.scheduler import BatchConfig
from splitlm.cloud.server import CloudServer, ServerSettings
from splitlm.cloud.servicer import Caller, RequestTable, request_table
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.device import DTYPES, dtype_name
from splitlm.model.shards import CloudModel
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import Frame, MsgType

log = logging.getLogger(__name__)

NAMESPACE = "splitlm"
LOST_CLOSE_CODE = 1011  # WebSocket "internal error": the edge fails over (reconnects and replays)
MONITOR_INTERVAL_S = 1.0
LOAD_TIMEOUT_S = 10.0  # the monitor's poll: a stage 0 silent for this long has lost its sessions
PLACE_TIMEOUT_S = 1.0  # an OPEN's poll: a replica slower than this to answer is passed over
START_TIMEOUT_S = 600.0  # actors load their layers before they answer


@dataclass
class RayConfig:
    address: str | None = None  # None: start a Ray instance in this process; "auto" or HOST:PORT: join that cluster
    replicas: int = 1
    stages: int = 1
    actor_cpus: float = 0.0  # CPUs each actor reserves (0: none, so a small machine holds R x S actors)
    actor_gpus: float | None = None  # GPUs each actor reserves; None: 1 where the cluster has GPUs, else 0
    threads: int = 1  # torch threads per actor
    lanes: int | None = None  # passes in flight per replica (scheduler lanes); None: one per stage
    namespace: str = NAMESPACE
    local_cpus: int | None = None  # num_cpus of a Ray instance started here (None: the machine's)
    object_store_mb: int = 512  # object store of a Ray instance started here

    def __post_init__(self):
        if self.replicas < 1 or self.stages < 1:
            raise SplitLMError("--replicas and --stages must be at least 1")
        if self.lanes is not None and self.lanes < 1:
            raise SplitLMError("--lanes must be at least 1")


def actor_name(fingerprint: str, replica: int, stage: int) -> str:
    return f"splitlm-{fingerprint}-r{replica}-s{stage}"


def connect(config: RayConfig) -> None:
    """Join (or start) the Ray cluster, unless this process already did."""
    try:
        import ray
    except ImportError:
        raise SplitLMError("--ray needs Ray: pip install 'splitlm[ray]' (or `make setup`)") from None
    if ray.is_initialized():
        return
    if config.address is None:
        ray.init(
            namespace=config.namespace,
            include_dashboard=False,
            num_cpus=config.local_cpus,
            object_store_memory=config.object_store_mb * 2**20,
            log_to_driver=False,
        )
    else:
        try:
            ray.init(address=config.address, namespace=config.namespace, log_to_driver=False)
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
            first = str(e).strip().splitlines()
            raise SplitLMError(
                f"cannot join the Ray cluster at {config.address}: "
                f"{first[0] if first else type(e).__name__} (docs/scale-out.md)"
            ) from None


@dataclass
class Replica:
    index: int
    head: object  # the ReplicaHead actor handle
    stages: list  # the StageWorker handles (stages 1..S-1)
    owned: bool = True  # created by this front door (False: it attached to the actors of another)
    load: Load | None = None  # the last poll's answer; None: did not answer


def deploy(
    shard_dir: str | Path, config: RayConfig, limits: ServerLimits, batch: BatchConfig | None, device: str, dtype: str
) -> list[Replica]:
    """Create the R x S actors (or attach to the ones of the same name) and wait until each replica answers."""
    import ray

    connect(config)
    _, manifest = read_cloud_shard(shard_dir)
    ranges = stage_ranges(*manifest.cloud_layers, config.stages)
    lanes = config.lanes or config.stages
    gpus = config.actor_gpus
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    common = dict(
        namespace=config.namespace,
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=config.actor_cpus,
        num_gpus=gpus,
        lifetime="detached" if config.address is not None else None,
    )
    shard = str(Path(shard_dir).resolve())
    stage_cls, head_cls = ray.remote(StageWorker), ray.remote(ReplicaHead)
    replicas = []
    for r in range(config.replicas):
        specs = [StageSpec(shard, lo, hi, device, dtype, config.threads) for lo, hi in ranges]
        names = [actor_name(manifest.fingerprint, r, s) for s in range(config.stages)]
        try:
            ray.get_actor(names[0], namespace=config.namespace)
            owned = False
        except ValueError:  # no such actor yet: this front door creates the replica
            owned = True
        stages = [
            stage_cls.options(name=names[s], max_concurrency=lanes + 2, **common).remote(specs[s])
            for s in range(1, config.stages)
        ]
        head = head_cls.options(name=names[0], max_concurrency=1000, **common).remote(
            specs[0], names[1:], config.namespace, limits, batch, lanes
        )
        replicas.append(Replica(r, head, stages, owned))
    try:
        loads = ray.get([rep.head.load.remote() for rep in replicas], timeout=START_TIMEOUT_S)
    except ray.exceptions.RayError as e:  # e.g. an actor's __init__ failed (its device, its shard path)
        cause = str(e).strip().splitlines()
        raise SplitLMError(
            f"the Ray cloud's actors did not start: {cause[-1] if cause else type(e).__name__}"
        ) from None
    for rep, load in zip(replicas, loads, strict=True):
        rep.load = load
    log.info(
        "Ray cloud: %d replica(s) x %d stage(s) (layers %s), %d pass(es) in flight per replica, actors with "
        "%g CPU and %g GPU each, on %s",
        config.replicas,
        config.stages,
        ", ".join(f"[{lo},{hi})" for lo, hi in ranges),
        lanes,
        config.actor_cpus,
        gpus,
        loads[0].device,
    )
    return replicas


class ReplicaDown(Exception):
    """Stage 0 of a replica did not answer an OPEN (the front door tries another replica)."""


@dataclass
class Route:
    replica: int
    incarnation: str
    owner: bytes
    conn: int


@dataclass
class RouteTable:
    """The front door's sessions: which replica (and incarnation) each one lives on. It stands in for
    the single-process server's `SessionTable` (the replicas hold the sessions themselves)."""

    door: str  # this front door's id: connection ids on the replicas are `door:conn`
    replicas: list[Replica]
    sessions: dict[int, Route] = field(default_factory=dict)
    kv_reserved: int = 0  # held by the replicas (their own budgets)

    def conn_id(self, conn: int) -> str:
        return f"{self.door}:{conn}"

    def drop_connection(self, conn: int) -> None:
        routes = {sid: r for sid, r in self.sessions.items() if r.conn == conn}
        for sid in routes:
            del self.sessions[sid]
        for index in {r.replica for r in routes.values()}:
            self.replicas[index].head.drop.remote(self.conn_id(conn))  # its sessions end there too

    def expire(self) -> int:
        return 0  # the replicas expire their idle sessions themselves


class RayFrontDoor(CloudServer):
    """The WebSocket server in front of the Ray replicas (several may run, on any machines)."""

    paged = False  # it holds no caches (the replicas do)

    def __init__(
        self,
        shard_dir: str | Path,
        limits: ServerLimits | None = None,
        settings: ServerSettings | None = None,
        ray: RayConfig | None = None,
    ):
        """`settings`' device, dtype and batch are the replicas'; this process computes nothing."""
        settings = settings or ServerSettings()
        self.ray_config = ray or RayConfig()
        here = replace(settings, device="cpu", dtype="fp32", batch=BatchConfig(max_batch=1))
        super().__init__(shard_dir, limits, here)
        self.scheduler.close()  # the replicas compute; this process holds no layers
        replicas = deploy(shard_dir, self.ray_config, self.limits, settings.batch, settings.device, settings.dtype)
        self.sessions = RouteTable(secrets.token_hex(4), replicas)
        first = replicas[0].load  # what /healthz reports: the replicas' device and dtype
        self.replica_device, self.dtype = first.device, DTYPES.get(first.dtype, torch.float32)
        self.budget = KVBudget(sum(r.load.kv_budget_bytes for r in replicas), self.budget.bytes_per_entry)
        self.opening: Counter[int] = Counter()  # OPENs in flight per replica (placement counts them)
        self.placed: Counter[int] = Counter()  # sessions placed per replica (tests, logs)
        self.lost = 0  # sessions whose replica was lost (their connections were closed)

    def kv_budget_entries(self) -> int | None:
        return None  # each replica has its own budget (a session must fit one); not announced

    def load_model(self, shard_dir):
        """The shard's config and manifest only (on `meta`: no weights here)."""
        cfg, manifest = read_cloud_shard(shard_dir)
        with torch.device("meta"):
            return CloudModel(cfg, manifest)

    def health(self) -> str:
        """As the single-process cloud's, with the replicas' device."""
        return (
            f"ok {self.manifest.fingerprint} device={self.replica_device} dtype={dtype_name(self.dtype)} "
            f"replicas={len(self.replicas)} stages={self.ray_config.stages}\n"
        )

    @property
    def replicas(self) -> list[Replica]:
        return self.sessions.replicas

    # -- routing -----------------------------------------------------------------------------------
    def request_table(self) -> RequestTable:
        """The single-process cloud's table, each request answered by a replica: OPEN placed, the others routed."""
        return request_table(self.open, self.route, self.route, self.route)

    async def route(self, conn: Caller, frame: Frame) -> Frame:
        """A request on an open session, to the replica (and incarnation) it lives on."""
        route = self.sessions.sessions.get(frame.session)
        if route is None or route.owner != conn.client_key or route.conn != conn.id:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"unknown session {frame.session:#x}")
        reply = await self.call(route.replica, conn, frame, route.incarnation)
        if frame.type == MsgType.CLOSE:
            self.sessions.sessions.pop(frame.session, None)
        return reply.frame

    async def open(self, conn: Caller, frame: Frame) -> Frame:
        tried: set[int] = set()
        while True:
            r = await self.place(tried)
            tried.add(r)
            self.opening[r] += 1
            try:
                reply = await self.call(r, conn, frame, None)
            except ReplicaDown:
                continue  # another replica, if any answers
            finally:
                self.opening[r] -= 1
            self.sessions.sessions[reply.frame.session] = Route(r, reply.incarnation, conn.client_key, conn.id)
            self.placed[r] += 1
            return reply.frame

    async def place(self, exclude: set[int]) -> int:
        """The replica for a new session: fewest open sessions (counting OPENs in flight here), then fewest
        queued token rows, among those whose stages all answer (else among those that answer at all).
        A replica's open sessions are at least those this door has routed to it: the poll may predate
        OPENs that completed while it was on its way."""
        fresh = await self.poll(PLACE_TIMEOUT_S)  # where a replica is slower: the monitor's last answer
        loads = [load if load is not None else rep.load for load, rep in zip(fresh, self.replicas, strict=True)]
        live = [(i, load) for i, load in enumerate(loads) if load is not None and i not in exclude]
        ready = [(i, load) for i, load in live if load.ready] or live
        if not ready:
            raise ProtocolError(ErrorCode.CAPACITY, "no replica of the Ray cloud answers; retry later")
        routed = Counter(
            r.replica
            for r in self.sessions.sessions.values()
            if loads[r.replica] is not None and r.incarnation == loads[r.replica].incarnation
        )
        return min(
            ready, key=lambda x: (max(x[1].sessions, routed[x[0]]) + self.opening[x[0]], x[1].queued_rows, x[0])
        )[0]

    async def poll(self, timeout_s: float) -> list[Load | None]:
        """Every replica's load (None where stage 0 does not answer within `timeout_s`)."""

        async def one(rep: Replica) -> Load | None:
            try:
                return await asyncio.wait_for(asyncio.wrap_future(rep.head.load.remote().future()), timeout_s)
            except Exception:  # noqa: BLE001 - dead, restarting or unreachable
                return None

        return list(await asyncio.gather(*[one(r) for r in self.replicas]))

    async def call(self, index: int, conn: Caller, frame: Frame, incarnation: str | None) -> Reply:
        """Send a decrypted request to replica `index`; its reply, or the ERROR it asks for. A lost replica
        closes the connections of its sessions (this one's included: `ConnectionClosed` ends its handler)."""
        import ray

        head = self.replicas[index].head
        frame = replace(frame, payload=bytes(frame.payload))
        try:
            ref = head.handle.remote(self.sessions.conn_id(conn.id), conn.client_key, frame, incarnation)
            out = await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayError as e:
            log.warning("replica %d: stage 0 failed (%s)", index, type(e).__name__)
            if incarnation is None:
                raise ReplicaDown() from None
            out = Lost(f"stage 0 failed: {type(e).__name__}")
        if isinstance(out, Lost) and incarnation is None:
            raise ReplicaDown()
        if isinstance(out, Reply):
            return out
        if isinstance(out, Failure):
            raise ProtocolError(ErrorCode(out.code), out.message)
        await self.lose(index, incarnation, out.reason)
        from websockets.exceptions import ConnectionClosedError
        from websockets.frames import Close

        raise ConnectionClosedError(None, Close(LOST_CLOSE_CODE, "replica lost"))

    async def lose(self, index: int, incarnation: str | None, reason: str) -> None:
        """End the connections of every session on replica `index` opened in `incarnation` (None: any)."""
        routes = {
            sid: r
            for sid, r in self.sessions.sessions.items()
            if r.replica == index and (incarnation is None or r.incarnation == incarnation)
        }
        if not routes:
            return
        conns = {r.conn for r in routes.values()}
        log.warning(
            "replica %d lost (%s): closing %d connection(s) of %d session(s); their edges replay",
            index,
            reason,
            len(conns),
            len(routes),
        )
        self.lost += len(routes)
        for sid in routes:
            self.sessions.sessions.pop(sid, None)
        for c in conns:
            conn = self.servicer.connections.get(c)  # the server's open connections (`Servicer.serve`)
            if conn is not None:
                await conn.ws.close(LOST_CLOSE_CODE, "replica lost")

    async def monitor_loop(self) -> None:
        """Poll the replicas: one whose stage 0 does not answer, or answers with another incarnation than a
        session was opened in, has lost those sessions (found here even while their edges are idle)."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            try:
                for rep, load in zip(self.replicas, await self.poll(LOAD_TIMEOUT_S), strict=True):
                    rep.load = load
                for rep in self.replicas:
                    if rep.load is None:
                        await self.lose(rep.index, None, "stage 0 does not answer")
                        continue
                    stale = {
                        r.incarnation
                        for r in self.sessions.sessions.values()
                        if r.replica == rep.index and r.incarnation != rep.load.incarnation
                    }
                    for inc in stale:
                        await self.lose(rep.index, inc, "the replica restarted")
            except Exception:  # noqa: BLE001 - the monitor must keep running
                log.exception("Ray cloud monitor")

    async def serve(self, host: str, port: int, started=None, stop=None) -> None:
        monitor = asyncio.create_task(self.monitor_loop())
        try:
            await super().serve(host, port, started, stop)
        finally:
            monitor.cancel()
            if self.ray_config.address is None:  # actors we created (not detached) end with us
                self.shutdown()

    def shutdown(self) -> None:
        """Kill the actors of the replicas this front door created (without restart)."""
        import ray

        for rep in self.replicas:
            if not rep.owned:
                continue
            for actor in [rep.head, *rep.stages]:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
