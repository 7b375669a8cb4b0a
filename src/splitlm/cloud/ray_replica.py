"""A replica of the Ray cloud: its stage 0 (`ReplicaHead`, a Ray actor) holds the replica's sessions,
runs the batching scheduler (`cloud.scheduler`) and the first range of layers; each pass's
activations go from stage to stage through Ray actor calls (`StageWorker.run`, each stage taking
the previous one's output straight from the object store) and the last stage's output comes back
to stage 0, which finishes the steps. The session logic is the single-process cloud's (its request
table, `cloud.handlers`, reused by `ReplicaCore`), so every answer is the one that cloud gives.

A replica that loses a stage (a pass fails, a stage's ping fails or reports another incarnation)
starts afresh: every session it held ends, the surviving stages drop their caches, and the replica
takes a new *incarnation*; a front door that asks for a session of an older incarnation is told
`LOST` and ends that edge's connection, so the edge replays the session elsewhere (issue 19).
Ray restarts the dead actor (`max_restarts`); a restarted stage 0 also starts a new incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from dataclasses import dataclass

import torch

from splitlm.cloud.handlers import SessionRequests
from splitlm.cloud.ray_stage import PassMeta, StageCache, StageSpec, load_stage
from splitlm.cloud.scheduler import BatchConfig, Scheduler
from splitlm.cloud.server import CloudServer, ServerSettings
from splitlm.cloud.sessions import ServerLimits, Session, SessionTable
from splitlm.model.device import dtype_name, to_device, to_host
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import Frame
from splitlm.transport.keys import generate_identity
from splitlm.transport.messages import PolicyChange

log = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0  # stage 0 pings its later stages this often
PING_TIMEOUT_S = 10.0
RESET_TIMEOUT_S = 120.0  # a restarting stage reloads its weights before it answers


class ReplicaLost(RuntimeError):
    """A later stage failed during a pass: the replica's sessions are gone."""


@dataclass
class Reply:
    frame: Frame
    incarnation: str  # the replica's incarnation that answered (an OPENED's session belongs to it)


@dataclass
class Failure:
    """A request the replica refused (becomes the front door's ERROR frame)."""

    code: int
    message: str


@dataclass
class Lost:
    """The session's replica incarnation is gone (the front door ends the edge's connection)."""

    reason: str


@dataclass
class Load:
    """What the front doors place new sessions by."""

    sessions: int
    queued_rows: int
    incarnation: str
    ready: bool  # every stage answered its last ping
    device: str = ""
    dtype: str = ""
    kv_budget_bytes: int = 0


@dataclass
class RemoteConn:
    """The connection a request arrived on, as the session table knows it (front door and connection)."""

    id: str
    client_key: bytes


class PipelineStack(torch.nn.Module):
    """Stage 0's layers followed by the later stages' (`StageWorker` actors), with the interface of
    `LayerStack.forward_packed` that `cloud.runner.run_layers` calls."""

    def __init__(self, local, downstream: list, on_lost):
        super().__init__()
        self.local, self.downstream, self.on_lost = local, downstream, on_lost
        self.lock = threading.Lock()
        self.dropped: dict[int, list[int]] = {}  # lane -> its sessions that ended since its last pass

    def drop(self, lane: int, sid: int) -> None:
        """The stages free the session's caches with its lane's next pass (after any pass of it in flight)."""
        with self.lock:
            self.dropped.setdefault(lane, []).append(sid)

    @property
    def layers(self):
        return self.local.layers

    def forward_packed(
        self,
        xs: list[torch.Tensor],
        positions: list[torch.Tensor],
        new_masks: list[torch.Tensor | None],
        caches: list[StageCache],
    ) -> list[torch.Tensor]:
        outs = self.local.forward_packed(xs, positions, new_masks, caches)  # [1, T_i, D] each
        if not self.downstream:
            return outs
        import ray

        with self.lock:
            dropped = self.dropped.pop(caches[0].lane, [])
        meta = PassMeta(
            [c.sid for c in caches],
            [not c.shipped for c in caches],
            [c.drain() for c in caches],
            [to_host(p) for p in positions],
            [None if m is None else to_host(m) for m in new_masks],
            dropped,
        )
        meta_ref = ray.put(meta)
        x = [to_host(o) for o in outs]
        for stage in self.downstream:  # each stage reads the previous one's output from the object store
            x = stage.run.remote(meta_ref, x)
        try:
            outs = ray.get(x)
        except ray.exceptions.RayError as e:
            reason = f"a later stage failed during a pass: {type(e).__name__}"
            self.on_lost(reason)
            raise ReplicaLost(reason) from None
        for c in caches:
            c.shipped = True
        device = xs[0].device
        return [to_device(o, device) for o in outs]


