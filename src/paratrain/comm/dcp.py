"""torch.distributed.checkpoint (DCP) for pieces of tensors: each process writes what it holds
and reads back only the slices it holds now. A piece (a tensor-parallel shard, a ZeRO row range,
a third of a fused ``in_proj_weight``) is the chunk ``Box(shape, offsets)`` of its tensor, so
another layout reads the tensor cut differently (a region no key covers is an error naming it);
replicas of a chunk are written once (lowest rank). Why not DTensor state dicts: a placement
cannot say "rows 96-191 of a flattened ZeRO unit" or "the second third of a fused
``in_proj_weight``"; described by DCP's own chunk metadata, our folders still load in torch's
DCP by the model's names (tests/training/test_dcp_checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException  # what a failed DCP read raises
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .dcp_pieces import METADATA, Box, MissingRegion, Piece, Target

__all__ = ["CheckpointException", "Box", "Piece", "Target", "TensorStorageMetadata", "read_items", "save", "load", "read_metadata", "MissingRegion", "METADATA"]

def _chunk(t: torch.Tensor, box: Box | None) -> tuple[ChunkStorageMetadata, torch.Size]:
    offsets = torch.Size(box.offsets if box is not None else [0] * t.dim())
    whole = torch.Size(box.shape if box is not None else t.shape)
    return ChunkStorageMetadata(offsets=offsets, sizes=t.size()), whole


class _SavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: Sequence[Piece], blobs: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         dedup_save_to_lowest_rank=True)
        self.pieces, self.blobs = pieces, blobs
        self.by_index: dict[MetadataIndex, torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, t, box in self.pieces:
            if t.numel() == 0:
                continue  # an empty piece (an uneven split's last shard) holds nothing
            chunk, whole = _chunk(t, box)
            index = MetadataIndex(fqn, chunk.offsets)
            self.by_index[index] = t
            items.append(WriteItem(
                index=index, type=WriteItemType.SHARD if box is not None else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                                            size=whole)))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.blobs[index.fqn] if index.fqn in self.blobs else self.by_index[index]


def _common(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> int:
    return math.prod(max(0, min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d])
                         - max(a.offsets[d], b.offsets[d])) for d in range(len(a.offsets)))


def read_items(label: str, target: Target, md: Metadata) -> list[ReadItem]:
    """DCP read items filling ``target`` (named ``label``) from the chunks of its sources
    that overlap it: only this process's slice is read."""
    want, whole = _chunk(target.tensor, target.box)
    if target.tensor.numel() == 0:
        return []
    chosen: list[tuple[str, TensorStorageMetadata, ChunkStorageMetadata]] = []
    for fqn in target.sources:
        md_ = md.state_dict_metadata.get(fqn)
        if not isinstance(md_, TensorStorageMetadata):
            continue
        if md_.size != whole:
            raise MissingRegion(f"{fqn} is {tuple(md_.size)} in the checkpoint; this process's "
                                f"tensor is a piece of one of {tuple(whole)}")
        for ch in md_.chunks:
            if _common(ch, want) and not any(_common(ch, c) for _, _, c in chosen):
                chosen.append((fqn, md_, ch))
    covered = sum(_common(ch, want) for _, _, ch in chosen)
    if covered != math.prod(want.sizes):
        raise MissingRegion(f"the checkpoint holds {covered} of the {math.prod(want.sizes)} "
                            f"elements of {label} this process needs (keys {', '.join(target.sources)})")
    out: list[ReadItem] = []
    for fqn, md_, ch in chosen:
        one = TensorStorageMetadata(properties=md_.properties, size=md_.size, chunks=[ch])
        for r in create_read_items_for_chunk_list(fqn, one, [want]):
            out.append(dataclasses.replace(r, dest_index=MetadataIndex(label, want.offsets)))
    return out


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, targets: Mapping[str, Target], blobs: Sequence[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets, self.blob_keys = targets, list(blobs)
        self.blobs: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for label, t in self.targets.items():
            items += read_items(label, t, self.metadata)
        for key in self.blob_keys:
            if key in self.metadata.state_dict_metadata:
                items.append(_create_read_item_for_byteio(  # type: ignore[no-untyped-call]
                    MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=True)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn].tensor


def save(folder: str | Path, pieces: Sequence[Piece], *, blobs: Mapping[str, Any], group: Any,
         world: int) -> None:
    """Write every process's ``pieces`` (``(key, tensor, box)``, box None: the whole tensor;
    one key may have several, e.g. q, k and v of a fused tensor) and ``blobs`` into DCP
    folder ``folder`` (collective over ``group``; ``world == 1``: this process alone)."""
    state: dict[str, Any] = {f"{k}@{i}": t.detach() for i, (k, t, _) in enumerate(pieces)}
    state.update(blobs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp_save(state, storage_writer=FileSystemWriter(str(folder), sync_files=True),
                 planner=_SavePlanner([(k, t.detach(), b) for k, t, b in pieces], blobs),
                 process_group=group if world > 1 else None, no_dist=world == 1)


def load(folder: str | Path, targets: Mapping[str, Target], *, blobs: Sequence[str] = (),
         group: Any, world: int) -> dict[str, Any]:
    """Fill every target from DCP folder ``folder`` (collective) and return the ``blobs``
    found there (``torch.load(weights_only=True)``). Another process's failure to read
    raises here too (DCP gathers the errors), so every process leaves together."""
    planner = _LoadPlanner(targets, blobs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp_load({k: t.tensor for k, t in targets.items()},
                 storage_reader=FileSystemReader(str(folder)), planner=planner,
                 process_group=group if world > 1 else None, no_dist=world == 1)
    return planner.blobs


def read_metadata(folder: str | Path) -> Metadata:
    """The checkpoint's keys, whole sizes and chunks (this process reads ``.metadata``)."""
    return FileSystemReader(str(folder)).read_metadata()
