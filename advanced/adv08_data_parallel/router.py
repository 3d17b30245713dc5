"""Which replica gets a request: round-robin, least-load, or cache-aware.

Every replica has its own KV pool and its own prefix cache, so WHERE a request goes decides
whether its prefix is already computed:

    turn 1: [sys A][user 1]                     -> replica 0  (computes all of it)
    turn 2: [sys A][user 1][answer 1][user 2]   -> replica 0  prefix hit: only the new part
                                                -> replica 1  computes everything again

    round_robin    the next replica in turn, whatever it holds or does
    least_load     the lowest score 4 x waiting + running (vLLM's internal DP balancer); ties
                   go to the first replica scanned ("first"), or the scan start moves on after
                   every decision ("rotate", vLLM PR 47420, which spreads ties evenly and, as
                   vLLM issue 52463 found, sends each turn of a conversation somewhere else)
    cache_aware    per replica, an approximate radix tree of the prompts routed there (the
                   router's guess of that replica's prefix cache, LRU-trimmed to the size of
                   its pool). If the load is balanced and some replica's match covers at
                   least `cache_threshold` of the prompt, it goes there; otherwise to the
                   least loaded. The imbalance override (SGLang's router): when
                   max - min > balance_abs and max > balance_rel x min, load wins outright.

The trees are adv05's RadixTree used for its token structure only: one placeholder "block"
covers every node (block_size larger than any prompt); the router never sees real blocks.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from advanced.adv05_radix_cache.radix_tree import RadixTree

_WHOLE = 1 << 40          # a block size no prompt reaches: each node lists placeholder block 0


@dataclass
class ReplicaLoad:
    """What the front end knows of one replica when it routes."""
    in_flight: int = 0          # requests sent there and not finished (counted here: always fresh)
    running: int = 0            # of those, how many the replica last said were running
    kv_usage: float = 0.0       # fraction of its KV blocks held by live requests (last report)
    alive: bool = True

    @property
    def waiting(self) -> int:
        return self.in_flight - min(self.running, self.in_flight)

    @property
    def score(self) -> int:
        # vLLM weighs a waiting request 4x a running one: it still has its prefill ahead.
        return 4 * self.waiting + min(self.running, self.in_flight)


class Router:
    """Base class: subclasses pick among the live replicas; `route` checks and records."""
    name = "router"

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.decisions: Counter[str] = Counter()      # why each request went where it went

    def route(self, prompt_ids: list[int], loads: list[ReplicaLoad]) -> int:
        if len(loads) != self.num_replicas:
            raise ValueError(f"loads: {len(loads)} entries for {self.num_replicas} replicas")
        live = [i for i, load in enumerate(loads) if load.alive]
        if not live:
            raise RuntimeError("no live replica to route to")
        choice, why = self.pick(prompt_ids, loads, live)
        self.decisions[why] += 1
        return choice

    def pick(self, prompt_ids: list[int], loads: list[ReplicaLoad], live: list[int]) -> tuple[int, str]:
        raise NotImplementedError

    def forget(self, replica: int) -> None:
        """The replica died: whatever the router thought it held is gone."""


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self.next = 0

    def pick(self, prompt_ids, loads, live):
        while self.next % self.num_replicas not in live:
            self.next += 1
        choice = self.next % self.num_replicas
        self.next += 1
        return choice, "turn"


class LeastLoad(Router):
    name = "least_load"

    def __init__(self, num_replicas: int, tie_break: str = "first"):
        super().__init__(num_replicas)
        if tie_break not in ("first", "rotate"):
            raise ValueError(f"tie_break must be 'first' or 'rotate', got {tie_break!r}")
        self.tie_break, self.start = tie_break, 0

    def pick(self, prompt_ids, loads, live):
        order = sorted(live, key=lambda i: (i - self.start) % self.num_replicas)   # scan from start
        choice = min(order, key=lambda i: key(loads[i]))                           # min: first of ties
        if self.tie_break == "rotate":
            self.start = (self.start + 1) % self.num_replicas
        return choice, "load"


def key(load: ReplicaLoad) -> tuple[int, float]:
    # KV usage only separates equal scores; rounded, so noise in it does not count as load.
    return load.score, round(load.kv_usage, 1)


class CacheAware(Router):
    name = "cache_aware"

    def __init__(self, num_replicas: int, cache_threshold: float = 0.5, balance_abs: int = 4,
                 balance_rel: float = 1.5, tree_tokens: int = 1 << 20):
        super().__init__(num_replicas)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got {balance_abs}, {balance_rel}")
        if tree_tokens < 1:
            raise ValueError(f"tree_tokens must be >= 1, got {tree_tokens}")
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.tree_tokens = tree_tokens
        self.trees = [RadixTree(_WHOLE) for _ in range(num_replicas)]
        self.sizes = [0] * num_replicas                 # tokens each tree holds

    def pick(self, prompt_ids, loads, live):
        scores = [loads[i].score for i in live]
        hi, lo = max(scores), min(scores)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            choice, why = min(live, key=lambda i: key(loads[i])), "imbalance"
        else:
            matched = {i: self.trees[i].match_prefix(prompt_ids).num_tokens for i in live}
            best = min(live, key=lambda i: (-matched[i], key(loads[i]), self.sizes[i]))
            if prompt_ids and matched[best] / len(prompt_ids) >= self.cache_threshold:
                choice, why = best, "prefix"
            else:          # nothing worth following: the least loaded, then the emptiest tree
                choice, why = min(live, key=lambda i: (key(loads[i]), self.sizes[i])), "balance"
        self._remember(choice, prompt_ids)
        return choice, why

    def _remember(self, i: int, prompt_ids: list[int]) -> None:
        tree = self.trees[i]
        before = tree.match_prefix(prompt_ids).num_tokens
        tree.insert(list(prompt_ids), [0])
        self.sizes[i] += len(prompt_ids) - before
        while self.sizes[i] > self.tree_tokens:        # the replica's pool evicts too: forget LRU
            leaf = min(tree.leaves(), key=lambda n: n.last_access)
            tree.remove_leaf(leaf)
            self.sizes[i] -= len(leaf.tokens)

    def match(self, replica: int, prompt_ids: list[int]) -> int:
        """Tokens of the prompt the router believes `replica` holds."""
        return self.trees[replica].match_prefix(prompt_ids).num_tokens

    def forget(self, replica: int) -> None:
        self.trees[replica], self.sizes[replica] = RadixTree(_WHOLE), 0


POLICIES: dict[str, type[Router]] = {cls.name: cls for cls in (RoundRobin, LeastLoad, CacheAware)}


def create_router(policy: str, num_replicas: int, **options) -> Router:
    """A router by name (round_robin, least_load, cache_aware) with its options."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {sorted(POLICIES)}")
    try:
        return POLICIES[policy](num_replicas, **options)
    except TypeError as e:                # an option this policy does not take
        raise ValueError(f"routing policy {policy!r}: {e}") from None
