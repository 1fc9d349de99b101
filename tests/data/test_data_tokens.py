"""Issue 21 item 2: the built-in token-file dataset (``data.name = "tokens"``,
paratrain.data.tokens) trains a tiny GPT under ``language_model``.

* sequential and random sampling, with a held-out ``test_path`` and with the last
  ``test_fraction`` of the file, learn a patterned uint16 file well below the uniform loss;
  uint32 files read the same ids; the vocabulary is the largest id + 1 or ``vocab_size``;
* random sampling is a stream: a run cut at step 4 and resumed ends with the
  uninterrupted run's parameters;
* the file is memory-mapped, never pickled whole;
* bad input is a ConfigError naming the field: no path, a missing file, a byte size that
  is not a whole number of ids, an unknown dtype or sampling, block_size longer than the
  file, a vocab_size below the ids, an unknown key.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import paratrain
from paratrain.config import ConfigError
from paratrain.data.tokens import token_datasets

pytestmark = [pytest.mark.timeout(300)]
VOCAB = 40


def _write(path: Path, n: int, dtype: Any = np.uint16, seed: int = 0) -> Path:
    """A learnable file: 0, 1, ..., VOCAB - 1 repeated, 5 % of the ids replaced by 7."""
    ids = np.tile(np.arange(VOCAB, dtype=dtype), n // VOCAB + 1)[:n]
    ids[np.random.default_rng(seed).random(n) < 0.05] = 7
    ids.tofile(path)
    return path


def _job(tmp_path: Path, name: str, data: dict[str, Any], max_steps: int = 30,
         block: int = 16) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 1, "output_dir": str(tmp_path)},
            "task": {"name": "language_model", "block_size": block},
            "data": {"name": "tokens", **data},
            "model": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "dropout": 0.0},
            "train": {"epochs": 1, "max_steps": max_steps, "batch_size": 16,
                      "optimizer": {"name": "adamw", "lr": 3e-3}}}


@pytest.mark.parametrize("sampling", ["sequential", "random"])
@pytest.mark.parametrize("held_out", ["test_path", "test_fraction"])
def test_tokens_train_a_tiny_gpt(tmp_path: Path, sampling: str, held_out: str) -> None:
    data: dict[str, Any] = {"path": str(_write(tmp_path / "train.bin", 40_000)), "sampling": sampling}
    if held_out == "test_path":
        data["test_path"] = str(_write(tmp_path / "val.bin", 4_000, seed=1))
    else:
        data["test_fraction"] = 0.1
    summary = paratrain.fit(_job(tmp_path, "lm", data))
    assert summary["steps"] == 30
    assert summary["test_loss"] < 0.5 * math.log(VOCAB)  # uniform guessing: ln 40 = 3.69
    assert math.isfinite(summary["bigram_test_loss"])


def test_datasets_vocab_dtype_and_memory_map(tmp_path: Path) -> None:
    path = _write(tmp_path / "t32.bin", 10_000, dtype=np.uint32)
    train, test = token_datasets(seed=0, block_size=8, path=str(path), dtype="uint32",
                                 test_fraction=0.2)
    assert train.vocab_size == VOCAB and len(test) == (2_000 - 9) // 8 + 1
    assert isinstance(train.file.ids, np.memmap)
    x, y = train.get_batch(np.array([0, 3]))
    ids = np.fromfile(path, dtype=np.uint32)
    assert x.tolist() == [ids[0:8].tolist(), ids[24:32].tolist()] and (x[:, 1:] == y[:, :-1]).all()
    assert len(pickle.dumps(train)) < 4_096  # the file is reopened, not pickled
    train, _ = token_datasets(seed=0, block_size=8, path=str(path), dtype="uint32", vocab_size=50)
    assert train.vocab_size == 50


def test_random_sampling_resumes_exactly(tmp_path: Path) -> None:
    data = {"path": str(_write(tmp_path / "train.bin", 20_000)), "sampling": "random",
            "test_fraction": 0.1}
    full = paratrain.fit(_job(tmp_path, "full", data, max_steps=8))
    paratrain.fit(_job(tmp_path, "cut", data, max_steps=4))
    resumed = paratrain.fit(_job(tmp_path, "cut", data, max_steps=8), resume=True)
    assert resumed["steps"] == 8 and resumed["parameters_sha256"] == full["parameters_sha256"]


def _problem(tmp_path: Path, data: dict[str, Any], block: int = 16) -> list[str]:
    with pytest.raises(ConfigError) as e:
        paratrain.fit(_job(tmp_path, "bad", data, block=block))
    return [p[0] for p in e.value.problems]


def test_bad_token_input_names_the_field(tmp_path: Path) -> None:
    good = str(_write(tmp_path / "ok.bin", 1_000))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 100 + b"\x01")
    assert "data.path" in _problem(tmp_path, {})
    assert "data.path" in _problem(tmp_path, {"path": str(tmp_path / "missing.bin")})
    assert "data.path" in _problem(tmp_path, {"path": str(odd)})
    assert "data.dtype" in _problem(tmp_path, {"path": good, "dtype": "int8"})
    assert "data.dtype" in _problem(tmp_path, {"path": good, "dtype": "uint32"})  # uint16 ids
    assert "data.sampling" in _problem(tmp_path, {"path": good, "sampling": "shuffled"})
    assert "task.block_size" in _problem(tmp_path, {"path": good}, block=2_000)
    assert "data.test_fraction" in _problem(tmp_path, {"path": good, "test_fraction": 0.01})
    assert "data.test_path" in _problem(tmp_path, {"path": good, "test_path": str(odd)})
    assert "data.vocab_size" in _problem(tmp_path, {"path": good, "vocab_size": 10})
    assert "data.shuffle" in _problem(tmp_path, {"path": good, "shuffle": True})
