"""``{"method":"ErrorFeedback","base_strategy":B,"error_compensation":bool}``.

Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al.,
"Error feedback fixes SignSGD", ICML 2019; Stich et al., NeurIPS 2018) keeps a residual
e per key and compresses the compensated input:

    p_t = g_t + e_{t-1};   c_t = B(p_t);   e_t = p_t - D(c_t)

so nothing is lost, only delayed: sum_{t<=T} D(c_t) + e_T = sum_{t<=T} g_t (telescoping,
e_0 = 0). With ``error_compensation=false`` the residual is still tracked
(e_t = g_t - D(B(g_t)), readable through :meth:`ErrorFeedbackCodec.residual`) but not
added back, so the output equals B's. (The Rust reference never reads the flag and
updates e from g instead of p; this module implements the textbook algebra.)

Residuals live on the input's device, in float32 for float16/bfloat16 inputs (so small
corrections are not rounded away) and at the input dtype otherwise. The compensated p
is cast back to the input dtype before B runs, and the cast's rounding stays in e.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Codec, CompressedTensor, CompressionError, EncodeContext

__all__ = ["ErrorFeedbackCodec"]


_SPARSE = ("TopK", "RandomK", "Threshold")


def _residual_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ErrorFeedbackCodec:
    """Residual-compensated wrapper around ``base``; state = one residual per key."""

    def __init__(self, base: Codec, error_compensation: bool = True) -> None:
        self.base = base
        self.error_compensation = error_compensation
        self.residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: str) -> torch.Tensor | None:
        """The flat residual for ``key`` (``None`` before its first compression).

        This is the live buffer, updated in place by the next compression of ``key``;
        clone it to keep a snapshot.
        """
        return self.residuals.get(key)

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        from .decode import decompress

        rdt = _residual_dtype(flat.dtype)
        e = self.residuals.get(ctx.key)
        if e is not None and (e.numel() != flat.numel() or e.dtype != rdt):
            raise CompressionError(
                f"error-feedback residual for key {ctx.key!r} has {e.numel()} elements of "
                f"{e.dtype}; the tensor has {flat.numel()} of {flat.dtype} (a key must always "
                "name the same tensor)"
            )
        if self.error_compensation and e is not None:
            # Accumulate in the residual's own buffer (no fresh allocation): it becomes p,
            # and below e_t = p - D(c). Leaves copy what they keep, never alias p.
            p = e if e.device == flat.device else e.to(flat.device)
            p.add_(flat)
        else:
            p = flat.to(rdt, copy=True)
        c = self.base.encode(p if p.dtype == flat.dtype else p.to(flat.dtype), shape, ctx)
        if c.indices is not None and c.method in _SPARSE:
            # D(c) is zero except at the (distinct) kept indices: e = p - D(c) in O(k).
            p.index_add_(0, c.indices.to(p.device), c.values.to(rdt), alpha=-1)
        else:
            dense = decompress(c)
            # Keep the decoded tensor so Compressor.roundtrip need not decode twice.
            c._cache["dense"] = dense
            p.sub_(dense.reshape(-1).to(rdt))
        self.residuals[ctx.key] = p
        return c

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
            "base": self.base.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residuals = state.get("residuals", {})
        if not isinstance(residuals, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in residuals.items()
        ):
            raise CompressionError("ErrorFeedback state: 'residuals' must map str -> Tensor")
        self.residuals = {k: v.detach().clone().reshape(-1) for k, v in residuals.items()}
        self.base.load_state_dict(state.get("base", {}))
