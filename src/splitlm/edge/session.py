"""An edge session: one cloud session plus the edge's own head and tail caches.

It runs the head layers, sends hidden states, runs the tail and LM head on what comes back, and
keeps track of what the cloud holds (committed entries, piggy-backed keep and crop, context rows
re-sent under cache policies that keep nothing), one request or two in flight."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import splitlm.edge.replay as replay
import splitlm.edge.stream_prefill as stream_prefill
from splitlm import SplitLMError
from splitlm.decoding.step import StepResult
from splitlm.model.device import to_device, to_host
from splitlm.transport.client import CloudError, PendingForward, lost
from splitlm.transport.messages import Control, Forward, PolicyChange, Result
from splitlm.transport.policy import CachePolicy

log = logging.getLogger(__name__)

SPEC_HEADROOM = 128  # cache entries a verification pass may add beyond the committed tokens (tree + window)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the session's caches (later turns of a conversation)
    new_tokens: int = 0
    round_trips: int = 0  # all cloud round trips, prefill included
    prefill_round_trips: int = 1  # more when the prompt exceeds the cloud's tokens per forward
    prefill_s: float = 0.0  # prompt in -> first token out (time to first token)
    decode_s: float = 0.0  # after the first token
    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0  # round-trip time minus the cloud's compute
    cloud_compute_s: float = 0.0
    edge_compute_s: float = 0.0
    serialize_s: float = 0.0  # frame and tensor encoding/decoding on the edge
    failovers: int = 0  # connections lost (or clouds gone) mid-request, survived by replay (`EdgeSession.failover`)
    failover_s: float = 0.0  # from the fault seen to the replayed requests sent again (reconnect, new session)
    failover_stall_s: float = 0.0  # for each fault: the interrupted step's first send to its reply after the replay
    spec_mode: str = "none"
    spec: dict = field(default_factory=dict)  # speculative decoding: tree sizes chosen, acceptance, link model

    @property
    def failover_note(self) -> str:
        """`, 1 failover (0.19 s)` when the request survived faults, else empty (for stats lines)."""
        if not self.failovers:
            return ""
        return f", {self.failovers} failover{'s' if self.failovers > 1 else ''} ({self.failover_s:.2f} s)"

    @property
    def decode_round_trips(self) -> int:
        return max(0, self.round_trips - self.prefill_round_trips)

    @property
    def tokens_per_round_trip(self) -> float:
        """Tokens produced by decoding steps per decoding round trip (prefill excluded)."""
        return (self.new_tokens - 1) / self.decode_round_trips if self.decode_round_trips else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_round_trip": round(self.tokens_per_round_trip, 4),
                "tokens_per_s": round(self.tokens_per_s, 3)}


@dataclass
class Flight:
    """One forward's block of new tokens, from its send until its keep is applied everywhere."""
    ids: list[int]
    h: torch.Tensor  # [T, D] head outputs of the new tokens
    positions: list[int]
    mask: torch.Tensor | None
    rows: list[int] | None
    start: int  # committed entries before the block (edge)
    argmax: bool = False  # the reply's result is each row's greedy token, not its logits
    extras: int = 0  # > 0: also each row's `extras` likeliest ids and final hidden state (`StepResult`), for drafters
    sent: PendingForward | None = None
    edge_s: float = 0.0  # head (and later tail) compute
    serialize_s: float = 0.0
    overlapped: bool = False  # sent while an earlier forward was still in flight
    bytes_up: int = 0  # of its request
    keep: list[int] | None = None  # which of its entries stay (None: all); set when the block is settled
    settled: bool = False
    void: bool = False  # rolled back before its reply came: the reply is discarded
    first_sent: float = 0.0  # perf_counter() of its first send
    replayed: bool = False  # the first block a failover re-sent (its stall is counted)


