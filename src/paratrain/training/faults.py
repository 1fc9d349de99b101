"""Fault injection for tests, demos and robustness studies, from the environment (never the
job file): ``PARATRAIN_FAULT_KILL=RANK:STEP`` (SIGKILL after a step, first attempt only;
``RANK:STEP,RANK:STEP`` kills several processes, each at its step),
``PARATRAIN_FAULT_KILL_IN_SAVE=NAME`` (SIGKILL before a checkpoint's rename),
``PARATRAIN_FAULT_HOLD_RESTART=NAME`` (a restarted process waits for the file NAME in its run
folder: a fault-tolerant replica group's restart held until a peer's record exists),
``PARATRAIN_FLOWER_SECAGG_DROP_AT=STAGE`` (a Flower ClientApp dies at that SecAgg+ stage)
and ``PARATRAIN_FAULTS``, a JSON object with ``fail_clients``, ``byzantine_clients`` /
``byzantine_scale``, ``corrupt_clients`` and ``fail_members`` (:func:`inject_faults`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError

FAULT_ENV = "PARATRAIN_FAULT_KILL"
FAULTS_ENV = "PARATRAIN_FAULTS"
KILL_IN_SAVE_ENV = "PARATRAIN_FAULT_KILL_IN_SAVE"
DROP_AT_ENV = "PARATRAIN_FLOWER_SECAGG_DROP_AT"
HOLD_RESTART_ENV = "PARATRAIN_FAULT_HOLD_RESTART"

_INDEX_FIELDS = ("fail_clients", "byzantine_clients", "corrupt_clients", "fail_members")


@dataclass(frozen=True)
class Faults:
    fail_clients: frozenset[int] = field(default_factory=frozenset)
    byzantine_clients: frozenset[int] = field(default_factory=frozenset)
    byzantine_scale: float = -10.0
    corrupt_clients: frozenset[int] = field(default_factory=frozenset)
    fail_members: frozenset[int] = field(default_factory=frozenset)


def _bad(key: str, msg: str) -> ConfigError:
    return ConfigError([(f"{FAULTS_ENV}.{key}" if key else FAULTS_ENV, msg)])


def parse_faults(text: str) -> Faults:
    """Parse the JSON text of ``PARATRAIN_FAULTS``; a bad value names the key."""
    if not text.strip():
        return Faults()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad("", f"not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _bad("", f"must be a JSON object (got {type(doc).__name__})")
    unknown = sorted(set(doc) - {*_INDEX_FIELDS, "byzantine_scale"})
    if unknown:
        raise _bad(unknown[0], f"unknown key; valid: {', '.join((*_INDEX_FIELDS, 'byzantine_scale'))}")
    kw: dict[str, Any] = {}
    for key in _INDEX_FIELDS:
        values = doc.get(key, [])
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
        ):
            raise _bad(key, f"must be a list of non-negative integers (got {values!r})")
        kw[key] = frozenset(values)
    scale = doc.get("byzantine_scale", -10.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise _bad("byzantine_scale", f"must be a number (got {scale!r})")
    return Faults(byzantine_scale=float(scale), **kw)


def injected_faults() -> Faults:
    """The faults this process was asked to inject (none unless ``PARATRAIN_FAULTS`` is set)."""
    return parse_faults(os.environ.get(FAULTS_ENV, ""))


@contextmanager
def inject_faults(**faults: Any) -> Iterator[None]:
    """Inject ``faults`` (the keys above) into runs started inside the block (test-only)."""
    parse_faults(json.dumps(faults))  # fail early on a typo
    old = os.environ.get(FAULTS_ENV)
    os.environ[FAULTS_ENV] = json.dumps(faults)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FAULTS_ENV, None)
        else:
            os.environ[FAULTS_ENV] = old


def kill_points(spec: str) -> set[tuple[int, int]]:
    """The ``(rank, step)`` pairs of a ``PARATRAIN_FAULT_KILL`` value (``RANK:STEP``, comma-separated)."""
    pairs = (item.strip().partition(":") for item in spec.split(","))
    return {(int(rank), int(step)) for rank, _, step in pairs}


def maybe_kill(*, rank: int, step: int, restart_count: int, before: Any = None) -> None:
    """SIGKILL this process after ``step`` when ``PARATRAIN_FAULT_KILL`` names it; ``before()``
    runs first (the lifecycle lands its saves in flight: a crash *after* the step)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or restart_count > 0:
        return
    if (rank, step) in kill_points(spec):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_hold_restart(folder: Path, *, restart_count: int, timeout_s: float = 120.0) -> None:
    """A restarted process (``restart_count > 0``) waits until the file ``PARATRAIN_FAULT_HOLD_RESTART``
    names exists in ``folder`` (TimeoutError after ``timeout_s``); a first attempt never waits."""
    name = os.environ.get(HOLD_RESTART_ENV, "")
    if not name or restart_count == 0:
        return
    deadline = time.monotonic() + timeout_s
    while not (folder / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{HOLD_RESTART_ENV}: no {folder / name} after {timeout_s:g} s")
        time.sleep(0.05)


def maybe_kill_in_save(path: str | os.PathLike[str]) -> None:
    """SIGKILL this process when saving the checkpoint ``PARATRAIN_FAULT_KILL_IN_SAVE`` names."""
    name = os.environ.get(KILL_IN_SAVE_ENV, "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if name and os.path.basename(path) == name and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_drop_at(stage: str) -> None:
    """SIGKILL this process when ``PARATRAIN_FLOWER_SECAGG_DROP_AT`` names SecAgg+ ``stage``."""
    if stage and stage == os.environ.get(DROP_AT_ENV, ""):
        os.kill(os.getpid(), signal.SIGKILL)
