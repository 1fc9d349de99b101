"""A plain ``nn.Module`` (not an ``nn.Sequential``) with skip connections, for ModelParallel.

``ResidualMLP``: ``h = stem(x)``, then ``h = h + block_i(h)`` for each block (the residual
add is in this forward, not in any block), then ``head(norm(h))``. Its node ids are what
``named_modules()`` lists: ``stem``, ``blocks.0`` .. ``blocks.{depth-1}`` (each with
``blocks.i.fc1`` / ``blocks.i.act`` / ``blocks.i.fc2``), ``norm``, ``head``. Cutting between
blocks sends the residual stream to the next worker; cutting inside a block
(``blocks.1.fc2`` elsewhere than ``blocks.1.fc1``) sends the skip across as well.

``model.factory = "residual_model:build"`` with this file in ``run.imports``
(``examples/model_parallel_residual.toml``).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, expand: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, expand * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expand * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        for b in self.blocks:  # residual branches start small (as GPT-2 scales them)
            nn.init.normal_(b.fc2.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 64, depth: int = 4) -> nn.Module:
    return ResidualMLP(math.prod(input_shape), num_classes, width=width, depth=depth)


class Staged(nn.Module):
    """``front`` (a stem and ``front_blocks`` residual blocks) then ``back`` (``back_blocks``
    blocks, the norm and the head): two modules, so each can be one pipeline stage and the
    heavier one (``back``) a replicated stage (``[subgraphs.back]``)."""

    def __init__(self, in_features: int, num_classes: int, width: int = 64,
                 front_blocks: int = 1, back_blocks: int = 2) -> None:
        super().__init__()
        self.front = ResidualMLP(in_features, width, width=width, depth=front_blocks)
        self.back = ResidualMLP(width, num_classes, width=width, depth=back_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(x))


def build_staged(input_shape: tuple[int, ...], num_classes: int, width: int = 64,
                 front_blocks: int = 1, back_blocks: int = 2) -> nn.Module:
    return Staged(math.prod(input_shape), num_classes, width=width, front_blocks=front_blocks,
                  back_blocks=back_blocks)
