"""What the sessions of one edge share (`SessionSetup`), gathered from the edge (`SessionParts`) when it
opens one (`splitlm.edge.session.EdgeSession`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from splitlm.edge.backends import EdgeBackend
from splitlm.edge.connections import CloudConnections
from splitlm.edge.link import StepObserver
from splitlm.edge.prefill import PrefillCosts
from splitlm.model.shards import EdgeModel
from splitlm.transport.policy import CachePolicy


class SessionParts(Protocol):
    """What an edge lends its sessions (`splitlm.edge.Edge` has them)."""

    backend: EdgeBackend
    connections: CloudConnections
    wire_dtype: str
    cache_policy: CachePolicy
    prefill_chunk: int | str
    prefill_costs: PrefillCosts
    observer: StepObserver | None
    model: EdgeModel  # its manifest names the head layers (the control tuple's `split`)


@dataclass
class SessionSetup:
    """What the sessions of one edge share (`splitlm.edge.Edge.open_session` gathers it)."""

    backend: EdgeBackend
    connections: CloudConnections
    wire_dtype: str
    cache_policy: CachePolicy  # the edge's default
    split: int  # the edge's head layers (the control tuple's `split`)
    prefill_chunk: int | str = "auto"  # how a prompt goes up (`splitlm.edge.stream_prefill.plan_for`)
    prefill_costs: PrefillCosts = field(default_factory=PrefillCosts)  # the edge's, measured by every session
    observer: StepObserver | None = None  # sees every forward and result (`Edge.observer`)

    @staticmethod
    def of(edge: SessionParts) -> SessionSetup:
        """What `edge`'s sessions share now (its prefill setting and observer may change between sessions)."""
        return SessionSetup(
            edge.backend,
            edge.connections,
            edge.wire_dtype,
            edge.cache_policy,
            edge.model.manifest.head,
            edge.prefill_chunk,
            edge.prefill_costs,
            edge.observer,
        )
