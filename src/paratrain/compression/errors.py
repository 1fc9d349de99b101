"""The error every compression failure raises, and the dtypes compression accepts (a leaf
of the package: everything else imports it)."""

from __future__ import annotations

import torch


class CompressionError(ValueError):
    """A compression input, state or wire payload that cannot be processed.

    Raised for malformed, truncated or hostile wire payloads (never a crash, a hang or an
    unbounded allocation), for unsupported dtypes, and for state that does not match the
    tensors it is applied to.
    """


SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
)
