"""Batches through torch's ``DataLoader``, the one loop's order as its sampler: keys
``(epoch, b, idx)`` of batches ``start, start + 1, ...`` (:class:`_Keys`), so a resumed
loader starts at the saved position; ``num_workers = 0`` is bit-identical to no loader. A
loader process reseeds its generators before every batch from ``(run.seed, epoch, batch,
replica)`` (:func:`batch_seed`): augmentations do not depend on the worker count. Workers
are forked, ignore SIGINT, die with their parent and end at :meth:`Feed.close`.

Streams (an ``IterableDataset``) go through torchdata's ``StatefulDataLoader``
(:class:`StreamFeed`), its state checkpointed and fast-forwarded on resume. Rank ``r`` of
``R`` takes items ``j mod R = r`` (as ``DistributedSampler``); loader worker ``w`` of ``W``
builds its batches ``k mod W = w``, so the order is the same for every ``num_workers``; a
stream with ``item(j)`` is read at its own items only. A partial last batch is dropped; a
finite stream ends the run when any rank runs out.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

Fetch = Callable[..., Any]


@dataclass(frozen=True)
class LoaderOptions:
    """``[data]``'s loader settings and the run's seed."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    seed: int = 0

    @classmethod
    def of(cls, spec: Any, seed: int) -> LoaderOptions:
        """From a job's ``[data]`` (:class:`paratrain.config.sections.DataSpec`)."""
        return cls(int(getattr(spec, "num_workers", 0)), bool(getattr(spec, "pin_memory", False)),
                   getattr(spec, "prefetch_factor", None), int(seed))

    def loader_kwargs(self, device: torch.device | None) -> dict[str, Any]:
        """DataLoader keywords: workers, prefetching, pinning (CUDA only) and the seeding."""
        kw: dict[str, Any] = {"num_workers": self.num_workers,
                              "pin_memory": self.pin_memory and device is not None and device.type == "cuda",
                              # the loader draws its workers' base seed from this generator:
                              # never from the global one, whose stream the model's dropout uses
                              "generator": torch.Generator().manual_seed(self.seed)}
        if self.num_workers > 0:
            kw.update(worker_init_fn=seed_worker, prefetch_factor=self.prefetch_factor or 2)
            if "fork" in multiprocessing.get_all_start_methods():
                # fork, not the process's default: a rank started by the forkserver would
                # start a server of its own for its loader (seconds of imports per rank)
                kw["multiprocessing_context"] = "fork"
        return kw


IN_PROCESS = LoaderOptions()  # no loader workers, seed 0


def is_stream(dataset: Any) -> bool:
    """An ``IterableDataset`` (no ``__len__``/``__getitem__``: read in its own order)."""
    return isinstance(dataset, IterableDataset)


def dataset_rows(dataset: Any) -> int:
    """``len(dataset)``; 0 for a stream (its plan counts steps, not rows)."""
    return 0 if is_stream(dataset) else len(dataset)