class StageSessionTable(SessionTable):
    """Sessions whose caches are `StageCache`s (no sealed policy: every stage would have to seal its own
    part of the cache); ended sessions are reported to the later stages with the next pass."""

    def __init__(self, limits: ServerLimits, budget, stack: PipelineStack, lanes: int = 1):
        super().__init__(limits, budget)
        self.stack, self.lanes = stack, lanes

    def open(self, owner, wire_dtype, num_layers, conn=0, policy=None) -> Session:
        if policy is not None and policy.sealed:
            raise ProtocolError(
                ErrorCode.POLICY,
                "the Ray cloud does not keep sealed caches (its stages hold "
                "separate parts of each cache); use policy session, window or none",
            )
        session = super().open(owner, wire_dtype, num_layers, conn, policy)
        per_lane = [0] * self.lanes
        for s in self.sessions.values():
            if isinstance(s.cache, StageCache):
                per_lane[s.cache.lane] += 1
        session.cache = StageCache(num_layers, session.id)
        session.cache.lane = per_lane.index(min(per_lane))  # the lane with the fewest sessions
        return session

    def remove(self, sid: int) -> None:
        session = self.sessions[sid]
        super().remove(sid)
        self.stack.drop(session.cache.lane, sid)


class Lanes:
    """Several batching schedulers over one pipeline (the `Scheduler` interface CloudServer uses): each
    session belongs to one lane, each lane runs its passes one after another, and the lanes' passes
    overlap in the pipeline (stage 0 computes one lane's pass while a later stage computes another's)."""

    def __init__(self, model, config: BatchConfig | None, on_pass, lanes: int):
        self.lanes = [Scheduler(model, config, on_pass) for _ in range(lanes)]

    @property
    def queued_rows(self) -> int:
        return sum(lane.queued_rows for lane in self.lanes)

    def submit(self, session: Session, req):
        return self.lanes[session.cache.lane].submit(session, req)

    async def run(self, session: Session, req):
        return await self.lanes[session.cache.lane].run(session, req)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()


class ReplicaRequests(SessionRequests):
    """The single-process cloud's handlers, without sealed caches (each stage holds a part of a cache)."""

    async def policy(self, conn, frame: Frame) -> Frame:
        req = PolicyChange.from_frame(frame)
        if req.cache_policy is not None and req.cache_policy.sealed:
            raise ProtocolError(ErrorCode.POLICY, "the Ray cloud does not keep sealed caches")
        return await super().policy(conn, frame)


class ReplicaCore(CloudServer):
    """The single-process cloud's session logic over a pipeline of stages (no sockets: `ReplicaHead`
    hands it the frames the front doors decrypted). Its caches are contiguous `StageCache`s (each later
    stage repeats stage 0's edits on its own `KVCache`s), not paged."""

    paged = False

    def __init__(
        self, spec: StageSpec, downstream: list, limits: ServerLimits | None, batch: BatchConfig | None, lanes: int = 1
    ):
        self.spec, self.downstream, self.lanes = spec, downstream, lanes
        self.incarnation = secrets.token_hex(8)
        self.stage_incarnations: list[str] = []
        self.ready = not downstream
        self.lose_lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        settings = ServerSettings(device=spec.device, dtype=spec.dtype, identity=generate_identity(), batch=batch)
        super().__init__(spec.shard_dir, limits, settings)

    def load_model(self, shard_dir):
        model = load_stage(shard_dir, self.spec.start, self.spec.end, self.device, self.dtype, head_part=True)
        model.middle = PipelineStack(model.middle, self.downstream, self.lose)
        return model

    def make_sessions(self) -> StageSessionTable:
        return StageSessionTable(self.limits, self.budget, self.model.middle, self.lanes)

    def make_scheduler(self, batch: BatchConfig | None) -> Scheduler | Lanes:
        if self.lanes > 1:
            return Lanes(self.model, batch, self.metrics.on_pass, self.lanes)
        return super().make_scheduler(batch)

    def make_requests(self) -> ReplicaRequests:
        return ReplicaRequests(
            self.model, self.device, self.sessions, self.scheduler, self.limits, self.metrics, self.codec
        )

    def reset_stages(self) -> bool:
        """Make every later stage drop its caches; True when all answered (their incarnations noted)."""
        import ray

        try:
            self.stage_incarnations = ray.get([s.reset.remote() for s in self.downstream], timeout=RESET_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            log.warning("replica: a stage did not answer its reset (%s)", type(e).__name__)
            self.ready = False
            return False
        self.ready = True
        return True

    def lose(self, reason: str) -> None:
        """The replica's sessions are gone: end them all and take a new incarnation (called on the
        scheduler thread after a failed pass, or on the event loop after a failed ping). The stages'
        caches of the ended sessions are freed with the next pass; a restarted stage holds none and
        refuses to continue a session it does not know (`StageLost`)."""
        with self.lose_lock:
            old, self.incarnation = self.incarnation, secrets.token_hex(8)
            self.ready = False  # until every stage answers a ping again (`ReplicaHead.watch`)
            ended = list(self.sessions.sessions.values())
            for s in ended:
                s.closed = True  # their queued requests are dropped, never computed
            log.warning(
                "replica incarnation %s lost (%s): %d session(s) end; now %s", old, reason, len(ended), self.incarnation
            )
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.purge, [s.id for s in ended])

    def purge(self, sids: list[int]) -> None:
        for sid in sids:
            if sid in self.sessions.sessions:
                self.sessions.remove(sid)

    def load(self) -> Load:
        return Load(
            len(self.sessions.sessions),
            self.scheduler.queued_rows,
            self.incarnation,
            self.ready,
            str(self.device),
            dtype_name(self.dtype),
            self.budget.budget_bytes,
        )