class EdgeSession:
    """One cloud session together with the edge's own KV caches for its head and tail layers.

    The session has a cloud connection to itself for its lifetime (taken from the edge's pool), so
    sessions in different threads never share a connection.

    The edge also keeps its head layers' outputs for every committed token (`history`, [L, D]), so
    that whatever the cloud does not hold under the cache policy (`none`, after `revoke`) is re-sent
    as context rows instead of being recomputed. `edge`: the `splitlm.edge.Edge` it belongs to.
    """

    def __init__(self, edge, cache_policy: str | CachePolicy | None = None):
        self.edge = edge
        try:
            self.policy = CachePolicy.parse(cache_policy) if cache_policy else edge.cache_policy
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        self.key = AESGCM.generate_key(bit_length=256) if self.policy.sealed else None  # never leaves this session
        self.wire_dtype = edge.wire_dtype
        authorised = edge.vocab.packed() if edge.split_head and not edge.vocab.everything else None
        self.client, self.id = edge._open_cloud_session(self.policy, authorised)
        self.head_cache = edge.model.head.new_cache()
        self.tail_cache = edge.model.tail.new_cache()
        self.history = torch.zeros(0, edge.cfg.hidden_size, device=edge.device)  # [L, D] fp32 (the residual stream)
        self.history_pos: list[int] = []
        self.pending: Flight | None = None  # the last forward's block, not yet settled
        self.tail_block: Flight | None = None  # the last block run through the tail whose keep is not applied there
        self.flights: deque[Flight] = deque()  # sent, reply not yet taken (oldest first)
        self.cloud_committed = 0  # committed entries the cloud holds (a prefix; a suffix under window:N)
        self.cloud_pending = 0  # size of the cloud's pending block
        self.cloud_keep: list[int] | None = None  # to piggy-back on the next FORWARD
        self.cloud_crop: int | None = None
        self.stats = GenerationStats()
        self.last_prefill = None  # the last streamed prefill (`splitlm.edge.prefill.PrefillRun`)

    @property
    def length(self) -> int:
        return self.head_cache.length

    @property
    def max_step_tokens(self) -> int | None:
        """The most new tokens one step may carry (a window policy caps it at N; in split-head the
        frame limit caps the rows of logits a RESULT may hold)."""
        caps = [c for c in (self.policy.window, self.edge.max_logit_rows) if c is not None]
        return min(caps) if caps else None

    def settle(self, keep: list[int] | None = None) -> None:
        """Resolve the last forward's tokens: keep only `keep` (all if None) in every cache. The tail
        cache applies it once it has run the block (a pipelined block's reply may still be in flight)."""
        f = self.pending
        if f is None:
            return
        self.pending = None
        f.keep, f.settled = (None if keep is None else list(keep)), True
        h, pos = f.h, f.positions
        if keep is not None:
            self.head_cache.keep(keep)
            h, pos = h[keep], [pos[i] for i in keep]
            if self.cloud_pending:
                self.cloud_keep = list(keep)
        if self.tail_block is f:
            self._settle_tail()
        self.history = torch.cat([self.history, h])
        self.history_pos += pos
        self.cloud_committed += len(pos) if self.cloud_pending else 0
        self.cloud_pending = 0

    def _settle_tail(self) -> None:
        f, self.tail_block = self.tail_block, None
        if f.keep is not None:
            self.tail_cache.keep(f.keep)

    @property
    def pipelines(self) -> bool:
        """Whether several forwards may be in flight: the cloud must hold the whole context (a
        `session` or `sealed` policy), so that a rolled-back step is undone with a crop."""
        return self.policy.retention > 0 and self.policy.window is None

    def _idle(self) -> None:
        """Require no step in flight, and settle the last one everywhere."""
        if self.flights:
            raise SplitLMError("a forward is still in flight on this session")
        self.settle()
        if self.tail_block is not None:
            self._settle_tail()

    def crop(self, n: int) -> None:
        """Truncate the conversation to its first n committed tokens (edge and cloud)."""
        self._idle()
        if not 0 <= n <= self.length:
            raise SplitLMError(f"cannot crop to {n} tokens: the session holds {self.length}")
        offset = self.length - self.cloud_committed  # oldest committed entries the cloud does not hold
        self.head_cache.crop(n)
        self.tail_cache.crop(n)
        self.history, self.history_pos = self.history[:n], self.history_pos[:n]
        cloud_n = max(0, n - offset)
        if cloud_n < self.cloud_committed:
            before = self.cloud_committed - len(self.cloud_keep or [])  # the cloud applies crop before keep
            if self.cloud_keep is not None and cloud_n >= before:  # only kept entries go: shorten the keep
                self.cloud_keep = self.cloud_keep[: cloud_n - before]
            else:
                self.cloud_keep = None
                self.cloud_crop = cloud_n if self.cloud_crop is None else min(self.cloud_crop, cloud_n)
            self.cloud_committed = cloud_n

    def abandon(self, n: int) -> None:
        """Stop where the session stands and go back to its first n committed tokens: the replies of
        the steps still in flight are taken and dropped, then edge and cloud are cropped to n (an
        interrupted conversation turn: the next one sees the session as if it never happened)."""
        for f in self.flights:
            f.void = True
        while self.flights:
            self._finish(self.flights[0])
        if self.client.in_flight:  # interrupted between sending a request and recording it: out of step
            self.failover(lost("a request was interrupted half-way"))
        self.crop(n)

    def revoke(self) -> None:
        """Wipe the cloud's cache of this session now; later requests re-send the history they need."""
        self._idle()
        self._policy(PolicyChange(revoke=True))
        self.cloud_committed, self.cloud_keep, self.cloud_crop = 0, None, None

    def tighten(self, cache_policy: str | CachePolicy) -> None:
        """Switch to a tighter cache policy for the rest of the session (the cloud refuses a looser one).

        `none` and `sealed` take effect on the cloud now; `window:N` with the next request's
        control tuple (after that request's keep, so the pending block stays intact)."""
        try:
            new = CachePolicy.parse(cache_policy)
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        if not self.policy.allows(new):
            raise SplitLMError(f"cache policy {self.policy} cannot be loosened to {new}")
        if new.mode == "window":
            self.policy = new
            return
        if new.sealed and self.key is None:
            self.key = AESGCM.generate_key(bit_length=256)
        self._policy(PolicyChange(new, key=self.key if new.sealed else None))
        self.policy = new
        if new.retention == 0:
            self.cloud_committed, self.cloud_pending, self.cloud_keep, self.cloud_crop = 0, 0, None, None

    def _policy(self, change: PolicyChange) -> None:
        """A POLICY request (the session is idle), failing over if the cloud is gone."""
        try:
            self.client.policy(self.id, change)
        except CloudError as e:
            if not e.retryable:
                raise
            self.failover(e)
            if change.key is not None:
                change.key = self.key  # the new session's
            self.client.policy(self.id, change)

    def _context_rows(self) -> int:
        """How many committed rows, counted from the end of the history, the cloud lacks."""
        held = self.cloud_committed
        if self.policy.window is not None:
            return 0 if held else min(self.length, self.policy.window)
        return self.length - held

    def control(self) -> Control:
        """The control tuple of this session's next request."""
        return Control(cache=self.policy.retention > 0, window=self.policy.window, dtype=self.wire_dtype,
                       split=self.edge.model.manifest.head, key=self.key)

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: list[int] | None = None, mask: torch.Tensor | None = None,
                keep: list[int] | None = None, rows: list[int] | None = None, argmax: bool = False,
                extras: int = 0) -> StepResult:
        """Run T new tokens through edge head -> cloud -> edge tail; the step's `out` holds logits
        [len(rows) or T, V] (with `argmax`: each row's greedy token, [len(rows) or T], through the
        screened LM head). With `extras` = k > 0 it also holds each row's k likeliest ids (`topk`,
        [R, k]) and final-normed hidden state (`hidden`, [R, D]; None in the split-head topology):
        what edge-side drafters learn from. They stay on the edge.

        `keep` first retains only those entries of the previous call's new tokens, in both the
        edge's caches and (piggy-backed on this request) the cloud's. A causal run longer than a
        window policy allows is sent in chunks.
        """
        if self.flights:
            raise SplitLMError("a forward is still in flight on this session")
        self.settle(keep)
        window, rows_cap = self.policy.window, self.edge.max_logit_rows
        want = list(range(len(ids))) if rows is None else rows
        per_forward = self.client.info.limits.max_tokens_per_forward
        room = max(1, per_forward - self._context_rows()) if per_forward else None  # re-sent context rows count
        exceeded = [cap for cap, n in ((window, len(ids)), (rows_cap, len(want)), (room, len(ids)))
                    if cap is not None and n > cap]
        limit = min(exceeded) if exceeded else None
        if mask is None and positions is None and self.pipelines and not self._context_rows():
            p = stream_prefill.plan_for(self, len(ids), limit or len(ids))
            if p is not None:
                return stream_prefill.stream(self, ids, want, p, argmax)
        if limit is not None and mask is None:
            if positions is not None:
                raise SplitLMError("a chunked forward takes default positions")
            steps = []
            for a in range(0, len(ids), limit):
                part = [r - a for r in want if a <= r < a + limit]
                steps.append(self._finish(self._send(ids[a:a + limit], None, None, part, argmax)))
                self.settle()
            self.stats.prefill_round_trips = -(-len(ids) // limit)
            return replace(steps[-1], out=torch.cat([step.out for step in steps]))  # the last chunk's costs
        if limit is not None:
            raise SplitLMError(f"a step of {len(ids)} tokens ({len(want)} rows of logits) exceeds the cache window "
                               f"({window}) or the rows of logits one reply may hold ({rows_cap})")
        return self._finish(self._send(ids, positions, mask, rows, argmax, extras))

    # -- pipelined steps: up to two forwards in flight ------------------------------------------
    @torch.inference_mode()
    def send(self, ids: list[int], positions: list[int], mask: torch.Tensor | None = None,
             rows: list[int] | None = None, keep: list[int] | None = None, argmax: bool = False) -> Flight:
        """Settle the last block with `keep` and send a step without waiting for its reply (take it
        with `receive`, oldest first). The step's tokens see the context as it is once `keep` applies."""
        if len(self.flights) >= 2:
            raise SplitLMError("at most two forwards may be in flight")
        if self.flights and not self.pipelines:
            raise SplitLMError(f"cache policy {self.policy} does not allow pipelined steps")
        self.settle(keep)
        return self._send(ids, positions, mask, rows, argmax)

    @torch.inference_mode()
    def receive(self, f: Flight) -> StepResult:
        """Step `f`'s result (the oldest in flight): its logits, or greedy tokens if sent with `argmax`."""
        step = self._finish(f)
        if step is None:
            raise SplitLMError("a rolled-back step's reply is taken with discard")
        return step

    def discard(self, f: Flight) -> None:
        """Take the reply of a rolled-back step `f` (the oldest in flight) and drop it."""
        f.void = True
        self._finish(f)

    @torch.inference_mode()
    def rewind(self, f: Flight, keep: list[int]) -> None:
        """Step `f` (received) was settled with a guess; really keep `keep` of its block, and drop
        every step sent after it (their replies must still be taken with `discard`).

        Entries of `keep` that the guess dropped are recomputed by the head and re-sent to the cloud
        as context rows with the next request; the tail ran the whole block and keeps them."""
        if self.tail_block is not f or not f.settled or self.pending is f:
            raise SplitLMError("rewind needs the received, settled step before the in-flight ones")
        guess = list(range(len(f.ids))) if f.keep is None else f.keep
        common = 0
        while common < min(len(guess), len(keep)) and guess[common] == keep[common]:
            common += 1
        f.keep = list(keep)
        self._settle_tail()
        for later in self.flights:
            later.void = True
        self.pending = None
        n = f.start + common
        self.head_cache.crop(n)
        self.history, self.history_pos = self.history[:n], self.history_pos[:n]
        redo = keep[common:]
        if redo:
            pos = [f.positions[i] for i in redo]
            t0 = time.perf_counter()
            dev = self.edge.device
            h = self.edge.model.embed_and_head(torch.tensor([[f.ids[i] for i in redo]], device=dev),
                                               torch.tensor(pos, device=dev), None, self.head_cache)[0]  # [R, D]
            self.stats.edge_compute_s += time.perf_counter() - t0
            self.history = torch.cat([self.history, h])
            self.history_pos += pos
        self.cloud_keep, self.cloud_pending = None, 0
        self.cloud_crop = n if self.cloud_crop is None else min(self.cloud_crop, n)
        self.cloud_committed = n  # the re-computed entries go up as context rows with the next request

    def _send(self, ids, positions, mask, rows, argmax=False, extras=0) -> Flight:
        model = self.edge.model
        if positions is None:
            positions = list(range(self.length, self.length + len(ids)))
        n, c = self.length, self._context_rows()
        t0 = time.perf_counter()
        dev = self.edge.device
        h = model.embed_and_head(torch.tensor([ids], device=dev), torch.tensor(positions, device=dev),
                                 None if mask is None else to_device(mask, dev), self.head_cache)[0]  # [T, D]
        f = Flight(list(ids), h, list(positions), mask, rows, n, argmax, extras, edge_s=time.perf_counter() - t0,
                   overlapped=bool(self.flights))
        self.flights.append(f)
        self.pending = f
        try:
            self._transmit(f, c)
        except CloudError as e:
            if not e.retryable:
                self.flights.pop()
                raise
            self.failover(e)  # re-sends f too
        return f

    def _transmit(self, f: Flight, c: int) -> None:
        """Send block `f` to the cloud after the last `c` committed rows before it (context rows), with
        the keep and crop the cloud still owes; then count what the cloud holds."""
        client = self.client
        start = time.perf_counter()
        sent = torch.cat([self.history[f.start - c:f.start], f.h]) if c else f.h  # [C + T, D]
        sent = to_host(sent)  # the wire codec reads host memory (one copy per step)
        sent_pos = self.history_pos[f.start - c:f.start] + f.positions if c else f.positions
        up, ser = client.bytes_up, client.serialize_s
        split_head = self.edge.split_head
        n_rows = len(f.ids) if f.rows is None else len(f.rows)
        f.edge_s += time.perf_counter() - start
        f.first_sent = f.first_sent or start
        request = Forward(sent, torch.as_tensor(sent_pos, dtype=torch.long), f.mask, self.cloud_keep, self.cloud_crop,
                          c, self.control(), f.rows if split_head else None)
        f.sent = client.send_forward(self.id, request, self.wire_dtype,
                                     n_rows * self.edge.vocab.size if split_head else sent.numel())
        f.serialize_s += client.serialize_s - ser
        f.bytes_up = client.bytes_up - up
        self.stats.bytes_up += f.bytes_up
        retained = self.policy.retention > 0
        self.cloud_keep = self.cloud_crop = None
        self.cloud_pending = len(f.ids) if retained else 0
        self.cloud_committed = self.cloud_committed + c if retained else 0

    # -- failover (`splitlm.edge.replay`): a new session rebuilt from what the edge holds -----------
    def failover(self, error: CloudError) -> None:
        """Reconnect, open a new cloud session and replay into it every request still owed a reply
        (`splitlm.edge.replay.failover`)."""
        replay.failover(self, error)

    def _replay(self) -> None:
        replay.replay(self)

    def _rebuild(self, upto: int, then: int) -> int:
        return replay.rebuild(self, upto, then)

    def _finish(self, f: Flight) -> StepResult | None:
        """Take step `f`'s reply (the oldest in flight), run the tail on it and count its costs; None
        for a rolled-back (void) step, whose reply is dropped."""
        if not self.flights or self.flights[0] is not f:
            raise SplitLMError("replies are taken in the order the steps were sent")
        result, down, ser = self._take_reply(f)
        self.flights.popleft()
        t2 = time.perf_counter()
        if f.replayed:
            f.replayed = False
            self.stats.failover_stall_s += t2 - f.first_sent
        if result is not None and f is self.pending and self.policy.retention > 0:
            self.cloud_committed = result.cache_len - self.cloud_pending  # the cloud's count (a window trims it)
        out = topk = hidden = None
        if not f.void:
            if self.tail_block is not None:  # the block before this one, settled since
                self._settle_tail()
            out, topk, hidden = self._tail(f, result.tensors)
            self.tail_block = f  # its keep applies at the next tail pass (a guessed keep may still be rewound)
        t3 = time.perf_counter()
        compute_s = result.compute_s if result is not None else 0.0
        wait_s = result.wait_s if result is not None else 0.0
        network_s = max(0.0, wait_s - compute_s - ser)
        edge_s = f.edge_s + (t3 - t2)
        alone = not f.overlapped and not self.flights  # nothing else was on the link: its wait is the network's
        self.edge.prefill_costs.observe(len(f.ids), f.start, f.edge_s + f.serialize_s, t3 - t2 + ser, compute_s,
                                        f.bytes_up + down, network_s if alone else None)
        s = self.stats
        s.round_trips += 1
        s.bytes_down += down
        s.cloud_compute_s += compute_s
        s.serialize_s += f.serialize_s + ser
        s.network_s += network_s
        s.edge_compute_s += edge_s
        if f.void:
            return None
        return StepResult(out, len(f.ids), network_s, edge_s + compute_s, f.overlapped, topk, hidden)

    def _take_reply(self, f: Flight) -> tuple[Result | None, int, float]:
        """Step `f`'s RESULT (None: a void block a failover did not re-send), failing over (and
        re-sending `f` and the blocks after it) while the cloud is gone; with the bytes down and the
        seconds of decryption and decoding that taking it cost on the connection it came from."""
        while True:
            client = self.client
            down, ser = client.bytes_down, client.serialize_s
            if f.sent is None:
                return None, 0, 0.0
            try:
                result = client.receive_forward(f.sent)
            except CloudError as e:
                if not e.retryable:
                    raise
                self.failover(e)
                continue
            return result, client.bytes_down - down, client.serialize_s - ser

    def _tail(self, f: Flight, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                      torch.Tensor | None]:
        """The edge's end of step `f` on the cloud's tensors `out`: the asked rows' logits [R, V] (or with
        argmax their greedy ids [R]), and with extras their top-k ids [R, k] and final hidden state [R, D]."""
        if self.edge.split_head:  # no tail layers here: the cloud's h[:d] and partial logits complete the LM head
            return self._split_head_tail(f, out)
        dev = self.edge.device
        pos, h = torch.tensor(f.positions, device=dev), to_device(out["hidden"], dev, torch.float32)[None]
        mask = None if f.mask is None else to_device(f.mask, dev)
        if self.edge.onnx:  # the tail graph ends in the LM head: logits, no final hidden state
            full = self.edge.vocab.mask_logits(self.edge.model.tail_and_logits(h, pos, mask, self.tail_cache,
                                                                               f.rows)[0])  # [R, V]
            topk = full.topk(f.extras, -1).indices if f.extras else None
            return (full.argmax(-1) if f.argmax else full), (None if topk is None else to_host(topk)), None
        normed = self.edge.model.tail_normed(h, pos, mask, self.tail_cache, f.rows)[0]  # [R, D]
        if f.argmax:
            logits, topk = self.edge.model.greedy_head().candidates(normed, self.edge.allowed, f.extras)
            logits = to_host(logits)
        else:
            logits = self.edge.vocab.mask_logits(to_host(self.edge.model.lm_logits(normed)))
            topk = logits.topk(f.extras, -1).indices if f.extras else None
        hidden = to_host(normed) if f.extras else None
        return logits, (None if topk is None else to_host(topk)), hidden

    def _split_head_tail(self, f: Flight, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                                 None]:
        n_rows = len(f.ids) if f.rows is None else len(f.rows)
        logits = self.edge.split_head_logits(out, n_rows)  # [R, V]
        self.tail_cache.begin(len(f.ids))  # the (empty) tail cache stays in step with the head cache
        topk = to_host(logits.topk(f.extras, -1).indices) if f.extras else None
        return to_host(logits.argmax(-1) if f.argmax else logits), topk, None

    def close(self) -> None:
        """End the cloud session; its connection goes back to the pool (or is dropped if it failed)."""
        try:
            self.client.close_session(self.id)
        except CloudError as e:
            log.warning("dropping a cloud connection: %s", e)
            self.edge._drop_client(self.client)
        else:
            self.edge._clients.give(self.client)
