"""The peer of ``lifecycle_gpt.py``: one file, a bare PyTorch loop over the GPT demo
(``examples/gpt_shakespeare_local.toml``) shortened to STEPS steps.

``python benchmarks/_bare_gpt_peer.py OUT STEPS EVAL_EVERY THREADS [TEST_EVERY]``: the same corpus and
model code (paratrain's ``shakespeare`` blocks and zoo ``gpt``, so the data and the model are
the same objects, not a re-implementation), seeded the same way (``torch.manual_seed(0)``
before the model is built; each epoch's order ``randperm`` from a generator seeded
``seed * 1_000_003 + epoch``), AdamW (lr 3e-3, weight decay 0.01), 32 blocks of 64
characters per step, the test set scored every EVAL_EVERY steps and at the end (batches of
128, summed cross-entropy), the trained state_dict ``torch.save``d to OUT. Nothing else: no
checks, checkpoints, metrics file, bigram baseline, plot or digest. THREADS > 0 calls
``torch.set_num_threads(THREADS)`` (0 keeps torch's default); EVAL_EVERY -1 skips every
evaluation (a timing of the steps only). Prints one JSON line: the final test loss and the
seconds per step, ``step_s``: from the end of step 1 to the end of the last, over the steps
between (everything the loop does, as paratrain's ``step_time_s`` records; step 1's warm-up
left out on both sides).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

from paratrain.data.shakespeare import shakespeare
from paratrain.models.gpt import gpt

SEED, BATCH, BLOCK, LR, WD, EVAL_BATCH = 0, 32, 64, 3e-3, 0.01, 128


def evaluate(model: nn.Module, test: object) -> float:
    model.eval()
    total, count = 0.0, 0
    n = len(test)  # type: ignore[arg-type]
    with torch.no_grad():
        for a in range(0, n, EVAL_BATCH):
            x, y = test.get_batch(torch.arange(a, min(a + EVAL_BATCH, n)))  # type: ignore[attr-defined]
            out = model(x)
            total += float(nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                                       reduction="sum"))
            count += y.numel()
    model.train()
    return total / count


def main(out: str, steps: int, eval_every: int, threads: int, test_every: int = 8) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    train, test = shakespeare(block_size=BLOCK, test_every=test_every)
    torch.manual_seed(SEED)
    model = gpt((BLOCK,), train.vocab_size, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    n = len(train)
    step, epoch, ends = 0, 0, []
    while step < steps:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        for b in range(n // BATCH):
            x, y = train.get_batch(order[b * BATCH:(b + 1) * BATCH])
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            step += 1
            if eval_every > 0 and step % eval_every == 0 and step < steps:
                loss = evaluate(model, test)
            ends.append(time.perf_counter())
            if step == steps:
                break
        epoch += 1
    loss = evaluate(model, test) if eval_every >= 0 else None  # -1: only the step times
    torch.save(model.state_dict(), out)
    print(json.dumps({"test_loss": loss, "step_s": (ends[-1] - ends[0]) / max(len(ends) - 1, 1)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         *(int(a) for a in sys.argv[5:6]))  # TEST_EVERY: every n-th play is test (8: the demo's)
