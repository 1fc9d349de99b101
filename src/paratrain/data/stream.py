"""Streams: an ``IterableDataset`` sharded over ranks and loader workers, with a resumable
position (torchdata's ``StatefulDataLoader``). Rank ``r`` of ``R`` takes items ``j mod R =
r`` (as ``DistributedSampler``); loader worker ``w`` of ``W`` builds its batches ``k mod W =
w``, so the order is the same for every ``num_workers``; a stream with ``item(j)`` is read
at its own items only. A partial last batch is dropped; a finite stream ends the run when
any rank runs out. The loader's state is checkpointed and fast-forwarded on resume.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from .loader import IN_PROCESS, Feed, LoaderOptions, _identity

STREAM_STRATEGIES = ("Local", "DataParallel")  # the one loop's, sharded by data replica


def check_stream_job(job: Any) -> None:
    """A ConfigError unless ``job`` sets ``train.max_steps`` and a :data:`STREAM_STRATEGIES`."""
    from ..config import ConfigError

    problems = []
    if job.train.max_steps is None:
        problems.append(("train.max_steps", "the training data is a stream (an IterableDataset, "
                         "no len()): a run over it counts steps, not epochs; set train.max_steps"))
    kind = getattr(job.strategy, "type", None)
    if kind not in STREAM_STRATEGIES:
        problems.append(("strategy.type", f"{kind} cannot train over a stream (an IterableDataset); "
                         f"streams train under {', '.join(STREAM_STRATEGIES)} (with or without "
                         "[tensor_parallel]): give a map-style dataset (__len__, __getitem__)"))
    if problems:
        raise ConfigError(problems)


def _collated(items: list[Any], collate: Callable[[list[Any]], Any] | None) -> Any:
    batch = (collate or default_collate)(items)
    return tuple(batch) if type(batch) is list else batch  # as fetch_batch: a tuple on top


def head(dataset: Any, k: int) -> list[Any]:
    """The first ``k`` items of a stream (fewer if it is shorter)."""
    out: list[Any] = []
    for item in dataset:
        out.append(item)
        if len(out) >= k:
            break
    return out


def stream_batch(dataset: Any, k: int, collate: Callable[[list[Any]], Any] | None = None) -> Any:
    """The first ``k`` items of a stream as one batch."""
    return _collated(head(dataset, k), collate)


def stream_batches(dataset: Any, batch_size: int,
                   collate: Callable[[list[Any]], Any] | None = None) -> Iterator[Any]:
    """A finite stream in batches of ``batch_size`` (the last one partial): a test set's."""
    items: list[Any] = []
    for item in dataset:
        items.append(item)
        if len(items) == batch_size:
            yield _collated(items, collate)
            items = []
    if items:
        yield _collated(items, collate)


class ShardedStream(IterableDataset[Any]):
    """Rank ``rank`` of ``world``'s batches from batch ``start`` on, this loader worker's share."""

    def __init__(self, dataset: Any, *, batch_size: int, rank: int = 0, world: int = 1,
                 start: int = 0, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.rank, self.world, self.start = int(rank), int(world), int(start)
        self.collate = collate

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        bs, world, rank = self.batch_size, self.world, self.rank
        seek = getattr(self.dataset, "item", None)
        if callable(seek):  # random access: read only this worker's items
            k = self.start + w
            while True:
                try:
                    batch = [seek((k * bs + i) * world + rank) for i in range(bs)]
                except IndexError:  # a finite seekable stream ends
                    return
                yield _collated(batch, self.collate)
                k += nw
        items: list[Any] = []
        for j, item in enumerate(self.dataset):
            if j % world != rank:
                continue
            q = j // world  # the rank's item number
            k = q // bs  # its batch
            if k < self.start or (k - self.start) % nw != w:
                continue
            items.append(item)
            if len(items) == bs:
                yield _collated(items, self.collate)
                items = []


class StreamFeed(Feed):
    """A stream through one ``StatefulDataLoader`` over :class:`ShardedStream`."""

    def __init__(self, dataset: Any, *, batch_size: int, rank: int, world: int,
                 to_device: Callable[[Any], Any], collate: Callable[[list[Any]], Any] | None = None,
                 options: LoaderOptions = IN_PROCESS, device: Any = None) -> None:
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.to_device, self.collate, self.options, self.device = to_device, collate, options, device
        self.loaded: dict[str, Any] | None = None
        self.loader: Any = None
        self.start = 0  # the batch the current loader's stream starts at

    def _make(self, start: int) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        ds = ShardedStream(self.dataset, batch_size=self.batch_size, rank=self.rank,
                           world=self.world, start=start, collate=self.collate)
        with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(ds, batch_size=None, collate_fn=_identity,
                                      **self.options.loader_kwargs(self.device))

    def batches(self, epoch: int, start: int) -> Iterator[Any]:
        del epoch  # a stream has one
        self.close()
        saved = self.loaded
        same = saved is not None and saved.get("num_workers") == self.options.num_workers
        self.start = int(saved["start"]) if same and saved is not None else start
        self.loader = self._make(self.start)
        if same and saved is not None:
            self.loader.load_state_dict(saved["loader"])
        for batch in self.loader:
            yield self.to_device(batch)

    def state_dict(self) -> dict[str, Any]:
        if self.loader is None:  # not started (the resumed state) or closed (its last state)
            return dict(self.loaded or {})
        return {"num_workers": self.options.num_workers, "start": self.start,
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state) if state else None

    def close(self) -> None:
        from .loader import shutdown_workers

        if self.loader is not None:
            self.loaded = self.state_dict()  # what a save after the loop's end writes
            shutdown_workers(self.loader)
            self.loader = None
