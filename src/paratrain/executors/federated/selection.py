"""Client selection per round (DESIGN §4), sorted: ``All``, ``Random{fraction}`` (``k``
distinct clients from a generator of ``(seed, round)`` alone: every process and a resumed
run draw the same set) or ``ByCapability{required_tags}`` (the clients whose own and hosting
worker's tags include every required tag).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def num_random(fraction: float, num_clients: int) -> int:
    """``max(1, ceil(fraction * num_clients))``, at most ``num_clients``."""
    # round() guards against 0.1*30 = 3.0000000000000004 -> 4.
    k = math.ceil(round(fraction * num_clients, 9))
    return min(num_clients, max(1, k))


def select_clients(spec: Any, *, num_clients: int, round_idx: int, seed: int,
                   client_tags: Mapping[int, Sequence[str]] | None = None) -> list[int]:
    """The sorted client indices taking part in round ``round_idx``."""
    method = getattr(spec, "method", None)
    if method == "All":
        return list(range(num_clients))
    if method == "Random":
        k = num_random(float(spec.fraction), num_clients)
        g = torch.Generator()  # a function of (seed, round) alone
        g.manual_seed((int(seed) * 1_000_003 + int(round_idx) * 7_919 + 0x5EED_F3D) % (2**63 - 1))
        perm = torch.randperm(num_clients, generator=g)
        return sorted(int(i) for i in perm[:k])
    if method == "ByCapability":
        required = set(spec.required_tags)
        tags = client_tags or {}
        chosen = [c for c in range(num_clients) if required <= set(tags.get(c, ()))]
        if not chosen:
            raise ValueError("client_selection.required_tags: no client carries all of the tags "
                             f"{sorted(required)} (set [federated.client_tags] or [[workers]] tags)")
        return chosen
    raise ValueError(f"unknown client_selection method {method!r}; valid: All, Random, ByCapability")
