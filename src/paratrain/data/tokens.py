"""``tokens``: a flat binary file of token ids (nanoGPT's ``train.bin``), memory-mapped and
never read whole (keys in docs/data.md). ``sequential`` sampling: the blocks at ``i *
stride`` (map-style); ``random``: an endless stream whose item ``j`` starts at a SplitMix64
hash of ``(run.seed, j)``, so each rank reads only its items and a resume reads the same.
The test set: the non-overlapping blocks of ``test_path`` or of the held-out tail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ..config import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_KEYS = {"path", "dtype", "sampling", "test_path", "vocab_size"}
_CHUNK = 1 << 24  # ids per chunk when scanning for the largest id (32-64 MB of page cache)
_BIGRAM_VOCAB = 2048  # the bigram reference needs a V x V table: only for small vocabularies
_MAX_GUESS = 1 << 20  # a larger inferred vocabulary is a wrong dtype (the largest are ~256 k)


class TokenFile:
    """A read-only memory map of ``path`` as ``dtype`` ids, range ``[lo, hi)`` of it."""

    def __init__(self, path: str, dtype: str, *, lo: int = 0, hi: int | None = None,
                 field: str = "data.path") -> None:
        if dtype not in DTYPES:
            raise ConfigError([("data.dtype", f"must be one of {', '.join(DTYPES)} (got {dtype!r})")])
        if not os.path.isfile(path):
            raise ConfigError([(field, f"no such file: {path!r}")])
        size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
        if size % item:
            raise ConfigError([(field, f"{path!r} has {size} bytes, not a whole number of "
                                       f"{dtype} ids ({item} bytes each): is data.dtype right?")])
        if size == 0:
            raise ConfigError([(field, f"{path!r} is empty")])
        self.path, self.dtype, self.field = path, dtype, field
        self.lo, self.hi = lo, size // item if hi is None else hi
        self._ids: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        """The ids of the range (a view of the map; opened on first use in each process)."""
        if self._ids is None:
            self._ids = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")[self.lo:self.hi]
        return self._ids

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ids": None}  # reopen, never pickle the file's contents

    def max_id(self) -> int:
        ids = self.ids
        return max(int(ids[a:a + _CHUNK].max()) for a in range(0, len(ids), _CHUNK))

    def windows(self, starts: np.ndarray, length: int) -> torch.Tensor:
        """``[len(starts), length]`` int64 ids from each start (reads those pages only)."""
        return torch.from_numpy(self.ids[starts[:, None] + np.arange(length)].astype(np.int64))


def _fits(file: TokenFile, block_size: int, field: str, what: str) -> None:
    if len(file) < block_size + 1:
        raise ConfigError([(field, f"task.block_size {block_size} needs {block_size + 1} tokens but "
                                   f"{what} of {file.path!r} has {len(file)}")])


def _ids_tensor(file: TokenFile, vocab_size: int) -> torch.Tensor | None:
    """All ids of ``file``'s range as a tensor view of the map (None: too large a vocabulary)."""
    if vocab_size > _BIGRAM_VOCAB:
        return None
    # copy-on-write: writable for torch.from_numpy, never written, so no private pages
    return torch.from_numpy(np.memmap(file.path, dtype=DTYPES[file.dtype], mode="c")[file.lo:file.hi])


class TokenBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The blocks at ``s = i * stride`` of a :class:`TokenFile` (map-style)."""

    def __init__(self, file: TokenFile, *, block_size: int, stride: int, vocab_size: int,
                 field: str = "task.block_size", what: str = "the training range") -> None:
        _fits(file, block_size, field, what)
        self.file, self.block_size, self.stride, self.vocab_size = file, block_size, stride, vocab_size
        self._n = (len(file) - 1 - block_size) // stride + 1

    def __len__(self) -> int:
        return self._n

    @property
    def ids(self) -> torch.Tensor | None:
        return _ids_tensor(self.file, self.vocab_size)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        win = self.file.windows(np.asarray(idx, dtype=np.int64) * self.stride, self.block_size + 1)
        return win[:, :-1], win[:, 1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([int(i)]))
        return x[0], y[0]


def _splitmix64(z: int) -> int:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014): a 64-bit hash of ``z``."""
    m = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


