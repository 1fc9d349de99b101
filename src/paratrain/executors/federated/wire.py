"""The wire form of one client's update, and its strict decoding on the server.

An update ``D = w_client - w_global`` travels as headers ``{"name", "shape", "enc": "f32" |
"ct", "nbytes"}`` (in the JSON status) plus one payload: ``f32`` raw little-endian float32,
``ct`` a :class:`paratrain.compression.base.CompressedTensor` record. The server checks every
header against the global model (the same keys and shapes, byte counts adding up to the
payload) before any arithmetic, and rejects a bad update with :class:`MalformedUpdateError`
naming the client and the tensor; nothing is unpickled. The global model goes down as two
flat vectors (:func:`broadcast_state`): the floating tensors as float32, the others as int64.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...comm.collectives import broadcast_
from .aggregation import FlatUpdate, MalformedUpdateError


def dense_headers(state: Mapping[str, Tensor]) -> list[dict[str, Any]]:
    """The headers :func:`encode_update` gives ``state`` uncompressed (every tensor ``f32``)."""
    return [{"name": name, "shape": list(t.shape), "enc": "f32", "nbytes": 4 * t.numel()}
            for name, t in state.items()]


def flat_float32(tensors: Sequence[Tensor]) -> Tensor:
    """``tensors`` as float32, flattened and concatenated in order (a 0-size vector for none)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def broadcast_state(state: dict[str, Tensor], template: dict[str, Tensor], *,
                    device: torch.device, group: Any, counter: Any = None) -> dict[str, Tensor]:
    """Rank 0's ``state`` on every rank (the others pass ``template``), cut like ``template``,
    moved through ``device`` (NCCL moves only device tensors)."""
    fvec = flat_float32([t for t in state.values() if t.is_floating_point()]).to(device)
    it = [t.reshape(-1).to(torch.int64) for t in state.values() if not t.is_floating_point()]
    ivec = (torch.cat(it) if it else torch.zeros(0, dtype=torch.int64)).to(device)
    broadcast_(fvec, src=0, group=group, counter=counter)
    if ivec.numel():
        broadcast_(ivec, src=0, group=group, counter=counter)
    f, i = fvec.cpu(), ivec.cpu()
    out: dict[str, Tensor] = {}
    pf = pi = 0
    for k, t in template.items():
        n = t.numel()
        if t.is_floating_point():
            out[k] = f[pf : pf + n].reshape(t.shape).to(t.dtype).clone()
            pf += n
        else:
            out[k] = i[pi : pi + n].reshape(t.shape).to(t.dtype).clone()
            pi += n
    return out


def dense_payload(flat: Tensor) -> bytes:
    """A float32 vector as the little-endian bytes :func:`encode_update` sends for ``f32``
    tensors (their payloads concatenated, for :func:`flat_float32` of them)."""
    arr = flat.detach().to(torch.float32).contiguous().cpu().numpy()
    return arr.tobytes() if sys.byteorder == "little" else arr.astype("<f4").tobytes()


def split_payload(statuses: Sequence[Mapping[str, Any]], payload: bytes | memoryview) -> list[memoryview]:
    """The concatenated payloads of ``statuses`` cut at each one's ``nbytes``."""
    view, out, pos = memoryview(payload), [], 0
    for st in statuses:
        nb = int(st.get("nbytes", 0))
        out.append(view[pos : pos + nb])
        pos += nb
    return out


def encode_update(delta: Mapping[str, Tensor], *, compress: Any = None) -> tuple[list[dict[str, Any]], bytes]:
    """Headers and payload for ``delta``: floating tensors through ``compress(name, tensor) ->
    bytes`` (a compressed wire record) when given, every other tensor as float32."""
    headers: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, t in delta.items():
        if compress is not None and t.is_floating_point() and t.numel() > 0:
            data = compress(name, t.detach())
            enc = "ct"
        else:
            data = t.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4").tobytes()
            enc = "f32"
        headers.append({"name": name, "shape": list(t.shape), "enc": enc, "nbytes": len(data)})
        chunks.append(data)
    return headers, b"".join(chunks)


