"""Worker functions for the 2-rank compression tests (run by paratrain.comm.testing)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.comm.ddp_hook import allreduce_compressed, ddp_hook
from paratrain.compression import Compressor

HIDDEN = 64


def make_mlp(seed: int, hidden: int = HIDDEN) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits train/test tensors (the lead's loader when present, sklearn otherwise)."""
    try:
        from paratrain.config.job import DataSpec
        from paratrain.data import load_data

        b = load_data(DataSpec(), seed=0)
        xtr, ytr = b.train.tensors
        xte, yte = b.test.tensors
        return xtr, ytr, xte, yte
    except ImportError:  # pragma: no cover - foundation not present
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        xtr, xte, ytr, yte = train_test_split(
            d.data / 16.0, d.target, test_size=0.25, random_state=0, stratify=d.target
        )
        f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        g = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
        return f(xtr), g(ytr), f(xte), g(yte)


def topk_share_k(model: nn.Module, share: float) -> int:
    """Smallest per-tensor k whose kept entries sum to >= ``share`` of all entries."""
    sizes = [p.numel() for p in model.parameters()]
    target = share * sum(sizes)
    k = 1
    while sum(min(k, n) for n in sizes) < target:
        k += 1
    return k


def _np(ts: list[torch.Tensor]) -> list[Any]:
    # Tensors sent back through the result queue would travel as shared-memory handles
    # that die with the worker; numpy arrays are pickled by value.
    return [t.detach().cpu().numpy().copy() for t in ts]


def _grads_with(
    ctx: Any, strategy: dict[str, Any] | None, x: torch.Tensor, y: torch.Tensor,
    **ddp_kwargs: Any,
) -> list[Any]:
    model = DDP(make_mlp(1), **ddp_kwargs)
    if strategy is not None:
        state, hook = ddp_hook(strategy, model=model, seed=3)
        model.register_comm_hook(state, hook)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return _np([p.grad for p in model.parameters() if p.grad is not None])


def grads_parity(ctx: Any, strategies: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Gradients after one DDP backward, per strategy (None = DDP without a hook), plus
    this rank's local (un-synchronised) gradients for a reference mean."""
    xtr, ytr, _, _ = digits()
    lo = ctx.rank * 40
    x, y = xtr[lo : lo + 40], ytr[lo : lo + 40]
    out: dict[str, Any] = {"strategies": [_grads_with(ctx, s, x, y) for s in strategies]}
    # Gradients as views of the bucket buffer, and tiny buckets (one parameter each).
    out["bucket_view"] = _grads_with(
        ctx, strategies[-1], x, y, gradient_as_bucket_view=True, bucket_cap_mb=0.001
    )
    local = make_mlp(1)
    nn.functional.cross_entropy(local(x), y).backward()
    out["local"] = _np([p.grad for p in local.parameters() if p.grad is not None])
    # allreduce_compressed on its own (what DataParallel executors call).
    comp = Compressor({"method": "TopK", "k": 3}, seed=0)
    named = [(f"t{i}", torch.arange(8.0) * (ctx.rank + 1) * (1 if i else -1)) for i in range(2)]
    out["allreduce_topk"] = _np(allreduce_compressed(comp, named))
    return out


def _train(
    ctx: Any, strategy: dict[str, Any] | None, epochs: int, batch: int, lr: float,
    momentum: float, info: dict[str, Any],
) -> float:
    xtr, ytr, xte, yte = digits()
    model = DDP(make_mlp(7))
    state = None
    if strategy is not None:
        state, hook = ddp_hook(strategy, model=model, seed=5)
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    n = xtr.shape[0]
    g = torch.Generator().manual_seed(11)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        shard = perm[ctx.rank :: ctx.world_size]
        for s in range(0, shard.numel() - batch + 1, batch):
            idx = shard[s : s + batch]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            info["steps"] = info.get("steps", 0) + 1
    if state is not None:
        sd = state.state_dict()["compressor"]
        info["compressor_step"] = sd["step"]
        info["residual_keys"] = sorted(sd["codec"].get("residuals", {}))
        info["ratio"] = state.compressor.stats.ratio
    with torch.no_grad():
        acc = (model.module(xte).argmax(1) == yte).float().mean().item()
    return float(acc)


def train_accuracies(
    ctx: Any, strategies: dict[str, dict[str, Any] | None], epochs: int, batch: int, lr: float,
    momentum: float = 0.0,
) -> dict[str, Any]:
    """Test accuracy of the digits MLP trained with DDP under each hook strategy, plus
    the hook's state after training (``<name>_info``)."""
    out: dict[str, Any] = {}
    for name, s in strategies.items():
        info: dict[str, Any] = {}
        out[name] = _train(ctx, s, epochs, batch, lr, momentum, info)
        out[f"{name}_info"] = info
    return out