class RandomBlocks(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Endless blocks; item ``j`` starts at ``splitmix64(seed * 2**32 + j) mod (n - block_size)``."""

    def __init__(self, file: TokenFile, *, block_size: int, vocab_size: int, seed: int) -> None:
        _fits(file, block_size, "task.block_size", "the training range")
        self.file, self.block_size, self.vocab_size, self.seed = file, block_size, vocab_size, seed
        self.span = len(file) - block_size

    @property
    def ids(self) -> torch.Tensor | None:
        return _ids_tensor(self.file, self.vocab_size)

    def item(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item ``j`` of the stream (random access: a reader skips others' items for free)."""
        s = _splitmix64((self.seed << 32) + j) % self.span
        win = self.file.windows(np.asarray([s], dtype=np.int64), self.block_size + 1)[0]
        return win[:-1], win[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        j = 0
        while True:
            yield self.item(j)
            j += 1


def token_datasets(*, seed: int, block_size: int, stride: int | None = None,
                   test_fraction: float = 0.25, **keys: Any) -> tuple[Any, Any]:
    """``(train, test)`` of a token file (module docstring); ConfigErrors name the field."""
    unknown = sorted(set(keys) - _KEYS)
    if unknown:
        raise ConfigError([(f"data.{unknown[0]}", f"not a key of data.name = 'tokens' (valid: "
                                                  f"{', '.join(sorted(_KEYS))}, test_fraction)")])
    if not isinstance(keys.get("path"), str):
        raise ConfigError([("data.path", "the token file (a string) is required for "
                                         "data.name = 'tokens'")])
    dtype = keys.get("dtype", "uint16")
    sampling = keys.get("sampling", "sequential")
    if sampling not in ("sequential", "random"):
        raise ConfigError([("data.sampling", f"must be 'sequential' or 'random' (got {sampling!r})")])
    whole = TokenFile(keys["path"], dtype)
    if keys.get("test_path") is not None:
        if not isinstance(keys["test_path"], str):
            raise ConfigError([("data.test_path", "must be a file path (a string)")])
        train, test = whole, TokenFile(keys["test_path"], dtype, field="data.test_path")
    else:
        cut = len(whole) - int(len(whole) * test_fraction)
        train = TokenFile(whole.path, dtype, hi=cut)
        test = TokenFile(whole.path, dtype, lo=cut, field="data.test_fraction")
    seen = max(train.max_id(), test.max_id()) + 1 if len(test) else train.max_id() + 1
    if "vocab_size" not in keys and seen > _MAX_GUESS:  # e.g. a uint16 file read as uint32
        raise ConfigError([("data.dtype", f"the files hold ids up to {seen - 1}: is data.dtype "
                                          f"{dtype!r} right? (set data.vocab_size if it is)")])
    vocab = keys.get("vocab_size", seen)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < seen:
        raise ConfigError([("data.vocab_size", f"must be an integer >= {seen} (the files hold ids "
                                               f"up to {seen - 1}; got {vocab!r})")])
    train_set: Any = (
        RandomBlocks(train, block_size=block_size, vocab_size=vocab, seed=seed)
        if sampling == "random" else
        TokenBlocks(train, block_size=block_size, stride=stride or block_size, vocab_size=vocab))
    held = "data.test_path" if keys.get("test_path") is not None else "data.test_fraction"
    test_set = TokenBlocks(test, block_size=block_size, stride=block_size, vocab_size=vocab,
                           field=held, what="the test file" if held == "data.test_path" else
                           f"the held-out last {test_fraction:g}")
    return train_set, test_set