def decode_update(client: str, headers: Sequence[Mapping[str, Any]], payload: bytes | memoryview,
                  reference: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """Parse and validate one client's update against the global model ``reference``."""
    return UpdateDecoder(reference)(client, headers, payload)


class UpdateDecoder:
    """:func:`decode_update` for a round's many updates against one ``reference``: the dense
    headers and the layout are made once. An update whose headers are exactly the dense ones
    (the same JSON types too) skips the per-header checks, which they pass by construction,
    and decodes to a :class:`FlatUpdate` over one float32 copy of its payload."""

    def __init__(self, reference: Mapping[str, Tensor]) -> None:
        self.reference = reference
        self.dense = dense_headers(reference)
        self.nbytes = sum(int(h["nbytes"]) for h in self.dense)
        self.layout: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        at = 0
        for name, ref in reference.items():
            self.layout[name] = (at, at + ref.numel(), tuple(ref.shape))
            at += ref.numel()

    def _is_dense(self, headers: Any) -> bool:
        # == alone would take 1.0 or True for 1: the checks' types are compared as well
        return (isinstance(headers, list) and headers == self.dense and all(
            type(h["nbytes"]) is int and all(type(d) is int for d in h["shape"]) for h in headers))

    def __call__(self, client: str, headers: Sequence[Mapping[str, Any]],
                 payload: bytes | memoryview) -> Mapping[str, Tensor]:
        dense = len(payload) == self.nbytes and self._is_dense(headers)
        if not dense:
            _check_headers(client, headers, payload, self.reference)
            dense = [h["name"] for h in headers] == list(self.reference) and all(h["enc"] == "f32" for h in headers)
        if dense:
            # the common update at once: its tensors are views of one float32 copy of the payload
            arr = np.frombuffer(payload, dtype="<f4").astype(np.float32)
            if bool(np.isfinite(arr).all()):  # (numpy's test: several times torch's on CPU)
                return FlatUpdate(torch.from_numpy(arr), self.layout)
        return _decode_each(client, headers, payload, self.reference)


def _decode_each(client: str, headers: Sequence[Mapping[str, Any]], payload: bytes | memoryview,
                 reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A checked update tensor by tensor (compressed records; naming a non-finite tensor)."""
    view = memoryview(payload)
    out: dict[str, Tensor] = {}
    pos = 0
    for h in headers:
        name, nbytes = str(h["name"]), int(h["nbytes"])
        chunk = view[pos : pos + nbytes]
        pos += nbytes
        shape = tuple(reference[name].shape)
        if h["enc"] == "f32":
            arr = np.frombuffer(chunk, dtype="<f4").astype(np.float32)
            t = torch.from_numpy(arr).reshape(shape)
        else:
            t = _decode_compressed(client, name, bytes(chunk), shape)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MalformedUpdateError(client, name, "contains NaN or infinity")
        out[name] = t
    return {name: out[name] for name in reference}


def _check_headers(client: str, headers: Any, payload: bytes | memoryview,
                   reference: Mapping[str, Tensor]) -> None:
    """Every header names one tensor of ``reference`` once, with its shape, a known encoding
    and a byte count (exact for ``f32``) that add up to the payload; else the error."""
    if not isinstance(headers, Sequence):
        raise MalformedUpdateError(client, "<headers>", "headers must be a list")
    seen: dict[str, Mapping[str, Any]] = {}
    for h in headers:
        name = h.get("name") if isinstance(h, Mapping) else None
        if not isinstance(name, str):
            raise MalformedUpdateError(client, "<headers>", f"header without a name: {h!r}")
        if name in seen:
            raise MalformedUpdateError(client, name, "sent twice")
        if name not in reference:
            raise MalformedUpdateError(client, name, "unexpected key (not in the global model)")
        seen[name] = h
    for name in reference:
        if name not in seen:
            raise MalformedUpdateError(client, name, "missing from the update")
    total = 0
    for name, h in seen.items():
        shape = h.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise MalformedUpdateError(client, name, f"bad shape {shape!r}")
        expected = tuple(reference[name].shape)
        if tuple(shape) != expected:
            raise MalformedUpdateError(client, name, f"shape {tuple(shape)} != expected {expected}")
        nbytes = h.get("nbytes")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise MalformedUpdateError(client, name, f"bad byte count {nbytes!r}")
        enc = h.get("enc")
        if enc == "f32":
            if nbytes != 4 * math.prod(shape):
                raise MalformedUpdateError(client, name, f"{nbytes} bytes for a float32 tensor of shape {tuple(shape)}")
        elif enc != "ct":
            raise MalformedUpdateError(client, name, f"unknown encoding {enc!r}")
        total += nbytes
    if total != len(payload):
        raise MalformedUpdateError(client, "<payload>", f"headers announce {total} bytes but {len(payload)} arrived")


def _decode_compressed(client: str, name: str, data: bytes, shape: tuple[int, ...]) -> Tensor:
    from ...compression.base import CompressedTensor, CompressionError

    try:
        ct = CompressedTensor.from_bytes(data, max_numel=math.prod(shape), expect_shape=shape)
        t = ct.decompress()
    except CompressionError as e:
        raise MalformedUpdateError(client, name, f"bad compressed payload: {e}") from None
    if tuple(t.shape) != shape:
        raise MalformedUpdateError(client, name, f"decoded shape {tuple(t.shape)} != {shape}")
    return t.to(torch.float32)


def frame(doc: Mapping[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One message: an 8-byte little-endian length, the JSON ``doc``, then ``payload``."""
    head = json.dumps(doc).encode()
    return len(head).to_bytes(8, "little") + head + bytes(payload)


def unframe(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """:func:`frame`'s ``(doc, payload)``; a ValueError when the length does not fit."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or n > len(data) - 8:
        raise ValueError(f"message of {len(data)} bytes announces a {n}-byte header")
    return json.loads(data[8 : 8 + n]), memoryview(data)[8 + n :]
