"""Hugging Face models fx cannot trace under ModelParallel: captured with torch.export
(non-strict), the decoder layers on two gloo workers, Direct and Pipeline (1F1B, uneven
micro-batches). Loss and every parameter gradient equal the unpartitioned model's (rtol
1e-5) and so do two SGD steps: the tied head/embedding is one tensor on the worker that
holds the embedding, read by the head's worker, its gradient summed back (docs/model-parallel.md), so its
update is the unpartitioned one. Batches are tuples (``model(x)``, the logits'
cross-entropy) or dicts (``model(**batch)`` with labels, the model's own ``.loss``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _workers_mp_hf import reference, run_cases  # noqa: E402
from paratrain.comm.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RTOL, ATOL = 1e-5, 1e-6
PROTOCOLS = [("Direct", None, None), ("1F1B", 3, "1F1B")]  # 7 rows: micro-batches 3, 3, 1
STAGE2 = {"llama": ["model.layers.1", "model.norm", "lm_head"],
          "gpt2": ["transformer.h.1", "transformer.ln_f", "lm_head"]}
TIED = {"llama": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight")}


def _case(model: str, feed: str) -> dict[str, Any]:
    return {"model": model, "feed": feed, "rows": 7, "protocols": PROTOCOLS,
            "partitions": [{"node_ids": STAGE2[model], "target": {"WorkerId": "worker-1"}}]}


# GPT-2 with tuple batches under the runner: tests/executors/model_parallel/test_mp_hf_job.py
CASES = [_case("llama", "first"), _case("gpt2", "dict")]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_distributed(run_cases, 2, CASES, timeout_s=240)


def _merged(results: list[list[dict[str, Any]]], ci: int, label: str, key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r[ci]["runs"][label][key].items():
            assert k not in out, f"{k} is held by two workers"
            out[k] = v
    return out


@pytest.mark.parametrize("ci", range(len(CASES)), ids=[f"{c['model']}-{c['feed']}" for c in CASES])
def test_hf_model_pipeline_equals_the_unpartitioned_model(results: list[list[dict[str, Any]]], ci: int) -> None:
    case = CASES[ci]
    ref = reference(case)
    embed, head = TIED[case["model"]]
    assert all(r[ci]["capture"] == "export" for r in results)
    # layer 0 on worker 0, layer 1 on worker 1; the tied weight crosses, held by worker 0
    layers = "model.layers" if case["model"] == "llama" else "transformer.h"
    assert any(m.startswith(f"{layers}.0.") for m in results[0][ci]["parts"][0])
    assert any(m.startswith(f"{layers}.1.") for m in results[1][ci]["parts"][0])
    assert not any(m.startswith(f"{layers}.1.") for m in results[0][ci]["parts"][0])
    assert any(v.replace("_", ".") == embed.replace("_", ".") for v in results[0][ci]["crossing"])
    assert head not in ref["grads"]  # named_parameters() names the tie once: the embedding
    for label, _, _ in PROTOCOLS:
        what = f"{case['model']}/{case['feed']}/{label}"
        losses = [r[ci]["runs"][label]["losses"] for r in results]
        assert losses[0] == [None, None], what  # the loss is the last stage's
        assert losses[1] == pytest.approx(ref["losses"], rel=RTOL), what
        grads = _merged(results, ci, label, "grads")
        assert sorted(grads) == sorted(ref["grads"]), what
        assert embed in results[0][ci]["runs"][label]["grads"], what  # held by worker 0 only
        for k, g in ref["grads"].items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=f"{what}: {k}")
        params = _merged(results, ci, label, "params")
        for k, p in ref["params"].items():  # two steps: the head read the updated embedding
            torch.testing.assert_close(params[k], p, rtol=RTOL, atol=ATOL, msg=f"{what}: {k}")


def test_exported_dropout_follows_the_parts_mode() -> None:
    """Export bakes training mode in; the parts drop out only in training mode, so the
    evaluation forward equals ``model.eval()``'s output."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from paratrain.comm.context import default_workers
    from paratrain.config.strategy import Partition
    from paratrain.executors.model_parallel.plan import build_plan
    from paratrain.executors.model_parallel.runtime import model_inputs, model_output

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=24, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                       resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
                                       bos_token_id=None, eos_token_id=None))
    x = torch.randint(0, 24, (3, 8))
    parts = [Partition.model_validate({"node_ids": STAGE2["gpt2"], "target": {"WorkerId": "worker-1"}})]
    c = build_plan(model, parts, default_workers(2), contiguous=True, example=((x[:2],), {})).cut

    def run(train: bool) -> torch.Tensor:
        env = model_inputs(c, (x,), {})
        for a in c.attrs:
            mod, _, name = a.target.rpartition(".")
            env[a.name] = getattr(model.get_submodule(mod), name)
        for p in c.parts:
            out = p.module.train(train)(*[env[v] for v in p.inputs])
            env.update(zip(p.outputs, out if len(p.outputs) > 1 else (out,), strict=True))
        return model_output(c, env).logits  # type: ignore[no-any-return]

    with torch.no_grad():
        want = model.eval()(x).logits
        torch.testing.assert_close(run(False), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(run(True), want, atol=1e-3)
