"""Fault injection for tests, demos and robustness studies — outside the job schema.

A job file says what to train; it never carries faults. Faults come from the environment,
which worker processes inherit:

* ``PARATRAIN_FAULT_KILL=RANK:STEP`` makes that rank SIGKILL itself right after optimizer
  step STEP on the first attempt only (``restart_count == 0``), so the elastic agent's
  restart and the resume-from-checkpoint path are exercised by a real process death.
* ``PARATRAIN_FAULT_KILL_IN_SAVE=NAME`` makes the process writing checkpoint NAME
  (e.g. ``step-000000010``) SIGKILL itself after the temp folder is written, before it is
  renamed into place (first attempt only): a crash in the middle of a save -- the
  asynchronous save's thread kills its process while training goes on.
* ``PARATRAIN_FLOWER_SECAGG_DROP_AT=STAGE`` makes a Flower node's ClientApp SIGKILL itself when
  a SecAgg+ message of that stage arrives (``unmask``: a dropout after masking).
* ``PARATRAIN_FAULTS`` holds a JSON object with any of

  - ``fail_clients``: federated client indices whose local training raises;
  - ``byzantine_clients`` / ``byzantine_scale``: clients whose update is multiplied by the
    scale (robust-aggregation studies; -10 = "sign-flipped x10");
  - ``corrupt_clients``: clients that send an update with a wrong shape (the server must
    reject it);
  - ``fail_members``: PopulationBased member indices whose training raises halfway.

:func:`inject_faults` sets ``PARATRAIN_FAULTS`` for the duration of a ``with`` block (the
test-only hook); :func:`injected_faults` reads it, naming the variable on any bad value.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError

__all__ = ["FAULT_ENV", "FAULTS_ENV", "KILL_IN_SAVE_ENV", "DROP_AT_ENV", "Faults", "injected_faults",
           "inject_faults", "maybe_kill", "maybe_kill_in_save", "maybe_drop_at"]

FAULT_ENV = "PARATRAIN_FAULT_KILL"
FAULTS_ENV = "PARATRAIN_FAULTS"
KILL_IN_SAVE_ENV = "PARATRAIN_FAULT_KILL_IN_SAVE"
DROP_AT_ENV = "PARATRAIN_FLOWER_SECAGG_DROP_AT"

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
    """Test-only hook: inject ``faults`` (the keys above) into runs started inside the block,
    including their worker processes (they inherit the environment)."""
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


def maybe_kill(*, rank: int, step: int, restart_count: int, before: Any = None) -> None:
    """SIGKILL this process after ``step`` when ``PARATRAIN_FAULT_KILL`` names it;
    ``before()`` runs first (the lifecycle waits for its checkpoint writes in flight, so
    the fault is a crash *after* the step, with the saves before it landed: a crash during
    an asynchronous save is ``PARATRAIN_FAULT_KILL_IN_SAVE``'s)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or restart_count > 0:
        return
    rank_s, _, step_s = spec.partition(":")
    if int(rank_s) == rank and int(step_s) == step:
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill_in_save(path: str | os.PathLike[str]) -> None:
    """SIGKILL this process when it is saving the checkpoint file named by
    ``PARATRAIN_FAULT_KILL_IN_SAVE`` (not after an elastic restart)."""
    name = os.environ.get(KILL_IN_SAVE_ENV, "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if name and os.path.basename(path) == name and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_drop_at(stage: str) -> None:
    """SIGKILL this process when ``PARATRAIN_FLOWER_SECAGG_DROP_AT`` names SecAgg+ ``stage``."""
    if stage and stage == os.environ.get(DROP_AT_ENV, ""):
        os.kill(os.getpid(), signal.SIGKILL)
