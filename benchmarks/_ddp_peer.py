"""The peer of ``lifecycle_dp.py``: a plain DistributedDataParallel script, launched by
``torchrun --nproc-per-node=2 --standalone benchmarks/_ddp_peer.py OUT STEPS``.

It trains what the benchmark's paratrain job trains, the way a user would write it by
hand with torch alone: scikit-learn's digits (pixels / 16, the stratified 75/25 split with
``random_state=0``), the MLP 64 -> 128 -> 64 -> 10 built after ``torch.manual_seed(0)``,
SGD (lr 0.1, momentum 0.9), 16 rows per replica per step from the same seeded per-epoch
permutation split every ``world``-th row (as torch's DistributedSampler), gloo, then one
evaluation on the test set and ``torch.save`` of the trained state_dict by rank 0 (to
``OUT``), which the benchmark compares with paratrain's ``model.safetensors``.
torchrun sets ``OMP_NUM_THREADS=1`` for its workers (its documented default with more
than one process per node); nothing else is tuned.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SEED, BATCH, LR, MOMENTUM = 0, 16, 0.1, 0.9


def main(out: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        (d.data / 16.0).astype("float32"), d.target, test_size=0.25, random_state=SEED, stratify=d.target)
    x_tr, y_tr = torch.from_numpy(x_tr), torch.from_numpy(y_tr).long()
    x_te, y_te = torch.from_numpy(x_te), torch.from_numpy(y_te).long()
    torch.manual_seed(SEED)
    model = nn.Sequential(OrderedDict(
        flatten=nn.Flatten(), fc0=nn.Linear(64, 128), act0=nn.ReLU(), fc1=nn.Linear(128, 64),
        act1=nn.ReLU(), head=nn.Linear(64, 10)))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    n = len(y_tr)
    per = n // world
    step, epoch = 0, 0
    while step < steps:
        g = torch.Generator().manual_seed(SEED * 1_000_003 + epoch)
        shard = torch.randperm(n, generator=g)[: per * world][rank::world]
        for i in range(0, per - BATCH + 1, BATCH):
            idx = shard[i:i + BATCH]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    if rank == 0:
        model.eval()
        with torch.no_grad():
            logits = model(x_te)
        print(json.dumps({"test_loss": float(nn.functional.cross_entropy(logits, y_te)),
                          "test_accuracy": float((logits.argmax(1) == y_te).float().mean())}))
        torch.save(model.state_dict(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
