"""A store's step folder read by one process outside any run (export, inspection, tests):
no collective, no group.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..files import step_folders
from . import dcp_state as S

__all__ = ["LAYOUT_FILE", "read_layout", "read_named_model", "read_rank_state", "latest_folder"]

LAYOUT_FILE = "layout.json"


def read_layout(folder: Path) -> dict[str, Any] | None:
    """``layout.json`` of a step folder (None: unreadable)."""
    try:
        doc = json.loads((folder / LAYOUT_FILE).read_text())
    except (OSError, ValueError) as e:  # a step folder that is not one (yet): skipped
        logging.getLogger(__name__).debug("%s: no readable %s: %r", folder, LAYOUT_FILE, e)
        return None
    return doc if isinstance(doc, dict) else None


def read_named_model(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model of checkpoint ``folder`` by the model's names (every tensor: for export)."""
    from ..comm import dcp  # torch.distributed.checkpoint: only when a folder is read

    folder = Path(folder)
    md = dcp.read_metadata(folder)
    doc = json.loads((folder / LAYOUT_FILE).read_text())
    old_world = int(doc.get("world", 1))
    names: dict[str, Any] = {}
    for f, m in md.state_dict_metadata.items():
        g = S.unranked(f)
        if g.startswith("model/") and isinstance(m, dcp.TensorStorageMetadata):
            names.setdefault(g.removeprefix("model/"), m)
    metas = dcp.load(folder, {}, blobs=[S.meta_key(0)], group=None, world=1)
    order = [d[1] for d in metas[S.meta_key(0)]["model"]]
    targets: dict[str, dcp.Target] = {}
    for n, m in names.items():
        srcs = tuple(x for x in S.sources("model", n, old_world) if x in md.state_dict_metadata)
        targets[n] = dcp.Target(torch.empty(tuple(m.size), dtype=m.properties.dtype), None, srcs)
    dcp.load(folder, targets, group=None, world=1)
    ranked = [n for n in order if n in targets] + sorted(n for n in targets if n not in order)
    return {n: targets[n].tensor for n in ranked}


def read_rank_state(folder: str | Path, rank: int = 0) -> dict[str, Any]:
    """Process ``rank``'s loop state as saved into checkpoint ``folder`` (inspection, tests)."""
    from ..comm import dcp

    blobs = dcp.load(folder, {}, blobs=[S.meta_key(rank), S.engine_key(rank)], group=None, world=1)
    if S.meta_key(rank) not in blobs:
        raise ConfigError([("checkpoint", f"{folder} holds no process {rank}")])
    meta = blobs[S.meta_key(rank)]
    targets, build = S.rebuild(meta)
    dcp.load(folder, targets, group=None, world=1)
    return {**build(), "engine": blobs.get(S.engine_key(rank), {}),
            "shards": [None if d[5] is None else {"shape": d[5][0], "offsets": d[5][1]}
                       for d in meta["model"]]}


def latest_folder(checkpoints: str | Path) -> Path | None:
    """The newest complete step folder in ``checkpoints`` (None: there is none)."""
    found = step_folders(checkpoints)
    return found[-1] if found else None
