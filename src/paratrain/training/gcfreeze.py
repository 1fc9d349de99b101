"""Keep the cyclic garbage collector's full passes off a training step's critical path.

After ``import torch`` a process holds a few hundred thousand Python objects (modules,
functions, type objects) that live until exit. A generation-2 collection walks all of
them: measured at 90-100 ms on this project's 2-core CI machine, about 30 forward passes
of a pipeline stage. In a multi-process job that pause makes one rank a straggler and
every other rank waits for it (a pipeline bubble, a late all-reduce). ``gc.freeze()``
moves every object alive now into a permanent generation that collections skip, so a
later full pass only walks what the training loop itself allocates. Nothing is leaked:
frozen objects are the ones that were going to live for the whole run anyway, and
reference counting still frees everything acyclic as usual.

The ``paratrain`` command's own process (one job, then exit) goes further
(:func:`own_process`, issue 34): its start-up -- the config, torch, the checks, the
model, the optimizer's import of ``torch._dynamo`` -- made five or six full passes over
an ever larger heap (0.56 s of CPU for the GPT demo, about a tenth of a 30-step run), and
the interpreter's last collection at exit walked everything once more (0.8-1 s of CPU with
the finalizers it triggers). There the collector is paused from the start until the run
trains (:func:`resume_collections`: what start-up built is frozen, the collector runs
again), and everything is frozen before the interpreter exits (:func:`freeze_for_exit`).
What start-up leaves as cyclic garbage (import-time frames and tracebacks, about 1 MB for
the GPT demo) is then kept until exit; an object preflight built only to check it (its
model) is watched (:func:`watch_garbage`), and a cycle that still holds one is collected
before the freeze, so a large model is never kept twice.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

__all__ = ["freeze_startup_objects", "own_process", "watch_garbage", "resume_collections",
           "freeze_for_exit"]

_state = {"owned": False, "paused": False}
_watched: list[weakref.ref[Any]] = []


def freeze_startup_objects() -> int:
    """Collect once, then freeze everything alive; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def own_process(*, pause: bool) -> None:
    """This process runs one job and exits (the ``paratrain`` command, not
    ``paratrain.fit`` in a user's process): ``pause`` stops cyclic collection until
    :func:`resume_collections` (the run's start-up); :func:`freeze_for_exit` then applies."""
    _state["owned"] = True
    if pause and gc.isenabled():
        gc.disable()
        _state["paused"] = True


def watch_garbage(obj: Any) -> None:
    """``obj`` is garbage once its builder returns (preflight's model): while collection
    is paused, :func:`resume_collections` collects first if a reference cycle still holds it."""
    if _state["paused"]:
        try:
            _watched.append(weakref.ref(obj))
        except TypeError:  # not weakly referenceable: nothing to watch
            pass


def resume_collections() -> None:
    """End of the start-up pause (no-op without one): freeze what start-up built (after a
    full collection only when a watched object is still alive), then collect again."""
    if not _state["paused"]:
        return
    _state["paused"] = False
    if any(ref() is not None for ref in _watched):
        gc.collect()
    _watched.clear()
    gc.freeze()
    gc.enable()


def freeze_for_exit() -> None:
    """In a process :func:`own_process` claimed: freeze everything before the interpreter
    exits, so its last collection does not walk the whole heap (everything is freed with
    the process). Elsewhere a no-op."""
    if _state["owned"]:
        gc.freeze()
