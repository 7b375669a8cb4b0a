"""How an `splitlm.edge.Edge` connects to its clouds and runs its own layers: one dataclass, checked
when it is made.

    Edge("split/edge", "wss://a:8765,wss://b:8765", EdgeConfig(wire_dtype="fp32", cache_policy="sealed"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitlm import SplitLMError
from splitlm.edge.connections import CAPACITY_TIMEOUT_S, FAILOVER_TIMEOUT_S, ClientSettings
from splitlm.edge.vocab import VocabSubset
from splitlm.transport.client import PING_INTERVAL_S
from splitlm.transport.codecs import check_wire_dtype
from splitlm.transport.crypto import RekeyPolicy
from splitlm.transport.keys import Identity
from splitlm.transport.policy import CachePolicy


@dataclass(frozen=True)
class EdgeConfig:
    """The edge's settings (the defaults serve the bundled model on this machine).

    wire_dtype: how activations travel; `auto`: fp16, or bf16 for Gemma, whose activations exceed fp16's range.
    timeout_s: the longest wait for one reply of the cloud.
    cache_policy: what the cloud may keep between requests (`splitlm.transport.policy`): none,
    session, window:N or sealed; each session may choose its own (a tighter one).
    identity, cloud_key, known_hosts, tls_ca, rekey: see `splitlm.transport.client.CloudClient`
    (defaults: the client identity in the config dir, trust-on-first-use of the cloud's key).
    vocab: the token ids the model may emit (`splitlm.edge.vocab`): all, en, zh or an allow-list
    file; a split-head cloud computes partial logits for these only.
    device, dtype: where the edge's layers run and in which precision (`splitlm.model.device`;
    default auto: CUDA in bf16 where present, else the CPU in fp32); `onnx` or `onnx:int8`: the graphs of
    `splitlm export-onnx` in ONNX Runtime on the CPU (`splitlm.edge.onnx_runtime`).
    failover_timeout_s: how long a session that lost its cloud keeps reconnecting (the same URL or
    the next one, with backoff) before it gives up (`splitlm.edge.replay`).
    capacity_timeout_s: as long, for clouds that are up but answer CAPACITY (their KV memory is full
    and older requests go first, docs/protocol.md §8.1).
    ping_interval_s: keepalive pings both ways (a link that answers none for as long is dead); None = off.
    prefill_chunk: how a prompt goes up (`splitlm.edge.prefill`): `auto` streams it in pipelined
    chunks when the measured link and compute say that is sooner; N: in chunks of N tokens;
    0: in one forward (in chunks one after another only where the cloud's limits demand it).
    edge_adapter: a `peft` LoRA adapter directory of the full model, merged into the edge's layers
    (`splitlm.edge.adapters`); it must touch only modules the edge holds, and never leaves the edge."""

    wire_dtype: str = "auto"
    timeout_s: float = 60.0
    cache_policy: str | CachePolicy | None = "session"
    identity: Identity | str | Path | None = None
    cloud_key: str | bytes | None = None
    known_hosts: str | Path | None = None
    tls_ca: str | Path | None = None
    rekey: RekeyPolicy | None = None
    vocab: str | VocabSubset | None = "all"
    device: str = "auto"
    dtype: str = "auto"
    failover_timeout_s: float = FAILOVER_TIMEOUT_S
    capacity_timeout_s: float = CAPACITY_TIMEOUT_S
    ping_interval_s: float | None = PING_INTERVAL_S
    prefill_chunk: int | str = "auto"
    edge_adapter: str | Path | None = None

    def __post_init__(self) -> None:
        self.policy()
        chunk = self.prefill_chunk
        if chunk != "auto" and (type(chunk) is not int or chunk < 0):
            raise SplitLMError(f"prefill_chunk must be auto or a number of tokens >= 0, not {chunk!r}")
        if self.wire_dtype != "auto":
            self.wire(self.wire_dtype)

    def policy(self) -> CachePolicy:
        """The edge's default cache policy, parsed."""
        try:
            return CachePolicy.parse(self.cache_policy or "session")
        except ValueError as e:
            raise SplitLMError(str(e)) from None

    def wire(self, auto: str) -> str:
        """The wire dtype, `auto` being the model's (`auto`)."""
        try:
            return check_wire_dtype(auto if self.wire_dtype == "auto" else self.wire_dtype)
        except ValueError as e:
            raise SplitLMError(str(e)) from None

    def client_settings(self, fingerprint: str) -> ClientSettings:
        """How each connection to a cloud serving the edge shard of `fingerprint` is made."""
        return ClientSettings(
            fingerprint,
            self.timeout_s,
            self.identity,
            self.cloud_key,
            self.known_hosts,
            self.tls_ca,
            self.rekey,
            self.ping_interval_s,
        )
