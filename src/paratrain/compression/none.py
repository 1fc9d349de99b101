"""``{"method":"None"}``: the identity, C(x) = x. The wire carries all n values at the
input dtype (the information minimum of an uncompressed tensor)."""

from __future__ import annotations

from typing import Any

import torch

from .base import CompressedTensor, EncodeContext

__all__ = ["NoneCodec"]


class NoneCodec:
    """The identity codec; useful as a baseline and as the leaf of wrapper stacks."""

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        return CompressedTensor("None", shape, flat.dtype, flat.clone())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
