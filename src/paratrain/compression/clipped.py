"""``{"method":"ClippedCompression","base_strategy":B,"clip_value":c}``.

C(x) = B(clamp(x, -c, c)): each value is clamped element-wise (by value, not by norm,
as in the Rust reference) before the base method runs. NaN passes through the clamp
unchanged. The record is the base method's; clipping never appears on the wire.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Codec, CompressedTensor, EncodeContext

__all__ = ["ClippedCodec"]


class ClippedCodec:
    """Clamp to [-clip_value, clip_value], then apply ``base``."""

    def __init__(self, base: Codec, clip_value: float) -> None:
        if not math.isfinite(clip_value) or clip_value <= 0:
            raise ValueError(f"clip_value must be finite and > 0, got {clip_value}")
        self.base = base
        self.clip_value = float(clip_value)

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        return self.base.encode(flat.clamp(-self.clip_value, self.clip_value), shape, ctx)

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state.get("base", {}))
