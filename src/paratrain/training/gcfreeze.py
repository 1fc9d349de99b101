"""Keep the cyclic garbage collector's full passes off a training step's critical path.

After ``import torch`` a process holds a few hundred thousand objects that live until exit;
a generation-2 collection walks them all (90-100 ms on this project's 2-core CI machine,
about 30 pipeline-stage forwards), making one rank a straggler every other rank waits for.
``gc.freeze()`` moves everything alive now into a permanent generation that collections
skip; nothing leaks (reference counting still frees everything acyclic).

The ``paratrain`` command's own process (:func:`own_process`, issue 34) also pauses the
collector from the start until the run trains (start-up made five or six full passes over
a growing heap: 0.56 s of CPU for the GPT demo) and freezes everything before exit (the
last collection cost 0.8-1 s). An object built only to be checked (preflight's model) is
watched (:func:`watch_garbage`) so a cycle holding it is collected before the freeze.
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
