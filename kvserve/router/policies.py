"""Routing policies: which healthy instance serves a request.

- `round_robin`: in turn.
- `least_loaded`: the fewest load tokens (the router's own account: instances.py).
- `cache_aware` (SGLang's rule, with the shared pool added): while the loads are balanced, the instance that would
  prefill the fewest of the prompt's blocks (blocks in its own pool or tiers cost nothing, blocks the shared pool
  holds `pool_block_cost` of one), the least loaded among equals; when the loads are unbalanced (the busiest above
  `balance_abs_tokens` and above `balance_ratio` x the idlest) the least loaded instance, so a hot prefix cannot
  pile all the work onto one instance. Without index answers (no index, or the index is down) it is
  `least_loaded`, and no request fails for it. (Adding the load to the prefill cost instead moved conversations
  off their instance whenever it was briefly busier, and lost most of the hits: docs/benchmarks.md.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvserve.router.instances import Instance

POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass
class RouteInput:
    num_prompt_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)  # of the prompt's full blocks
    block_size: int = 16
    # From the index, when it answered: instance name -> how many leading prompt blocks it holds locally (its
    # pool or its tiers), and how many leading blocks the shared pool holds.
    local_hits: dict[str, int] | None = None
    pool_hits: int = 0


@dataclass
class Decision:
    instance: Instance
    reason: str  # "round_robin" | "least_loaded" | "cache" | "balance" | "no_index"
    cached_blocks: int = 0  # blocks the chosen instance holds (locally or through the pool)


@dataclass
class PolicyConfig:
    decode_weight: float = 4.0
    pool_block_cost: float = 0.1  # a pool block costs this fraction of prefilling it (a fetch, not a forward)
    balance_abs_tokens: float = 4096
    balance_ratio: float = 2.0


class RoundRobin:
    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Instance], route: RouteInput) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._tie = itertools.count()

    def choose(self, candidates: list[Instance], route: RouteInput, reason: str = "least_loaded") -> Decision:
        w = self.config.decode_weight
        low = min(c.load_tokens(w) for c in candidates)
        tied = [c for c in candidates if c.load_tokens(w) == low]
        return Decision(tied[next(self._tie) % len(tied)], reason)


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.least_loaded = LeastLoaded(config)

    def choose(self, candidates: list[Instance], route: RouteInput) -> Decision:
        if route.local_hits is None:
            return self.least_loaded.choose(candidates, route, "no_index")
        cfg = self.config
        loads = [c.load_tokens(cfg.decode_weight) for c in candidates]
        if max(loads) > cfg.balance_abs_tokens and max(loads) > cfg.balance_ratio * (min(loads) + 1):
            return self.least_loaded.choose(candidates, route, "balance")
        num_blocks = len(route.block_hashes)
        best, best_key, best_cached = None, None, 0
        for inst, load in zip(candidates, loads, strict=True):
            local = min(route.local_hits.get(inst.name, 0), num_blocks)
            pooled = max(0, min(route.pool_hits, num_blocks) - local)
            uncached = num_blocks - local - pooled
            key = (uncached + cfg.pool_block_cost * pooled, load)
            if best_key is None or key < best_key:
                best, best_key, best_cached = inst, key, local + pooled
        assert best is not None
        return Decision(best, "cache", best_cached)


def make_policy(name: str, config: PolicyConfig | None = None):
    config = config or PolicyConfig()
    if name == "round_robin":
        return RoundRobin(config)
    if name == "least_loaded":
        return LeastLoaded(config)
    if name == "cache_aware":
        return CacheAware(config)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
