"""Issue 12 defect 3: ``parallelize`` converts only what it can prove equivalent.

User attention modules that merely look like attention (q/k/v/o Linears and
``num_heads``) are no longer swapped for paratrain's attention (which silently lost a
causal flag under another name and any extra parameter): they are a ConfigError naming
the module, unless they opt in through ``__paratrain_tp_attention__``. Encoder layers
and Linear subclasses with their own behaviour are not replaced either.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.comm.tp.groups import TPGroups
from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.tensor_parallel import (
    AttentionSpec,
    ColumnParallelLinear,
    ParallelSelfAttention,
    RowParallelLinear,
    SelfAttention,
    TensorParallelModule,
)


class UserAttention(nn.Module):
    """A user's causal attention: the flag is ``mask_future`` (not ``causal``), and a
    learned per-head temperature ``gate`` scales the scores."""

    def __init__(self, dim: int, num_heads: int, *, mask_future: bool = True) -> None:
        super().__init__()
        self.num_heads, self.mask_future = num_heads, mask_future
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.gate = nn.Parameter(torch.full((num_heads, 1, 1), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        h, hd = self.num_heads, e // self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, s, h, hd).transpose(1, 2)

        att = split(self.q(x)) @ split(self.k(x)).transpose(-2, -1) / math.sqrt(hd) * self.gate
        if self.mask_future:
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = (att.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(b, s, e)
        return self.o(ctx)


class OptInAttention(nn.Module):
    """Causal attention under its own flag name, opting in with an exact spec."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.heads, self.mask_future = num_heads, True
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = SelfAttention.attend(self.q(x), self.k(x), self.v(x), self.heads, self.mask_future)
        return self.o(ctx)

    def __paratrain_tp_attention__(self) -> AttentionSpec:
        return AttentionSpec(self.q, self.k, self.v, self.o, self.heads, causal=self.mask_future)


class OptInWithGate(UserAttention):
    def __paratrain_tp_attention__(self) -> AttentionSpec:
        return AttentionSpec(self.q, self.k, self.v, self.o, self.num_heads, self.mask_future)


class KeepWhole(UserAttention):
    def __paratrain_tp_attention__(self) -> None:
        return None


