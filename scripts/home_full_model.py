"""How often a prompt's home is full on the skewed workload, with and without replicas.

A plain model of ``configs/bench/routing-skewed.toml`` without caches
(docs/benchmarks.md, "Prefix placement on a skewed workload, caches
reported", "Replicas of a hot prefix"): 16 closed-loop clients, each
sending its next prompt when its last is answered (0.2 s plus an
exponential 0.9 s, about the sims' answer at 40 tokens/s); 24 tenants
drawn as i ** -0.61; 4 instances of 8 slots. Each tenant's homes are set
once, the hottest first on the least loaded by demand (the best the
edge's home moves can do), a tenant with several homes on that many; a
prompt goes to the least busy of its homes. It prints the share of
prompts whose homes were all full (each a miss on the real edge) for a
few replica plans.

    python scripts/home_full_model.py
"""

from __future__ import annotations

import heapq
import random

TENANTS = 24
ZIPF_S = 0.61
INSTANCES = 4
SLOTS = 8
CLIENTS = 16


def full_share(replicas: dict[int, int], prompts: int = 200_000, seed: int = 0) -> float:
    """The share of ``prompts`` that found every home of theirs full, with
    tenant t on ``replicas.get(t, 1)`` homes."""
    rng = random.Random(seed)
    weights = [(t + 1) ** -ZIPF_S for t in range(TENANTS)]
    demand = [0.0] * INSTANCES
    homes: dict[int, list[int]] = {}
    for t in sorted(range(TENANTS), key=lambda t: -weights[t]):
        k = replicas.get(t, 1)
        homes[t] = sorted(range(INSTANCES), key=lambda i: demand[i])[:k]
        for i in homes[t]:
            demand[i] += weights[t] / k
    busy = [0] * INSTANCES
    ends: list[tuple[float, int]] = []
    full = sent = 0

    def send(now: float) -> None:
        nonlocal full, sent
        tenant = rng.choices(range(TENANTS), weights=weights)[0]
        at = min(homes[tenant], key=lambda i: busy[i])
        sent += 1
        if busy[at] >= SLOTS:
            full += 1
            at = min(range(INSTANCES), key=lambda i: busy[i])
        busy[at] += 1
        heapq.heappush(ends, (now + 0.2 + rng.expovariate(1 / 0.9), at))

    for _ in range(CLIENTS):
        send(0.0)
    while sent < prompts:
        now, at = heapq.heappop(ends)
        busy[at] -= 1
        send(now)
    return full / sent


def main() -> None:
    plans: list[tuple[str, dict[int, int]]] = [
        ("one home each", {}),
        ("the hottest on 2", {0: 2}),
        ("the 2 hottest on 2", {0: 2, 1: 2}),
        ("the hottest on 3, the next 2 on 2", {0: 3, 1: 2, 2: 2}),
        ("every tenant on 2", dict.fromkeys(range(TENANTS), 2)),
    ]
    for name, plan in plans:
        print(f"{name}: {full_share(plan) * 100:.2f} % of prompts found their homes full")


if __name__ == "__main__":
    main()
