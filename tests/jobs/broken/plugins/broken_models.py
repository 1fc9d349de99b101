"""A model factory for the broken jobs: imported by run.imports as ``broken_models``."""

from torch import nn


def build(*, input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, width), nn.ReLU(), nn.Linear(width, num_classes))