class LoRALinear(nn.Linear):
    """A Linear with a low-rank update: not x W^T + b, so it must not be sliced."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.a = nn.Parameter(torch.randn(2, i) * 0.1)
        self.b = nn.Parameter(torch.randn(o, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.a.T @ self.b.T


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = attn
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, 32), act=nn.GELU(),
                                             fc2=nn.Linear(32, dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


def _layout(model: nn.Module, tp: int = 2) -> TensorParallelModule:
    """Conversion only (no collectives): what ``paratrain validate`` builds."""
    comm = TPComm(None, list(range(tp)), rank=0, pattern="AllReduce")
    cfg = TensorParallelismConfig(tensor_parallel_size=tp, memory_optimization="None")
    return TensorParallelModule(model, cfg, TPGroups(comm, None, tp, 1, 0))


def _model(attn: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(embed=nn.Linear(8, 16), block=Block(attn), head=nn.Linear(16, 3)))


# ------------------------------------------------------------------ conversion (1 process)


def test_look_alike_attention_is_refused_naming_the_module() -> None:
    with pytest.raises(ConfigError) as e:
        _layout(_model(UserAttention(16, 4)))
    msg = str(e.value)
    assert "block.attn (UserAttention)" in msg
    assert "__paratrain_tp_attention__" in msg
    assert e.value.problems[0][0] == "model"


def test_subclass_of_own_attention_with_new_forward_is_refused() -> None:
    class Scaled(SelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with pytest.raises(ConfigError, match=r"block\.attn \(.*Scaled\)"):
        _layout(_model(Scaled(16, 4)))


def test_opt_in_spec_with_extra_parameters_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"block\.attn \(OptInWithGate\): gate is not part of q/k/v/o"):
        _layout(_model(OptInWithGate(16, 4)))


def test_opt_in_returning_none_keeps_the_module_whole() -> None:
    tpm = _layout(_model(KeepWhole(16, 4)))
    attn = tpm.module.block.attn
    assert type(attn) is KeepWhole and all(type(getattr(attn, n)) is nn.Linear for n in "qkvo")
    assert isinstance(tpm.module.block.mlp.fc1, ColumnParallelLinear)  # the rest still shards


def test_own_and_opt_in_attention_convert() -> None:
    for attn in (SelfAttention(16, 4, causal=True), OptInAttention(16, 4)):
        tpm = _layout(_model(attn))
        conv = tpm.module.block.attn
        assert isinstance(conv, ParallelSelfAttention)
        assert conv.causal and conv.local_heads == 2


def test_encoder_layers_that_are_not_standard_are_refused() -> None:
    class Custom(nn.TransformerEncoderLayer):
        def _sa_block(self, x: Any, attn_mask: Any, key_padding_mask: Any, is_causal: bool = False) -> Any:
            return 2 * super()._sa_block(x, attn_mask, key_padding_mask, is_causal)

    cases = [
        (Custom(16, 4, 32, dropout=0.0, batch_first=True), "overrides _sa_block"),
        (nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True), "attention dropout 0.1"),
        (nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0), "batch_first=False"),
    ]
    for layer, why in cases:
        model = nn.Sequential(OrderedDict(embed=nn.Linear(8, 16), enc=layer, head=nn.Linear(16, 3)))
        with pytest.raises(ConfigError, match=rf"enc \(.*\): .*{why}"):
            _layout(model)
    ok = nn.Sequential(OrderedDict(embed=nn.Linear(8, 16),
                                   enc=nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)))
    assert type(_layout(ok).module.enc).__name__ == "ParallelEncoderLayer"


def test_linear_subclass_is_not_sliced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc0=LoRALinear(16, 32), act=nn.ReLU(), fc1=nn.Linear(32, 8),
                                      act1=nn.ReLU(), fc2=nn.Linear(8, 16), act2=nn.ReLU(),
                                      fc3=nn.Linear(16, 4)))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tpm = _layout(model)
    m = tpm.module
    assert type(m.fc0) is LoRALinear and m.fc0.weight.shape == (32, 16)  # whole, replicated
    assert any("fc0 (LoRALinear)" in str(x.message) and "replicated" in str(x.message) for x in w)
    # the plain Linears after it still pair up
    assert isinstance(m.fc1, ColumnParallelLinear) and isinstance(m.fc2, RowParallelLinear)


def test_custom_activation_breaks_a_pair() -> None:
    class Mix(nn.ReLU):  # not element-wise: mixes features
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.cumsum(-1)

    model = nn.Sequential(OrderedDict(fc0=nn.Linear(16, 32), act=Mix(), fc1=nn.Linear(32, 8),
                                      act1=nn.GELU(), fc2=nn.Linear(8, 4)))
    m = _layout(model).module
    # fc0 -> Mix -> fc1 is no pair (a column shard would feed cumsum a slice); fc1/fc2 pair
    assert type(m.fc0) is nn.Linear
    assert isinstance(m.fc1, ColumnParallelLinear) and isinstance(m.fc2, RowParallelLinear)


# ------------------------------------------------------------------ parity (2 gloo ranks)


def parity_worker(ctx: Any) -> dict[str, float]:
    from paratrain.tensor_parallel import parallelize

    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 8, generator=g)
    w = torch.randn(3, 6, 3, generator=g)
    cfg = TensorParallelismConfig(tensor_parallel_size=2, memory_optimization="None")
    for name in ("own", "opt_in"):
        torch.manual_seed(5)  # the same full model on every rank
        attn = SelfAttention(16, 4, causal=True) if name == "own" else OptInAttention(16, 4)
        dense = _model(attn)
        tpm = parallelize(copy.deepcopy(dense), cfg)
        assert isinstance(tpm.module.block.attn, ParallelSelfAttention)
        d_out = dense(x)
        (d_out * w).sum().backward()
        t_out = tpm(x)
        (t_out * w).sum().backward()
        tpm.sync_gradients()
        grads = tpm.gather_full({n: p.grad for n, p in tpm.module.named_parameters()})
        out[f"{name}/out"] = float((d_out - t_out).detach().abs().max())
        out[f"{name}/grads"] = max(float((p.grad - grads[n]).abs().max())
                                   for n, p in dense.named_parameters())
        # non-vacuity: the causal mask matters for this input
        ref = copy.deepcopy(dense)
        setattr(ref.block.attn, "causal" if name == "own" else "mask_future", False)
        out[f"{name}/no_mask"] = float((ref(x) - d_out).detach().abs().max())
    return out


@pytest.mark.slow
def test_own_and_opt_in_attention_match_the_dense_model_on_2_ranks() -> None:
    from paratrain.comm.testing import run_distributed

    for r in run_distributed(parity_worker, 2, timeout_s=180):
        for name in ("own", "opt_in"):
            assert r[f"{name}/out"] < 1e-5 and r[f"{name}/grads"] < 1e-5, r
            assert r[f"{name}/no_mask"] > 1e-3, r
