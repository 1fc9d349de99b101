"""Resume a multi-process job from the newest checkpoint step that every rank can read.

Each rank keeps its own ``ckpt-<step>.pt`` files (:mod:`.checkpoint`). A resume starts
from a step the ranks agree on (DataParallel's marker of the last complete step, or the
newest step all ranks have); when one rank's file for it is empty, truncated or garbage,
every rank must move back to the same older step, or the replicas would diverge.
:func:`agree_on_checkpoint` does that: each rank loads its newest own checkpoint at or
below the candidate step, the ranks take the minimum (and the maximum) of what they
found, and repeat from the minimum until every rank holds the same step. Rank 0 warns
naming the skipped files and the step used; when some rank has no readable checkpoint
at all, every rank raises the same ConfigError naming the files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..comm import collectives as C
from ..config import ConfigError
from .checkpoint import (
    CheckpointError,
    checkpoint_path,
    checkpoints,
    load_checkpoint,
    remove_stale_temps,
)

__all__ = ["agree_on_checkpoint"]


def _step_of(p: Path) -> int:
    return int(p.name[5:14])


def agree_on_checkpoint(
    directory: str | Path, start_step: int | None, group: Any = None, *, warn: bool | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """``(step, state)`` of the newest step ``<= start_step`` whose checkpoint in this
    rank's ``directory`` loads on every rank of ``group`` (None: one process), with this
    rank's state; None when ``start_step`` is None (nothing to resume; every rank must pass
    the same ``start_step``). Skipped files are named in a RuntimeWarning (on rank 0 unless
    ``warn`` says otherwise); when no step is readable everywhere, a ConfigError names them."""
    if start_step is None:
        return None
    directory = Path(directory)
    remove_stale_temps(directory)  # a save killed mid-write (this rank's own folder)
    own = sorted((_step_of(p) for p in checkpoints(directory)), reverse=True)
    bad: list[str] = []
    tried: set[int] = set()
    if start_step not in own:
        bad.append(f"checkpoint {checkpoint_path(directory, start_step)} is missing")
    candidate, mine = start_step, start_step + 1
    state: dict[str, Any] | None = None
    while True:
        if mine > candidate:  # (re)search this rank's newest readable step <= candidate
            mine, state = -1, None
            for s in own:
                if s > candidate or s in tried:
                    continue
                tried.add(s)
                path = checkpoint_path(directory, s)
                try:
                    state = load_checkpoint(path)
                except (CheckpointError, OSError) as e:
                    bad.append(str(e) if isinstance(e, CheckpointError)
                               else f"cannot read {path}: {e.strerror or e}")
                    continue
                mine = s
                break
            if mine < 0 and not any(s <= candidate for s in own):
                bad.append(f"no checkpoint at or below step {candidate} in {directory}")
        lo, neg_hi, neg_bad = C.all_min_ints([mine, -mine, -len(bad)], group=group)
        if lo < 0 or lo == -neg_hi:
            break
        candidate = lo  # some rank cannot go as far: everyone retries at or below its step
    notes = C.all_gather_text("; ".join(bad), group=group) if neg_bad < 0 else []
    skipped = "; ".join(f"rank {r}: {t}" if len(notes) > 1 else t for r, t in enumerate(notes) if t)
    if lo < 0:
        raise ConfigError([("checkpoint", (
            f"no readable checkpoint at or below step {start_step} on every rank: {skipped}; "
            "start without --resume (or with --overwrite)"))])
    assert state is not None and mine == lo
    if skipped and (C.rank_of(group) == 0 if warn is None else warn):
        warnings.warn(f"skipping checkpoint(s): {skipped}; falling back to step {lo}",
                      RuntimeWarning, stacklevel=2)
    return lo, state
