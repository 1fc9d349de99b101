"""Client-side compressed updates: a :class:`paratrain.compression.Compressor` per client.

Each client's delta tensors are compressed with the job's ``[compression]`` strategy
at ``step = round``, keys = tensor names, seed derived from (job seed, client) — so
RandomK positions and stochastic rounding are reproducible per client and round. The
codec state (ErrorFeedback residuals ``e ← Δ + e − D(C(Δ + e))``) lives with the
client's hosting worker (``ClientHost.codec_state``), is committed only when the
client's whole update was encoded, and is saved in that worker's round checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ...compression import Compressor

__all__ = ["ClientCompressor", "has_tensors"]


def has_tensors(state: Any) -> bool:
    """True when a (nested) state dict holds at least one tensor."""
    if isinstance(state, Tensor):
        return True
    if isinstance(state, Mapping):
        return any(has_tensors(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(has_tensors(v) for v in state)
    return False


def _client_seed(seed: int, client: int) -> int:
    h = hashlib.blake2b(f"fedcomp|{seed}|{client}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


class ClientCompressor:
    """``__call__(name, tensor) -> bytes`` for one client's update; ``commit()`` keeps state."""

    def __init__(self, strategy: Any, codec_state: dict[int, Any], *, seed: int, client: int,
                 round_idx: int) -> None:
        self.codec_state = codec_state  # the hosting worker's, by client (saved with it)
        self.client = client
        self.round_idx = round_idx
        self.comp = Compressor(strategy, seed=_client_seed(seed, client))
        state = codec_state.get(client)
        if state:
            self.comp.codec.load_state_dict(state)

    def __call__(self, name: str, tensor: Tensor) -> bytes:
        return self.comp.compress(name, tensor, step=self.round_idx).to_bytes()

    def commit(self) -> None:
        state = self.comp.codec.state_dict()
        if has_tensors(state):
            self.codec_state[self.client] = state
        else:
            self.codec_state.pop(self.client, None)