def batch_seed(seed: int, epoch: int, batch: int, rank: int = 0) -> int:
    """The seed of batch ``batch`` of epoch ``epoch`` of data shard ``rank`` (63 bits)."""
    s = ((int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(batch)) * 65_537 + int(rank)
    return s % (2**63 - 1)


def seed_everything(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors/ints only (weights_only-safe), so a
    resumed run draws the same numbers."""
    py = random.getstate()
    np_state: Any = np.random.get_state()
    return {
        "python_version": int(py[0]),
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"]), None))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), 0, 0.0))
    torch.set_rng_state(state["torch"])


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` of every loader process: ``random`` and ``numpy`` seeded from the
    worker's torch seed (from the run's), SIGINT ignored, death with the parent (``prctl``)."""
    del worker_id
    s = torch.initial_seed()
    random.seed(s)
    np.random.seed(s % 2**32)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception as e:  # noqa: BLE001 - best effort: the loader's watchdog remains
            logging.getLogger(__name__).debug("no PR_SET_PDEATHSIG for a loader worker: %r", e)


def shutdown_workers(loader: DataLoader[Any] | None) -> None:
    """End ``loader``'s worker processes now (else kept until garbage collection)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    if loader is not None:
        loader._iterator = None


def _identity(batch: Any) -> Any:
    return batch


class _Keys(Sampler[tuple[int, int, np.ndarray]]):
    """Keys ``(epoch, b, indices)`` of batches ``start .. stop - 1`` of one epoch's order."""

    def __init__(self) -> None:
        self.epoch, self.start, self.stop, self.batch_size = 0, 0, 0, 1
        self.order: np.ndarray = np.zeros(0, dtype=np.int64)

    def set(self, order: torch.Tensor, *, epoch: int, start: int, batch_size: int) -> None:
        self.order = np.asarray(order, dtype=np.int64)
        self.epoch, self.start, self.batch_size = epoch, start, batch_size
        self.stop = -(-len(self.order) // batch_size)

    def __iter__(self) -> Iterator[tuple[int, int, np.ndarray]]:
        # this epoch's values, fixed: the next epoch's set() must not reach a live iterator
        order, epoch, bs = self.order, self.epoch, self.batch_size
        for b in range(self.start, self.stop):
            yield epoch, b, order[b * bs:(b + 1) * bs]

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)


class _Gather(Dataset[Any]):
    """Key -> batch (in a loader process, after reseeding with :func:`batch_seed`)."""

    def __init__(self, dataset: Any, fetch: Fetch, collate: Callable[[list[Any]], Any] | None,
                 seed: int, rank: int) -> None:
        self.dataset, self.fetch, self.collate = dataset, fetch, collate
        self.seed, self.rank = seed, rank

    def __getitem__(self, key: tuple[int, int, np.ndarray]) -> Any:
        epoch, b, idx = key
        if get_worker_info() is not None:
            seed_everything(batch_seed(self.seed, epoch, b, self.rank))
        return self.fetch(self.dataset, torch.from_numpy(np.asarray(idx)), None,
                          collate=self.collate)


class Feed:
    """What the loop reads batches from (one per process and run)."""

    def batches(self, epoch: int, start: int) -> Iterator[Any]:
        """Batches ``start, start + 1, ...`` of ``epoch``, on the device."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The loader's own position for the checkpoint ({}: the loop's ``(epoch, batch)``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def close(self) -> None:
        """End the loader's worker processes."""


class MapFeed(Feed):
    """A map-style dataset through one ``DataLoader`` over :class:`_Keys` (module docstring)."""

    def __init__(self, dataset: Any, *, order: Callable[[int], torch.Tensor], batch_size: int,
                 fetch: Fetch, to_device: Callable[[Any], Any],
                 collate: Callable[[list[Any]], Any] | None = None,
                 options: LoaderOptions = IN_PROCESS, device: torch.device | None = None,
                 rank: int = 0) -> None:
        self.order, self.batch_size, self.to_device = order, batch_size, to_device
        self.keys = _Keys()
        kw = options.loader_kwargs(device)
        self.loader: DataLoader[Any] = DataLoader(
            _Gather(dataset, fetch, collate, options.seed, rank), batch_size=None, sampler=self.keys,
            collate_fn=_identity, persistent_workers=options.num_workers > 0, **kw)

    def batches(self, epoch: int, start: int) -> Iterator[Any]:
        self.keys.set(self.order(epoch), epoch=epoch, start=start, batch_size=self.batch_size)
        for batch in self.loader:
            yield self.to_device(batch)

    def close(self) -> None:
        shutdown_workers(self.loader)


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
    batch = (collate or torch.utils.data.default_collate)(items)
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
        if self.loader is not None:
            self.loaded = self.state_dict()  # what a save after the loop's end writes
            shutdown_workers(self.loader)
            self.loader = None
