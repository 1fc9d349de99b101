"""Built-in datasets by name, ``factory="module:function"`` for users' own."""

from .datasets import DATASETS, DataBundle, load_data

__all__ = ["DATASETS", "DataBundle", "load_data"]
