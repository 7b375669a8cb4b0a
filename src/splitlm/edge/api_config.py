"""serve-edge's settings (`APIConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitlm.decoding.modes import SpecConfig
from splitlm.edge.prefix_pool import PoolLimits


@dataclass
class APIConfig:
    model_name: str = "splitlm"
    api_key: str | None = None  # None = no authentication (loopback use)
    spec: str | SpecConfig = "auto"  # speculative mode (greedy and sampled requests)
    max_concurrent: int = 4  # requests generating at once; more wait
    default_temperature: float = 1.0  # what an omitted temperature means (OpenAI's default is 1)
    default_max_tokens: int = 2048  # an omitted max_tokens: this, or what the context leaves
    prefix_pool: PoolLimits = field(default_factory=PoolLimits)  # conversation states reused (docs/prefix-reuse.md)