class ReplicaHead:
    """A replica's stage 0 (Ray actor, asyncio). `stage_names`: its later stages' actor names."""

    def __init__(
        self,
        spec: StageSpec,
        stage_names: list[str],
        namespace: str,
        limits: ServerLimits | None,
        batch: BatchConfig | None,
        lanes: int = 1,
    ):
        import ray

        torch.set_num_threads(spec.threads)
        downstream = [ray.get_actor(name, namespace=namespace) for name in stage_names]
        self.core = ReplicaCore(spec, downstream, limits, batch, lanes)
        if downstream:  # a restarted stage 0: the later stages still hold the old sessions' caches
            self.core.reset_stages()
        self.tasks: list[asyncio.Task] = []
        log.info(
            "replica stage 0: layers [%d, %d) + %d later stage(s), incarnation %s",
            spec.start,
            spec.end,
            len(downstream),
            self.core.incarnation,
        )

    def _started(self) -> None:
        if not self.tasks:
            self.core.loop = asyncio.get_running_loop()
            self.tasks = [asyncio.create_task(self.core.expire_loop()), asyncio.create_task(self.watch())]

    async def watch(self) -> None:
        """Ping the later stages: a failed ping, or another incarnation (a restart between passes),
        loses the replica; once all answer again it is ready for new sessions."""
        while self.core.downstream:
            await asyncio.sleep(PING_INTERVAL_S)
            # while ready, a stage gets PING_TIMEOUT_S to answer; while not (restarting), pings are retried quickly
            timeout = PING_TIMEOUT_S if self.core.ready else PING_INTERVAL_S
            try:
                incs = await asyncio.wait_for(asyncio.gather(*[s.ping.remote() for s in self.core.downstream]), timeout)
            except Exception as e:  # noqa: BLE001 - dead, restarting or unreachable
                if self.core.ready:
                    self.core.lose(f"a stage did not answer its ping ({type(e).__name__})")
                continue
            if self.core.ready and incs != self.core.stage_incarnations:
                self.core.lose("a stage restarted")
            self.core.stage_incarnations, self.core.ready = list(incs), True

    async def handle(
        self, conn_id: str, client_key: bytes, frame: Frame, incarnation: str | None
    ) -> Reply | Failure | Lost:
        """One request that a front door decrypted; `incarnation`: the one its session was opened in."""
        self._started()
        current = self.core.incarnation
        if incarnation is not None and incarnation != current:
            return Lost("the session's replica restarted")
        try:
            reply = await self.core.handle(RemoteConn(conn_id, client_key), frame)
        except ProtocolError as e:
            if incarnation is not None and incarnation != self.core.incarnation:
                return Lost("the session's replica restarted during the request")
            return Failure(int(e.code), e.message)
        except ReplicaLost as e:
            return Lost(str(e))
        except Exception as e:  # noqa: BLE001 - a bug must not take the replica down
            log.exception("replica: internal error")
            return Failure(int(ErrorCode.INTERNAL), f"internal error: {type(e).__name__}")
        return Reply(reply, current)

    async def drop(self, conn_id: str) -> None:
        """A front door's connection ended: so do its sessions."""
        self.core.sessions.drop_connection(conn_id)

    async def load(self) -> Load:
        self._started()
        return self.core.load()

    async def ping(self) -> str:
        return self.core.incarnation
